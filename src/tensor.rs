//! Strided views of the tensors a call reads and writes, built from cudarc views.
//!
//! Strides are in elements, the last dimension is always contiguous. Token counts come from
//! the [`DecodePlan`](crate::DecodePlan): a view only has to be long enough for them, so
//! slices of larger, preallocated buffers work.

use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use crate::types::{HEAD_DIM, LATENT_DIM};
use crate::validate::{Buf, CacheDesc, IndicesDesc, QueryDesc, Rows, TableDesc};

/// The numbers validation needs about a cudarc buffer whose device address is `addr`.
pub(crate) fn buf_of<T, S: DeviceSlice<T>>(s: &S, addr: u64) -> Buf {
    Buf {
        addr,
        bytes: s.num_bytes(),
        device: s.stream().context().ordinal(),
    }
}

/// A read-only device buffer's address, description and cudarc sync guard.
pub(crate) fn bind<'s, T>(
    v: &'s CudaView<'_, T>,
    stream: &'s CudaStream,
) -> (u64, Buf, SyncOnDrop<'s>) {
    let (ptr, guard) = v.device_ptr(stream);
    (ptr, buf_of(v, ptr), guard)
}

/// A writable device buffer's address, description and cudarc sync guard.
pub(crate) fn bind_mut<'s, T>(
    v: &'s mut CudaViewMut<'_, T>,
    stream: &'s CudaStream,
) -> (u64, Buf, SyncOnDrop<'s>) {
    let bytes = v.num_bytes();
    let device = v.stream().context().ordinal();
    let (addr, guard) = v.device_ptr_mut(stream);
    (
        addr,
        Buf {
            addr,
            bytes,
            device,
        },
        guard,
    )
}

#[derive(Debug)]
enum QueryLayout<'a, T> {
    Packed {
        q: CudaView<'a, T>,
        token_stride: usize,
        head_stride: usize,
    },
    Split {
        nope: CudaView<'a, T>,
        nope_strides: (usize, usize),
        rope: CudaView<'a, T>,
        rope_strides: (usize, usize),
    },
}

/// Queries `[tokens, heads, 576]`, packed or as separate nope `[.., 512]` and rope `[.., 64]`.
#[derive(Debug)]
pub struct Query<'a, T> {
    layout: QueryLayout<'a, T>,
    num_heads: Option<usize>,
}

/// Device addresses of a bound query: (q_nope, q_rope) with their (token, head) strides.
pub(crate) struct BoundQuery<'s> {
    pub desc: QueryDesc,
    pub nope: (u64, usize, usize),
    pub rope: (u64, usize, usize),
    _guards: (SyncOnDrop<'s>, Option<SyncOnDrop<'s>>),
}

impl<'a, T> Query<'a, T> {
    /// A dense `[tokens, num_heads, 576]` tensor.
    pub fn contiguous(q: CudaView<'a, T>, num_heads: usize) -> Self {
        Query {
            layout: QueryLayout::Packed {
                q,
                token_stride: num_heads * HEAD_DIM,
                head_stride: HEAD_DIM,
            },
            num_heads: Some(num_heads),
        }
    }

    /// Packed 576-wide rows with a token and a head stride (elements).
    pub fn strided(q: CudaView<'a, T>, token_stride: usize, head_stride: usize) -> Self {
        Query {
            layout: QueryLayout::Packed {
                q,
                token_stride,
                head_stride,
            },
            num_heads: None,
        }
    }

    /// Separate nope `[tokens, heads, 512]` and rope `[tokens, heads, 64]` tensors, each with
    /// its (token, head) strides: saves engines a concat.
    pub fn split(
        nope: CudaView<'a, T>,
        nope_token_stride: usize,
        nope_head_stride: usize,
        rope: CudaView<'a, T>,
        rope_token_stride: usize,
        rope_head_stride: usize,
    ) -> Self {
        Query {
            layout: QueryLayout::Split {
                nope,
                nope_strides: (nope_token_stride, nope_head_stride),
                rope,
                rope_strides: (rope_token_stride, rope_head_stride),
            },
            num_heads: None,
        }
    }

