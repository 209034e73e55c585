//! Strided views of the tensors a call reads and writes, over cudarc buffers.
//!
//! Each view holds a cudarc view of a buffer and adds its layout. Constructors take `&buf`
//! (read) or `&mut buf` (written) for a `CudaSlice`, `CudaView` or `CudaViewMut`, or a cudarc
//! view by value ([`IntoDeviceRead`], [`IntoDeviceWrite`]), so a helper may return a view
//! over a sub-range it sliced itself.
//!
//! Strides are in elements and the last dimension is always contiguous. Views only
//! describe: every check runs in the call that uses them, against the plan. Token counts
//! come from the plan (decode) or from the call's explicit `num_tokens` (append, gather): a
//! buffer only has to be long enough, so preallocated maximum-size buffers work without
//! slicing.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DeviceSlice};

use crate::buffer::{
    self, sealed, AnyBitPattern, Bound, DeviceWrite, IntoDeviceRead, IntoDeviceWrite,
};
use crate::error::{Error, Result};
use crate::types::{DType, KvFormat, BLOCK_SIZES, HEAD_DIM, LATENT_DIM};
use crate::validate::{CacheDesc, IndicesDesc, QueryDesc, Rows, TableDesc};

/// Strides, in elements, of a `[tokens, heads, width]` tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Strides {
    /// Elements from one token (query row) to the next.
    pub token: usize,
    /// Elements from one head to the next.
    pub head: usize,
}

impl Strides {
    /// The strides of a dense `[tokens, num_heads, width]` tensor.
    pub(crate) const fn contiguous(num_heads: usize, width: usize) -> Strides {
        Strides {
            token: num_heads * width,
            head: width,
        }
    }
}

#[derive(Debug)]
enum QueryLayout<'a, T> {
    Packed {
        q: CudaView<'a, T>,
        strides: Strides,
    },
    Split {
        nope: CudaView<'a, T>,
        nope_strides: Strides,
        rope: CudaView<'a, T>,
        rope_strides: Strides,
    },
}

/// Queries `[tokens, heads, 576]`, packed or as separate nope `[.., 512]` and rope `[.., 64]`.
#[derive(Debug)]
pub struct Query<'a, T> {
    layout: QueryLayout<'a, T>,
    num_heads: Option<usize>,
}

impl<T> Clone for Query<'_, T> {
    fn clone(&self) -> Self {
        let layout = match &self.layout {
            QueryLayout::Packed { q, strides } => QueryLayout::Packed {
                q: q.slice(..),
                strides: *strides,
            },
            QueryLayout::Split {
                nope,
                nope_strides,
                rope,
                rope_strides,
            } => QueryLayout::Split {
                nope: nope.slice(..),
                nope_strides: *nope_strides,
                rope: rope.slice(..),
                rope_strides: *rope_strides,
            },
        };
        Query {
            layout,
            num_heads: self.num_heads,
        }
    }
}

/// A bound query: device addresses of (q_nope, q_rope) with their strides, and the guards.
pub(crate) struct BoundQuery<'s> {
    pub desc: QueryDesc,
    pub nope: (u64, Strides),
    pub rope: (u64, Strides),
    _guards: (Bound<'s>, Option<Bound<'s>>),
}

impl<'a, T> Query<'a, T> {
    /// A dense `[tokens, num_heads, 576]` tensor.
    pub fn contiguous(q: impl IntoDeviceRead<'a, T>, num_heads: usize) -> Self {
        Query {
            layout: QueryLayout::Packed {
                q: sealed::IntoView::into_view(q),
                strides: Strides::contiguous(num_heads, HEAD_DIM),
            },
            num_heads: Some(num_heads),
        }
    }

    /// Packed 576-wide rows with a token and a head stride.
    pub fn strided(q: impl IntoDeviceRead<'a, T>, strides: Strides) -> Self {
        Query {
            layout: QueryLayout::Packed {
                q: sealed::IntoView::into_view(q),
                strides,
            },
            num_heads: None,
        }
    }

