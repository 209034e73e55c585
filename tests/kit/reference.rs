//! Runners of `mla_decode::reference` for problems given as host mirrors: one request (dense)
//! or one token (sparse) at a time, over a compact repack of only the rows it uses, so that
//! large padded caches cost no f64 copy and any subset of heads can be checked.

use mla_decode::reference::{
    self, fault_code, Attention, DenseProblem, Fault, PagedCache, SparseProblem,
};
use mla_decode::{HEAD_DIM, LATENT_DIM};

use super::host::{Half, HostCache, HostQuery};
use super::problem::{DenseSetup, SparseSetup};

/// Checks that `faults` (from a one-request/one-token reference run) hold BAD_* faults whose
/// values were replaced by `-1`/`-2` markers and restores the original values and row.
fn restore_faults(
    faults: &[Fault],
    row: usize,
    bad_code: u32,
    originals: &[i32],
    dst: &mut Vec<Fault>,
) {
    let mut bad = originals.iter();
    for f in faults {
        let value = if f.code == bad_code {
            *bad.next()
                .expect("reference reported more bad entries than injected") as i64
        } else {
            f.value
        };
        dst.push(Fault {
            code: f.code,
            row: row as u32,
            value,
        });
    }
    assert!(
        bad.next().is_none(),
        "reference skipped a bad entry silently"
    );
}

/// A dense problem over a host cache with padded blocks and a strided block table.
#[derive(Clone, Copy, Debug)]
pub struct DenseInputs<'a, T> {
    /// `[batch*q_len, num_heads, 576]`.
    pub q: &'a [f64],
    /// Requests.
    pub batch: usize,
    /// Query rows per request.
    pub q_len: usize,
    /// Heads of `q`.
    pub num_heads: usize,
    /// The cache.
    pub cache: &'a HostCache<T>,
    /// `[batch, table_stride]`.
    pub table: &'a [i32],
    /// Elements between table rows.
    pub table_stride: usize,
    /// Columns used.
    pub max_blocks_per_seq: usize,
    /// `[batch]`.
    pub seq_lens: &'a [i32],
    /// The scale the device got (as f64).
    pub softmax_scale: f64,
}

/// `reference::dense_decode` of heads `heads` (indices into the device's heads), one request
/// at a time over a compact repack of the blocks it uses (contiguous blocks, table stride =
/// max_blocks_per_seq, bad entries kept bad), so that large caches cost no f64 copy.
pub fn dense_reference<T: Half>(p: &DenseInputs<T>, heads: &[usize]) -> Attention {
    let (bs, mbps, q_len, nh) = (
        p.cache.block_size,
        p.max_blocks_per_seq,
        p.q_len,
        heads.len(),
    );
    let cap = (mbps * bs) as i64;
    let mut res = Attention::empty(p.batch * q_len, nh);
    for b in 0..p.batch {
        let len = (p.seq_lens[b] as i64).clamp(0, cap) as usize;
        let needed = len.div_ceil(bs);
        let nb = needed.max(1);
        let mut data = Vec::with_capacity(nb * bs * HEAD_DIM);
        let mut table = vec![0i32; mbps];
        let mut bad = Vec::new();
        for (j, entry) in table.iter_mut().enumerate().take(needed) {
            let e = p.table[b * p.table_stride + j];
            if e >= 0 && (e as usize) < p.cache.num_blocks {
                *entry = j as i32;
                for r in 0..bs {
                    p.cache.push_row_f64(e as usize * bs + r, &mut data);
                }
            } else {
                *entry = -1;
                bad.push(e);
                data.resize(data.len() + bs * HEAD_DIM, 0.0);
            }
        }
        data.resize(nb * bs * HEAD_DIM, 0.0);
        let mut q = Vec::with_capacity(q_len * nh * HEAD_DIM);
        for i in 0..q_len {
            let r = b * q_len + i;
            for &h in heads {
                let s = (r * p.num_heads + h) * HEAD_DIM;
                q.extend_from_slice(&p.q[s..s + HEAD_DIM]);
            }
        }
        let one = reference::dense_decode(&DenseProblem {
            q: &q,
            batch: 1,
            q_len,
            num_heads: nh,
            cache: PagedCache {
                data: &data,
                num_blocks: nb,
                block_size: bs,
            },
            block_table: &table,
            max_blocks_per_seq: mbps,
            seq_lens: &p.seq_lens[b..b + 1],
            softmax_scale: p.softmax_scale,
        });
        let o = b * q_len * nh;
        res.out[o * LATENT_DIM..(o + q_len * nh) * LATENT_DIM].copy_from_slice(&one.out);
        res.lse[o..o + q_len * nh].copy_from_slice(&one.lse);
        restore_faults(
            &one.faults,
            b,
            fault_code::BAD_BLOCK_ID,
            &bad,
            &mut res.faults,
        );
    }
    res
}