    /// Whether the query comes as two tensors.
    pub fn is_split(&self) -> bool {
        matches!(self.layout, QueryLayout::Split { .. })
    }

    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> BoundQuery<'s> {
        match &self.layout {
            QueryLayout::Packed {
                q,
                token_stride,
                head_stride,
            } => {
                let (ptr, buf, guard) = bind(q, stream);
                let rope = ptr + (LATENT_DIM * std::mem::size_of::<T>()) as u64;
                BoundQuery {
                    desc: QueryDesc::Packed(Rows {
                        buf,
                        token_stride: *token_stride,
                        head_stride: *head_stride,
                        num_heads: self.num_heads,
                    }),
                    nope: (ptr, *token_stride, *head_stride),
                    rope: (rope, *token_stride, *head_stride),
                    _guards: (guard, None),
                }
            }
            QueryLayout::Split {
                nope,
                nope_strides,
                rope,
                rope_strides,
            } => {
                let (np, nbuf, ng) = bind(nope, stream);
                let (rp, rbuf, rg) = bind(rope, stream);
                BoundQuery {
                    desc: QueryDesc::Split {
                        nope: Rows {
                            buf: nbuf,
                            token_stride: nope_strides.0,
                            head_stride: nope_strides.1,
                            num_heads: None,
                        },
                        rope: Rows {
                            buf: rbuf,
                            token_stride: rope_strides.0,
                            head_stride: rope_strides.1,
                            num_heads: None,
                        },
                    },
                    nope: (np, nope_strides.0, nope_strides.1),
                    rope: (rp, rope_strides.0, rope_strides.1),
                    _guards: (ng, Some(rg)),
                }
            }
        }
    }
}

/// Attention output `[tokens, heads, 512]` in the query dtype, strided.
#[derive(Debug)]
pub struct Output<'a, T> {
    view: CudaViewMut<'a, T>,
    token_stride: usize,
    head_stride: usize,
    num_heads: Option<usize>,
}

impl<'a, T> Output<'a, T> {
    /// A dense `[tokens, num_heads, 512]` tensor.
    pub fn contiguous(view: CudaViewMut<'a, T>, num_heads: usize) -> Self {
        Output {
            view,
            token_stride: num_heads * LATENT_DIM,
            head_stride: LATENT_DIM,
            num_heads: Some(num_heads),
        }
    }

    /// 512-wide rows with a token and a head stride (elements).
    pub fn strided(view: CudaViewMut<'a, T>, token_stride: usize, head_stride: usize) -> Self {
        Output {
            view,
            token_stride,
            head_stride,
            num_heads: None,
        }
    }

    pub(crate) fn bind<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, Rows, SyncOnDrop<'s>) {
        bind_rows(
            &mut self.view,
            stream,
            self.token_stride,
            self.head_stride,
            self.num_heads,
        )
    }
}

/// Log-sum-exp `[tokens, heads]` f32 (natural log; `-inf` where nothing is visible), strided.
#[derive(Debug)]
pub struct Lse<'a> {
    view: CudaViewMut<'a, f32>,
    token_stride: usize,
    head_stride: usize,
    num_heads: Option<usize>,
}

impl<'a> Lse<'a> {
    /// A dense `[tokens, num_heads]` tensor.
    pub fn contiguous(view: CudaViewMut<'a, f32>, num_heads: usize) -> Self {
        Lse {
            view,
            token_stride: num_heads,
            head_stride: 1,
            num_heads: Some(num_heads),
        }
    }

    /// With a token and a head stride (elements); `(1, tokens)` gives a `[heads, tokens]` layout.
    pub fn strided(view: CudaViewMut<'a, f32>, token_stride: usize, head_stride: usize) -> Self {
        Lse {
            view,
            token_stride,
            head_stride,
            num_heads: None,
        }
    }

    pub(crate) fn bind<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, Rows, SyncOnDrop<'s>) {
        bind_rows(
            &mut self.view,
            stream,
            self.token_stride,
            self.head_stride,
            self.num_heads,
        )
    }
}

/// A strided `[tokens, heads, ..]` output's address, description and sync guard.
fn bind_rows<'s, T>(
    view: &'s mut CudaViewMut<'_, T>,
    stream: &'s CudaStream,
    token_stride: usize,
    head_stride: usize,
    num_heads: Option<usize>,
) -> (u64, Rows, SyncOnDrop<'s>) {
    let (ptr, buf, guard) = bind_mut(view, stream);
    let rows = Rows {
        buf,
        token_stride,
        head_stride,
        num_heads,
    };
    (ptr, rows, guard)
}

fn blocks_in(len: usize, block_size: usize) -> usize {
    len.checked_div(block_size * HEAD_DIM).unwrap_or(0)
}

fn block_bytes<T>(block_size: usize) -> usize {
    block_size * HEAD_DIM * std::mem::size_of::<T>()
}

/// A paged cache to read: `num_blocks` blocks of `block_size` rows of 576 values, blocks
/// `block_stride_bytes` apart.
#[derive(Debug)]
pub struct KvCache<'a, T> {
    view: CudaView<'a, T>,
    block_size: usize,
    num_blocks: usize,
    block_stride_bytes: usize,
}

/// A paged cache to append to (same layout as [`KvCache`]).
#[derive(Debug)]
pub struct KvCacheMut<'a, T> {
    view: CudaViewMut<'a, T>,
    block_size: usize,
    num_blocks: usize,
    block_stride_bytes: usize,
}