    /// Separate nope `[tokens, heads, 512]` and rope `[tokens, heads, 64]` tensors, each with
    /// its strides: saves engines a concat.
    pub fn split(
        nope: impl IntoDeviceRead<'a, T>,
        nope_strides: Strides,
        rope: impl IntoDeviceRead<'a, T>,
        rope_strides: Strides,
    ) -> Self {
        Query {
            layout: QueryLayout::Split {
                nope: sealed::IntoView::into_view(nope),
                nope_strides,
                rope: sealed::IntoView::into_view(rope),
                rope_strides,
            },
            num_heads: None,
        }
    }

    /// Whether the query comes as two tensors.
    pub fn is_split(&self) -> bool {
        matches!(self.layout, QueryLayout::Split { .. })
    }

    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> BoundQuery<'s> {
        let rows = |b: &Bound, s: Strides, num_heads| Rows {
            buf: b.buf,
            token_stride: s.token,
            head_stride: s.head,
            num_heads,
        };
        match self.layout {
            QueryLayout::Packed { ref q, strides } => {
                let b = buffer::read(q, stream);
                let rope = b.addr + (LATENT_DIM * std::mem::size_of::<T>()) as u64;
                BoundQuery {
                    desc: QueryDesc::Packed(rows(&b, strides, self.num_heads)),
                    nope: (b.addr, strides),
                    rope: (rope, strides),
                    _guards: (b, None),
                }
            }
            QueryLayout::Split {
                ref nope,
                nope_strides,
                ref rope,
                rope_strides,
            } => {
                let n = buffer::read(nope, stream);
                let r = buffer::read(rope, stream);
                BoundQuery {
                    desc: QueryDesc::Split {
                        nope: rows(&n, nope_strides, None),
                        rope: rows(&r, rope_strides, None),
                    },
                    nope: (n.addr, nope_strides),
                    rope: (r.addr, rope_strides),
                    _guards: (n, Some(r)),
                }
            }
        }
    }
}

/// A strided `[tokens, heads, ..]` tensor a call writes.
#[derive(Debug)]
struct RowsMut<'a, T> {
    buf: CudaViewMut<'a, T>,
    strides: Strides,
    num_heads: Option<usize>,
}

impl<T> RowsMut<'_, T> {
    fn bind<'s>(&'s mut self, stream: &'s CudaStream) -> (Rows, Bound<'s>) {
        let b = buffer::write(&mut self.buf, stream);
        let rows = Rows {
            buf: b.buf,
            token_stride: self.strides.token,
            head_stride: self.strides.head,
            num_heads: self.num_heads,
        };
        (rows, b)
    }
}

/// Attention output `[tokens, heads, 512]` in the query dtype, strided.
#[derive(Debug)]
pub struct Output<'a, T>(RowsMut<'a, T>);

impl<'a, T> Output<'a, T> {
    /// A dense `[tokens, num_heads, 512]` tensor.
    pub fn contiguous(out: impl IntoDeviceWrite<'a, T>, num_heads: usize) -> Self {
        Output(RowsMut {
            buf: sealed::IntoViewMut::into_view_mut(out),
            strides: Strides::contiguous(num_heads, LATENT_DIM),
            num_heads: Some(num_heads),
        })
    }

    /// 512-wide rows with a token and a head stride.
    pub fn strided(out: impl IntoDeviceWrite<'a, T>, strides: Strides) -> Self {
        Output(RowsMut {
            buf: sealed::IntoViewMut::into_view_mut(out),
            strides,
            num_heads: None,
        })
    }

    pub(crate) fn bind<'s>(&'s mut self, stream: &'s CudaStream) -> (Rows, Bound<'s>) {
        self.0.bind(stream)
    }
}

/// Log-sum-exp `[tokens, heads]` f32 (natural log; `-inf` where nothing is visible), strided.
#[derive(Debug)]
pub struct Lse<'a>(RowsMut<'a, f32>);

impl<'a> Lse<'a> {
    /// A dense `[tokens, num_heads]` tensor.
    pub fn contiguous(lse: impl IntoDeviceWrite<'a, f32>, num_heads: usize) -> Self {
        Lse(RowsMut {
            buf: sealed::IntoViewMut::into_view_mut(lse),
            strides: Strides::contiguous(num_heads, 1),
            num_heads: Some(num_heads),
        })
    }