/// A sparse problem over a host cache with padded blocks and strided indices.
#[derive(Clone, Copy, Debug)]
pub struct SparseInputs<'a, T> {
    /// `[num_tokens, num_heads, 576]`.
    pub q: &'a [f64],
    /// Query tokens.
    pub num_tokens: usize,
    /// Heads of `q`.
    pub num_heads: usize,
    /// The cache.
    pub cache: &'a HostCache<T>,
    /// `[num_tokens, indices_stride]` global slot ids.
    pub indices: &'a [i32],
    /// Elements between rows of `indices`.
    pub indices_stride: usize,
    /// Entries per row.
    pub topk: usize,
    /// Optional `[num_tokens]`.
    pub topk_len: Option<&'a [i32]>,
    /// The scale the device got (as f64).
    pub softmax_scale: f64,
}

/// `reference::sparse_decode` of heads `heads`, one token at a time over a compact cache of
/// the rows it lists (one row per entry, in entry order; -1 kept, bad ids kept bad).
pub fn sparse_reference<T: Half>(p: &SparseInputs<T>, heads: &[usize]) -> Attention {
    let nh = heads.len();
    let slots = p.cache.num_slots() as i64;
    let mut res = Attention::empty(p.num_tokens, nh);
    let mut data = Vec::new();
    for t in 0..p.num_tokens {
        let n = p.topk_len.map_or(p.topk, |l| {
            if l[t] < 0 || l[t] as usize > p.topk {
                // clamped, and recorded, as the full reference does (before the entries)
                res.faults.push(Fault {
                    code: fault_code::BAD_TOPK_LEN,
                    row: t as u32,
                    value: l[t] as i64,
                });
            }
            l[t].clamp(0, p.topk as i32) as usize
        });
        if n == 0 {
            continue;
        }
        data.clear();
        let mut ids = Vec::with_capacity(n);
        let mut bad = Vec::new();
        for &id in &p.indices[t * p.indices_stride..][..n] {
            if id == -1 {
                ids.push(-1);
            } else if id < 0 || id as i64 >= slots {
                ids.push(-2);
                bad.push(id);
            } else {
                ids.push((data.len() / HEAD_DIM) as i32);
                p.cache.push_row_f64(id as usize, &mut data);
            }
        }
        if data.is_empty() {
            data.resize(HEAD_DIM, 0.0);
        }
        let mut q = Vec::with_capacity(nh * HEAD_DIM);
        for &h in heads {
            let s = (t * p.num_heads + h) * HEAD_DIM;
            q.extend_from_slice(&p.q[s..s + HEAD_DIM]);
        }
        let one = reference::sparse_decode(&SparseProblem {
            q: &q,
            num_tokens: 1,
            num_heads: nh,
            cache: PagedCache {
                data: &data,
                num_blocks: data.len() / HEAD_DIM,
                block_size: 1,
            },
            indices: &ids,
            topk: n,
            topk_len: None,
            softmax_scale: p.softmax_scale,
        });
        res.out[t * nh * LATENT_DIM..(t + 1) * nh * LATENT_DIM].copy_from_slice(&one.out);
        res.lse[t * nh..(t + 1) * nh].copy_from_slice(&one.lse);
        restore_faults(
            &one.faults,
            t,
            fault_code::BAD_SLOT_ID,
            &bad,
            &mut res.faults,
        );
    }
    res
}

impl<T: Half> DenseSetup<T> {
    /// The reference for `q`, heads `heads` ([`dense_reference`]).
    pub fn reference(&self, q: &HostQuery<T>, heads: &[usize]) -> Attention {
        dense_reference(
            &DenseInputs {
                q: &q.values,
                batch: self.batch,
                q_len: self.q_len,
                num_heads: self.heads,
                cache: &self.cache,
                table: &self.table,
                table_stride: self.table_stride,
                max_blocks_per_seq: self.mbps,
                seq_lens: &self.seq_lens,
                softmax_scale: self.scale as f64,
            },
            heads,
        )
    }
}

impl<T: Half> SparseSetup<T> {
    /// The reference for `q`, heads `heads` ([`sparse_reference`]).
    pub fn reference(&self, q: &HostQuery<T>, heads: &[usize]) -> Attention {
        sparse_reference(
            &SparseInputs {
                q: &q.values,
                num_tokens: self.tokens,
                num_heads: self.heads,
                cache: &self.cache,
                indices: &self.indices,
                indices_stride: self.stride,
                topk: self.topk,
                topk_len: self.topk_len.as_deref(),
                softmax_scale: self.scale as f64,
            },
            heads,
        )
    }
}