macro_rules! cache_common {
    ($name:ident, $view:ident) => {
        impl<'a, T> $name<'a, T> {
            /// Unpadded blocks: as many whole blocks of `block_size` rows as the view holds.
            pub fn contiguous(view: $view<'a, T>, block_size: usize) -> Self {
                $name {
                    num_blocks: blocks_in(view.len(), block_size),
                    block_stride_bytes: block_bytes::<T>(block_size),
                    view,
                    block_size,
                }
            }

            /// Padded blocks: block `b` starts `b · block_stride_bytes` bytes into the view.
            pub fn strided(
                view: $view<'a, T>,
                block_size: usize,
                num_blocks: usize,
                block_stride_bytes: usize,
            ) -> Self {
                $name {
                    view,
                    block_size,
                    num_blocks,
                    block_stride_bytes,
                }
            }

            /// Rows per block.
            pub fn block_size(&self) -> usize {
                self.block_size
            }

            /// Number of blocks.
            pub fn num_blocks(&self) -> usize {
                self.num_blocks
            }

            /// Bytes from one block to the next.
            pub fn block_stride_bytes(&self) -> usize {
                self.block_stride_bytes
            }

            /// Slots (`num_blocks · block_size`): global slot ids run over `0..num_slots()`.
            pub fn num_slots(&self) -> usize {
                self.num_blocks * self.block_size
            }
        }
    };
}
cache_common!(KvCache, CudaView);
cache_common!(KvCacheMut, CudaViewMut);

impl<T> KvCache<'_, T> {
    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> (u64, CacheDesc, SyncOnDrop<'s>) {
        let (ptr, buf, guard) = bind(&self.view, stream);
        let desc = CacheDesc {
            buf,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            block_stride_bytes: self.block_stride_bytes,
        };
        (ptr, desc, guard)
    }
}

impl<T> KvCacheMut<'_, T> {
    pub(crate) fn bind<'s>(
        &'s mut self,
        stream: &'s CudaStream,
    ) -> (u64, CacheDesc, SyncOnDrop<'s>) {
        let (num_blocks, block_size, block_stride_bytes) =
            (self.num_blocks, self.block_size, self.block_stride_bytes);
        let (ptr, buf, guard) = bind_mut(&mut self.view, stream);
        let desc = CacheDesc {
            buf,
            num_blocks,
            block_size,
            block_stride_bytes,
        };
        (ptr, desc, guard)
    }
}

/// Block table `[batch, max_blocks_per_seq]` int32, rows `stride` elements apart.
#[derive(Debug)]
pub struct BlockTable<'a> {
    view: CudaView<'a, i32>,
    batch: usize,
    max_blocks_per_seq: usize,
    stride: usize,
}

impl<'a> BlockTable<'a> {
    /// A dense `[batch, max_blocks_per_seq]` table.
    pub fn new(view: CudaView<'a, i32>, batch: usize, max_blocks_per_seq: usize) -> Self {
        BlockTable::strided(view, batch, max_blocks_per_seq, max_blocks_per_seq)
    }

    /// Rows `stride >= max_blocks_per_seq` elements apart.
    pub fn strided(
        view: CudaView<'a, i32>,
        batch: usize,
        max_blocks_per_seq: usize,
        stride: usize,
    ) -> Self {
        BlockTable {
            view,
            batch,
            max_blocks_per_seq,
            stride,
        }
    }

    /// Requests (rows).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Block ids per request.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_blocks_per_seq
    }

    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> (u64, TableDesc, SyncOnDrop<'s>) {
        let (ptr, buf, guard) = bind(&self.view, stream);
        let desc = TableDesc {
            buf,
            batch: self.batch,
            max_blocks_per_seq: self.max_blocks_per_seq,
            stride: self.stride,
        };
        (ptr, desc, guard)
    }
}

/// Sparse indices `[tokens, stride]` int32 of global slot ids (`-1` = none), `topk` used per
/// row.
///
/// Per-row lengths (`topk_len`) are not part of the indices: they are a separate argument of
/// [`sparse_decode`](crate::sparse_decode).
#[derive(Debug)]
pub struct SparseIndices<'a> {
    view: CudaView<'a, i32>,
    topk: usize,
    stride: usize,
}

impl<'a> SparseIndices<'a> {
    /// A dense `[tokens, topk]` tensor.
    pub fn contiguous(view: CudaView<'a, i32>, topk: usize) -> Self {
        SparseIndices::strided(view, topk, topk)
    }

    /// Rows `stride >= topk` elements apart.
    pub fn strided(view: CudaView<'a, i32>, topk: usize, stride: usize) -> Self {
        SparseIndices { view, topk, stride }
    }

    /// Entries per row.
    pub fn topk(&self) -> usize {
        self.topk
    }

    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> (u64, IndicesDesc, SyncOnDrop<'s>) {
        let (ptr, buf, guard) = bind(&self.view, stream);
        let desc = IndicesDesc {
            buf,
            topk: self.topk,
            stride: self.stride,
        };
        (ptr, desc, guard)
    }
}