    /// With a token and a head stride, e.g. `Strides { token: 1, head: tokens }` for a
    /// head-major `[heads, tokens]` tensor. FlashMLA's `[batch, heads, q_len]` is the
    /// contiguous layout for q_len = 1 and not reachable through the strides for q_len > 1
    /// (docs/DESIGN.md §11, README "Porting from FlashMLA").
    pub fn strided(lse: impl IntoDeviceWrite<'a, f32>, strides: Strides) -> Self {
        Lse(RowsMut {
            buf: sealed::IntoViewMut::into_view_mut(lse),
            strides,
            num_heads: None,
        })
    }

    pub(crate) fn bind<'s>(&'s mut self, stream: &'s CudaStream) -> (Rows, Bound<'s>) {
        self.0.bind(stream)
    }
}

/// How a paged cache's bytes are laid out: `num_blocks` blocks of `block_size` rows in
/// `format`, blocks `block_stride_bytes` apart (padding between blocks is allowed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheLayout {
    /// How each row is stored (and so its bytes).
    pub format: KvFormat,
    /// Rows per block: 16, 32, 64 or 128.
    pub block_size: usize,
    /// Blocks; global slot ids run over `0..num_blocks · block_size`.
    pub num_blocks: usize,
    /// Bytes from one block to the next: a multiple of 16, at least
    /// `block_size · format.row_bytes()`.
    pub block_stride_bytes: usize,
}

impl CacheLayout {
    /// Unpadded blocks filling `bytes` exactly: an error naming `kv_cache` when `bytes` is not
    /// a whole number of blocks (a trailing partial block would make valid-looking block
    /// ids unreadable), or `block_size` when it is not one of [`BLOCK_SIZES`].
    pub(crate) fn contiguous(
        format: KvFormat,
        block_size: usize,
        bytes: usize,
    ) -> Result<CacheLayout> {
        if !BLOCK_SIZES.contains(&block_size) {
            return Err(Error::invalid(
                "block_size",
                format!("block_size {block_size}: want one of {BLOCK_SIZES:?}"),
            ));
        }
        let block_bytes = block_size * format.row_bytes();
        if bytes % block_bytes != 0 {
            return Err(Error::invalid(
                "kv_cache",
                format!(
                    "{bytes} bytes is not a whole number of {block_size}-row {format} blocks \
                     ({block_bytes} bytes each): {} blocks and {} bytes over",
                    bytes / block_bytes,
                    bytes % block_bytes
                ),
            ));
        }
        Ok(CacheLayout {
            format,
            block_size,
            num_blocks: bytes / block_bytes,
            block_stride_bytes: block_bytes,
        })
    }

    /// Slots (`num_blocks · block_size`): global slot ids run over `0..num_slots()`.
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// A paged cache to read: bytes in a [`CacheLayout`], plus the per-tensor scale of a
/// [`KvFormat::Fp8PerTensor`] cache.
///
/// The cache is not typed by the query's element type: an f16/bf16 cache is usually a
/// `CudaSlice<f16>`/`CudaSlice<bf16>`, an fp8 cache a `CudaSlice<u8>`; any
/// [`AnyBitPattern`] element type is accepted and only the bytes count, except that a
/// buffer of `f16` declared [`KvFormat::Bf16`] (or of `bf16` declared `F16`) is refused by
/// the call that uses it (`kv_cache`): that mix-up would read every value wrong. Cheap to
/// clone.
#[derive(Debug)]
pub struct KvCache<'a> {
    bytes: CudaView<'a, u8>,
    layout: CacheLayout,
    scale: Option<CudaView<'a, f32>>,
    elem: Option<DType>,
}

impl Clone for KvCache<'_> {
    fn clone(&self) -> Self {
        KvCache {
            bytes: self.bytes.slice(..),
            layout: self.layout,
            scale: self.scale.as_ref().map(|s| s.slice(..)),
            elem: self.elem,
        }
    }
}

/// A paged cache to append to (same layout as [`KvCache`]).
#[derive(Debug)]
pub struct KvCacheMut<'a> {
    bytes: CudaViewMut<'a, u8>,
    layout: CacheLayout,
    scale: Option<CudaView<'a, f32>>,
    elem: Option<DType>,
}

/// The bytes of a view.
fn bytes_of<'a, E>(v: CudaView<'a, E>) -> CudaView<'a, u8> {
    let n = v.num_bytes();
    // SAFETY: every byte pattern is a valid u8; the view covers exactly the same memory.
    unsafe { v.transmute::<u8>(n) }.expect("a view holds its own bytes")
}

impl<'a> KvCache<'a> {
    /// Unpadded blocks of `block_size` rows in `format` filling the whole buffer: an error
    /// naming `kv_cache` when its byte length is not a whole number of blocks (a trailing
    /// partial block would turn valid-looking block ids into device faults), or
    /// `block_size` when that is not one of [`BLOCK_SIZES`].
    pub fn contiguous<E: AnyBitPattern + 'a>(
        kv_cache: impl IntoDeviceRead<'a, E>,
        format: KvFormat,
        block_size: usize,
    ) -> Result<Self> {
        let view = sealed::IntoView::into_view(kv_cache);
        let layout = CacheLayout::contiguous(format, block_size, view.num_bytes())?;
        Ok(KvCache::new(view, layout))
    }

    /// Blocks as `layout` says (padded blocks, or only the first blocks of a buffer);
    /// checked by the call that uses it.
    pub fn new<E: AnyBitPattern + 'a>(
        kv_cache: impl IntoDeviceRead<'a, E>,
        layout: CacheLayout,
    ) -> Self {
        KvCache {
            bytes: bytes_of(sealed::IntoView::into_view(kv_cache)),
            layout,
            scale: None,
            elem: buffer::half_of::<E>(),
        }
    }

    /// The device-resident fp32 scale of a [`KvFormat::Fp8PerTensor`] cache (dequant = e4m3 ·
    /// `scale[0]`); required for that format, rejected for the others. It must hold a finite
    /// number > 0 when the call runs; another (e.g. a buffer never written: 0) is used as it
    /// is and recorded as [`FaultCode::BadKvScale`](crate::FaultCode::BadKvScale).
    pub fn with_scale(self, scale: impl IntoDeviceRead<'a, f32>) -> Self {
        KvCache {
            scale: Some(sealed::IntoView::into_view(scale)),
            ..self
        }
    }

    /// The layout.
    pub fn layout(&self) -> CacheLayout {
        self.layout
    }

    /// How rows are stored.
    pub fn format(&self) -> KvFormat {
        self.layout.format
    }

    /// Rows per block.
    pub fn block_size(&self) -> usize {
        self.layout.block_size
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.layout.num_blocks
    }

    /// Bytes from one block to the next.
    pub fn block_stride_bytes(&self) -> usize {
        self.layout.block_stride_bytes
    }

    /// Slots (`num_blocks · block_size`): global slot ids run over `0..num_slots()`.
    pub fn num_slots(&self) -> usize {
        self.layout.num_slots()
    }

    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> BoundCache<'s> {
        let data = buffer::read(&self.bytes, stream);
        let scale = buffer::read_opt(&self.scale, stream);
        BoundCache::new(data, scale, self.layout, self.elem)
    }
}

impl<'a> KvCacheMut<'a> {
    /// Unpadded blocks of `block_size` rows in `format` filling the whole buffer; errors as
    /// [`KvCache::contiguous`].
    ///
    /// Takes `&mut buf` only (not a `CudaViewMut` by value). For a sub-range, bind the view
    /// first, so that it outlives the cache view:
    /// `let mut part = buf.slice_mut(a..b); let kc = KvCacheMut::contiguous(&mut part, format, bs)?;`
    /// (`&mut buf.slice_mut(a..b)` inline is a temporary that the returned view would
    /// outlive: error E0716).
    pub fn contiguous<E: AnyBitPattern>(
        kv_cache: &'a mut impl DeviceWrite<E>,
        format: KvFormat,
        block_size: usize,
    ) -> Result<Self> {
        let bytes = sealed::Write::bytes_mut(kv_cache);
        let layout = CacheLayout::contiguous(format, block_size, bytes.len())?;
        Ok(KvCacheMut {
            bytes,
            layout,
            scale: None,
            elem: buffer::half_of::<E>(),
        })
    }

    /// Blocks as `layout` says; checked by the call that uses it.
    pub fn new<E: AnyBitPattern>(
        kv_cache: &'a mut impl DeviceWrite<E>,
        layout: CacheLayout,
    ) -> Self {
        KvCacheMut {
            bytes: sealed::Write::bytes_mut(kv_cache),
            layout,
            scale: None,
            elem: buffer::half_of::<E>(),
        }
    }

    /// The device-resident fp32 scale of a [`KvFormat::Fp8PerTensor`] cache (append
    /// quantizes with it); required for that format, rejected for the others. It must hold a
    /// finite number > 0; another is used as it is (IEEE division: 0 stores ±448 and NaN) and
    /// recorded as [`FaultCode::BadKvScale`](crate::FaultCode::BadKvScale).
    pub fn with_scale(self, scale: impl IntoDeviceRead<'a, f32>) -> Self {
        KvCacheMut {
            scale: Some(sealed::IntoView::into_view(scale)),
            ..self
        }
    }

    /// The same cache, read-only (e.g. for the decode or gather that follows an append).
    pub fn as_cache(&self) -> KvCache<'_> {
        KvCache {
            bytes: self.bytes.as_view(),
            layout: self.layout,
            scale: self.scale.as_ref().map(|s| s.slice(..)),
            elem: self.elem,
        }
    }

    /// The layout.
    pub fn layout(&self) -> CacheLayout {
        self.layout
    }

    pub(crate) fn bind<'s>(&'s mut self, stream: &'s CudaStream) -> BoundCache<'s> {
        let data = buffer::write(&mut self.bytes, stream);
        let scale = buffer::read_opt(&self.scale, stream);
        BoundCache::new(data, scale, self.layout, self.elem)
    }
}

/// A bound cache: its description for validation, the addresses and the guards.
pub(crate) struct BoundCache<'s> {
    pub desc: CacheDesc,
    pub addr: u64,
    /// The per-tensor scale's address (0 = none), for the fp8 kernels' params.
    #[allow(dead_code)]
    pub scale_addr: u64,
    _guards: (Bound<'s>, Option<Bound<'s>>),
}

impl<'s> BoundCache<'s> {
    fn new(data: Bound<'s>, scale: Option<Bound<'s>>, l: CacheLayout, elem: Option<DType>) -> Self {
        BoundCache {
            desc: CacheDesc {
                buf: data.buf,
                format: l.format,
                num_blocks: l.num_blocks,
                block_size: l.block_size,
                block_stride_bytes: l.block_stride_bytes,
                scale: scale.as_ref().map(|s| s.buf),
                elem,
            },
            addr: data.addr,
            scale_addr: buffer::addr_of(&scale),
            _guards: (data, scale),
        }
    }
}

/// The shape of a block table: `batch` rows of `max_blocks_per_seq` block ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TableShape {
    /// Requests (rows).
    pub batch: usize,
    /// Block ids used per request (columns).
    pub max_blocks_per_seq: usize,
}

/// Block table `[batch, max_blocks_per_seq]` int32, rows `row_stride` elements apart.
#[derive(Debug)]
pub struct BlockTable<'a> {
    table: CudaView<'a, i32>,
    shape: TableShape,
    row_stride: usize,
}

impl Clone for BlockTable<'_> {
    fn clone(&self) -> Self {
        BlockTable {
            table: self.table.slice(..),
            ..*self
        }
    }
}

impl<'a> BlockTable<'a> {
    /// A dense table (rows `max_blocks_per_seq` apart).
    pub fn new(table: impl IntoDeviceRead<'a, i32>, shape: TableShape) -> Self {
        BlockTable {
            table: sealed::IntoView::into_view(table),
            shape,
            row_stride: shape.max_blocks_per_seq,
        }
    }

    /// Rows `row_stride >= max_blocks_per_seq` elements apart (a table wider than it is used).
    pub fn with_row_stride(self, row_stride: usize) -> Self {
        BlockTable { row_stride, ..self }
    }

    /// The shape.
    pub fn shape(&self) -> TableShape {
        self.shape
    }

    /// Requests (rows).
    pub fn batch(&self) -> usize {
        self.shape.batch
    }

    /// Block ids per request.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.shape.max_blocks_per_seq
    }

    /// Elements between rows.
    pub fn row_stride(&self) -> usize {
        self.row_stride
    }

    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> (TableDesc, Bound<'s>) {
        let b = buffer::read(&self.table, stream);
        let desc = TableDesc {
            buf: b.buf,
            batch: self.shape.batch,
            max_blocks_per_seq: self.shape.max_blocks_per_seq,
            stride: self.row_stride,
        };
        (desc, b)
    }
}

/// Sparse indices `[tokens, topk]` int32 of global slot ids `block_id · block_size + offset`
/// (`-1` = none), rows `row_stride` elements apart.
///
/// Per-row lengths are not part of the indices: they are
/// [`SparseArgs::topk_len`](crate::SparseArgs::topk_len).
#[derive(Debug)]
pub struct SparseIndices<'a> {
    indices: CudaView<'a, i32>,
    topk: usize,
    row_stride: usize,
}

impl Clone for SparseIndices<'_> {
    fn clone(&self) -> Self {
        SparseIndices {
            indices: self.indices.slice(..),
            ..*self
        }
    }
}

impl<'a> SparseIndices<'a> {
    /// A dense `[tokens, topk]` tensor.
    pub fn contiguous(indices: impl IntoDeviceRead<'a, i32>, topk: usize) -> Self {
        SparseIndices {
            indices: sealed::IntoView::into_view(indices),
            topk,
            row_stride: topk,
        }
    }

    /// Rows `row_stride >= topk` elements apart.
    pub fn with_row_stride(self, row_stride: usize) -> Self {
        SparseIndices { row_stride, ..self }
    }

    /// Entries per row.
    pub fn topk(&self) -> usize {
        self.topk
    }

    /// Elements between rows.
    pub fn row_stride(&self) -> usize {
        self.row_stride
    }

    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> (IndicesDesc, Bound<'s>) {
        let b = buffer::read(&self.indices, stream);
        let desc = IndicesDesc {
            buf: b.buf,
            topk: self.topk,
            stride: self.row_stride,
        };
        (desc, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_layout_rejects_a_partial_block() {
        let l = CacheLayout::contiguous(KvFormat::Bf16, 64, 10 * 64 * 1152).unwrap();
        assert_eq!(
            l,
            CacheLayout {
                format: KvFormat::Bf16,
                block_size: 64,
                num_blocks: 10,
                block_stride_bytes: 64 * 1152
            }
        );
        assert_eq!(l.num_slots(), 640);
        let l = CacheLayout::contiguous(KvFormat::Fp8DsMla, 16, 3 * 16 * 656).unwrap();
        assert_eq!((l.num_blocks, l.block_stride_bytes), (3, 16 * 656));
        // One row over, or one row short of a block: an error naming kv_cache.
        for bytes in [10 * 64 * 1152 + 1152, 10 * 64 * 1152 - 1152, 2] {
            match CacheLayout::contiguous(KvFormat::F16, 64, bytes) {
                Err(Error::InvalidArgument {
                    arg: "kv_cache",
                    reason,
                }) => assert!(reason.contains("whole number"), "{reason}"),
                other => panic!("{bytes} bytes: {other:?}"),
            }
        }
        // Block sizes the kernels do not take (0 would divide by zero).
        for bs in [0, 24, 256] {
            assert!(matches!(
                CacheLayout::contiguous(KvFormat::F16, bs, 1 << 20),
                Err(Error::InvalidArgument {
                    arg: "block_size",
                    ..
                })
            ));
        }
        // An empty buffer is zero blocks: the call that uses it says so.
        assert_eq!(
            CacheLayout::contiguous(KvFormat::F16, 16, 0)
                .unwrap()
                .num_blocks,
            0
        );
    }

    #[test]
    fn strides() {
        assert_eq!(
            Strides::contiguous(8, HEAD_DIM),
            Strides {
                token: 8 * 576,
                head: 576
            }
        );
    }
}
