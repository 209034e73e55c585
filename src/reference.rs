//! f64 reference implementations of everything the kernels compute.
//!
//! These are the naive, obviously-correct versions the GPU tests compare against: plain loops
//! over slices, in f64, with exactly the rules of docs/DESIGN.md for inputs that are wrong.
//!
//! - `score[t,h,s] = softmax_scale · dot(q[t,h,0..576], kv[s,0..576])`,
//!   `out[t,h] = Σ_s softmax(score)_s · kv[s,0..512]`, `lse[t,h] = ln Σ_s exp(score)`, computed
//!   stably (the maximum is subtracted first).
//! - No visible slot: `out = 0` and `lse = -inf` exactly; never NaN (for finite inputs).
//! - Keys are accumulated in a fixed order (position order for dense, entry order for sparse),
//!   so a sparse call over a request's slots in position order equals the dense call bitwise.
//! - [`Attention::faults`] lists *every* fault the inputs contain, in input order; the device
//!   error flag keeps whichever one a kernel happened to record first, so a GPU test should check
//!   that the flag holds one of them.

pub mod fp8;

/// Width of a query row and of a cache row: 512 latent dims then 64 RoPE dims.
pub const HEAD_DIM: usize = 576;
/// Width of the output row (the V part, the first 512 dims of a cache row).
pub const LATENT_DIM: usize = 512;
/// Number of RoPE dims at the end of a query or cache row.
pub const ROPE_DIM: usize = HEAD_DIM - LATENT_DIM;

/// A fault the kernels record in the device error flag (codes match csrc/mla_decode.h `MLA_FAULT_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fault {
    /// One of the [`fault_code`] constants.
    pub code: u32,
    /// The request (dense, seq_len and block faults) or the query token (sparse, gather).
    pub row: u32,
    /// The offending value (seq_len, topk_len, block-table entry, slot id, request id,
    /// append slot, or a per-tensor scale's bits), as the flag's words 2 and 3 hold it.
    pub value: i64,
}

/// Fault codes, equal to `MLA_FAULT_*` in csrc/mla_decode.h.
pub mod fault_code {
    use crate::ffi::mla_fault_code_t as F;

    /// A block-table entry outside `[0, num_blocks)`: row = request (gather: token), value = entry.
    pub const BAD_BLOCK_ID: u32 = F::MLA_FAULT_BAD_BLOCK_ID as u32;
    /// A seq_len < 0, treated as 0: row = request, value = seq_len.
    pub const NEGATIVE_SEQ_LEN: u32 = F::MLA_FAULT_NEGATIVE_SEQ_LEN as u32;
    /// A seq_len > max_blocks_per_seq·block_size, clamped to it: row = request, value = seq_len.
    pub const SEQ_LEN_TOO_LARGE: u32 = F::MLA_FAULT_SEQ_LEN_TOO_LARGE as u32;
    /// A sparse id other than -1 outside `[0, num_blocks·block_size)`: row = token, value = id.
    pub const BAD_SLOT_ID: u32 = F::MLA_FAULT_BAD_SLOT_ID as u32;
    /// A gather req_id outside `[0, batch)`: row = token, value = req_id.
    pub const BAD_REQ_ID: u32 = F::MLA_FAULT_BAD_REQ_ID as u32;
    /// An append slot (not -1) outside the cache: row = token, value = the slot (all 64 bits).
    pub const BAD_APPEND_SLOT: u32 = F::MLA_FAULT_BAD_APPEND_SLOT as u32;
    /// A sparse topk_len outside `0..=topk`, clamped: row = token, value = topk_len.
    pub const BAD_TOPK_LEN: u32 = F::MLA_FAULT_BAD_TOPK_LEN as u32;
    /// Per-tensor fp8: a scale that is not a finite number > 0.
    pub const BAD_KV_SCALE: u32 = F::MLA_FAULT_BAD_KV_SCALE as u32;
}

/// Result of attention: out `[rows, heads, 512]`, lse `[rows, heads]` (natural log), plus every
/// fault the inputs contain.
#[derive(Clone, Debug, PartialEq)]
pub struct Attention {
    /// Heads per query row.
    pub num_heads: usize,
    /// Output, `[rows, num_heads, LATENT_DIM]`.
    pub out: Vec<f64>,
    /// Log-sum-exp of the scaled scores, `[rows, num_heads]`; `-inf` where nothing was visible.
    pub lse: Vec<f64>,
    /// Every fault of the inputs, in input order.
    pub faults: Vec<Fault>,
}

impl Attention {
    /// A result where every row is empty: out 0, lse -inf, no faults.
    pub fn empty(rows: usize, num_heads: usize) -> Self {
        Attention {
            num_heads,
            out: vec![0.0; rows * num_heads * LATENT_DIM],
            lse: vec![f64::NEG_INFINITY; rows * num_heads],
            faults: Vec::new(),
        }
    }

    /// Number of query rows.
    pub fn rows(&self) -> usize {
        self.lse.len().checked_div(self.num_heads).unwrap_or(0)
    }

    /// The 512 output values of one (row, head).
    pub fn out_row(&self, row: usize, head: usize) -> &[f64] {
        assert!(
            head < self.num_heads,
            "head {head} out of {}",
            self.num_heads
        );
        &self.out[(row * self.num_heads + head) * LATENT_DIM..][..LATENT_DIM]
    }

    /// The lse of one (row, head).
    pub fn lse_at(&self, row: usize, head: usize) -> f64 {
        assert!(
            head < self.num_heads,
            "head {head} out of {}",
            self.num_heads
        );
        self.lse[row * self.num_heads + head]
    }
}

/// Paged cache, rows of 576 f64, blocks contiguous: row (block, offset) starts at
/// `data[(block * block_size + offset) * 576]`, i.e. at global slot id `block * block_size + offset`.
#[derive(Clone, Copy, Debug)]
pub struct PagedCache<'a> {
    /// `num_blocks * block_size * HEAD_DIM` values.
    pub data: &'a [f64],
    /// Number of blocks.
    pub num_blocks: usize,
    /// Rows per block.
    pub block_size: usize,
}

impl<'a> PagedCache<'a> {
    /// Number of rows (global slot ids `0..num_slots`).
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// The 576 values of global slot `slot = block * block_size + offset`.
    pub fn row(&self, slot: usize) -> &'a [f64] {
        &self.data[slot * HEAD_DIM..][..HEAD_DIM]
    }

    fn check(&self) {
        assert!(self.block_size > 0, "cache: block_size must be > 0");
        assert_eq!(
            self.data.len(),
            self.num_slots() * HEAD_DIM,
            "cache: data length"
        );
    }
}

/// Dense paged decode problem (causal, q_len query rows per request).
#[derive(Clone, Copy, Debug)]
pub struct DenseProblem<'a> {
    /// Queries `[batch, q_len, num_heads, 576]`.
    pub q: &'a [f64],
    /// Requests.
    pub batch: usize,
    /// Query rows per request (MTP); row i of a request of length L sees positions `0..L-q_len+i+1`.
    pub q_len: usize,
    /// Heads per query row.
    pub num_heads: usize,
    /// The paged cache.
    pub cache: PagedCache<'a>,
    /// Block table `[batch, max_blocks_per_seq]`.
    pub block_table: &'a [i32],
    /// Entries per request in the block table.
    pub max_blocks_per_seq: usize,
    /// Sequence lengths `[batch]`.
    pub seq_lens: &'a [i32],
    /// Factor applied to every dot product.
    pub softmax_scale: f64,
}

/// Sparse (DSA top-k) decode problem: every query token lists the global slot ids it attends.
#[derive(Clone, Copy, Debug)]
pub struct SparseProblem<'a> {
    /// Queries `[num_tokens, num_heads, 576]`.
    pub q: &'a [f64],
    /// Query tokens T.
    pub num_tokens: usize,
    /// Heads per query token.
    pub num_heads: usize,
    /// The paged cache.
    pub cache: PagedCache<'a>,
    /// Global slot ids `[num_tokens, topk]`, -1 = none.
    pub indices: &'a [i32],
    /// Entries per token in `indices`.
    pub topk: usize,
    /// Optional `[num_tokens]` count of leading entries to use (clamped to `0..=topk`).
    pub topk_len: Option<&'a [i32]>,
    /// Factor applied to every dot product.
    pub softmax_scale: f64,
}

/// Index gather problem: request-logical positions to global slot ids.
#[derive(Clone, Copy, Debug)]
pub struct GatherProblem<'a> {
    /// Positions `[num_tokens, topk]` within each token's request.
    pub positions: &'a [i32],
    /// Query tokens T.
    pub num_tokens: usize,
    /// Entries per token.
    pub topk: usize,
    /// Request of each token, `[num_tokens]`.
    pub req_id: &'a [i32],
    /// Block table `[batch, max_blocks_per_seq]`.
    pub block_table: &'a [i32],
    /// Entries per request in the block table.
    pub max_blocks_per_seq: usize,
    /// Sequence lengths `[batch]`.
    pub seq_lens: &'a [i32],
    /// Requests.
    pub batch: usize,
    /// Rows per cache block.
    pub block_size: usize,
    /// Blocks in the cache.
    pub num_blocks: usize,
}

/// The core: attention of one query row over `keys` (each 576 values, V = first 512) in order;
/// returns (out, lse). No key: (zeros, -inf).
pub fn attend<'k>(
    q_row: &[f64],
    keys: impl IntoIterator<Item = &'k [f64]>,
    softmax_scale: f64,
) -> (Vec<f64>, f64) {
    assert_eq!(q_row.len(), HEAD_DIM, "q_row length");
    let keys: Vec<&[f64]> = keys.into_iter().collect();
    let mut out = vec![0.0; LATENT_DIM];
    let mut lse = [0.0];
    attend_heads(
        q_row,
        &keys,
        softmax_scale,
        &mut out,
        &mut lse,
        &mut Vec::new(),
    );
    (out, lse[0])
}

/// Attention of `lse.len()` heads (`q`: `[heads, 576]`) over `keys`, written to `out`
/// (`[heads, 512]`) and `lse`. `scores` is scratch, reused between calls. Each head's result
/// does not depend on the other heads (same summation order as a one-head call).
fn attend_heads(
    q: &[f64],
    keys: &[&[f64]],
    scale: f64,
    out: &mut [f64],
    lse: &mut [f64],
    scores: &mut Vec<f64>,
) {
    let heads = lse.len();
    debug_assert_eq!(q.len(), heads * HEAD_DIM);
    debug_assert_eq!(out.len(), heads * LATENT_DIM);
    out.fill(0.0);
    lse.fill(f64::NEG_INFINITY);
    if keys.is_empty() {
        return;
    }
    // Pass 1: scores [key, head] and the running maximum per head (kept in `lse`).
    scores.clear();
    for key in keys {
        assert_eq!(key.len(), HEAD_DIM, "key length");
        for (qh, max) in q.chunks_exact(HEAD_DIM).zip(lse.iter_mut()) {
            let s = scale * dot(qh, key);
            scores.push(s);
            *max = max.max(s);
        }
    }
    // Pass 2: weights exp(score - max), their sums, and the weighted sum of V.
    let mut sums = vec![0.0; heads];
    for (key, sc) in keys.iter().zip(scores.chunks_exact(heads)) {
        let v = &key[..LATENT_DIM];
        for (((o, sum), &s), &max) in out
            .chunks_exact_mut(LATENT_DIM)
            .zip(&mut sums)
            .zip(sc)
            .zip(&*lse)
        {
            let p = (s - max).exp();
            *sum += p;
            for (o, &v) in o.iter_mut().zip(v) {
                *o += p * v;
            }
        }
    }
    for ((o, sum), l) in out
        .chunks_exact_mut(LATENT_DIM)
        .zip(&sums)
        .zip(lse.iter_mut())
    {
        for o in o.iter_mut() {
            *o /= sum;
        }
        *l += sum.ln();
    }
}

/// Dot product with eight independent accumulators (so that the compiler can vectorize it).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for ((acc, x), y) in acc.iter_mut().zip(x).zip(y) {
            *acc += x * y;
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Dense paged causal decode; rows = batch·q_len, row index = b·q_len + i.
///
/// seq_len < 0 is treated as 0 (fault NEGATIVE_SEQ_LEN), seq_len > max_blocks_per_seq·block_size
/// is clamped (fault SEQ_LEN_TOO_LARGE); a block-table entry outside `[0, num_blocks)` covering
/// positions < L has its rows skipped and records BAD_BLOCK_ID once per (request, table slot).
/// Faults come per request: the seq_len fault first, then bad entries in table order.
pub fn dense_decode(p: &DenseProblem) -> Attention {
    let (heads, q_len, mbps, bs) = (
        p.num_heads,
        p.q_len,
        p.max_blocks_per_seq,
        p.cache.block_size,
    );
    p.cache.check();
    let rows = p.batch * q_len;
    assert_eq!(p.q.len(), rows * heads * HEAD_DIM, "dense: q length");
    assert_eq!(
        p.block_table.len(),
        p.batch * mbps,
        "dense: block_table length"
    );
    assert_eq!(p.seq_lens.len(), p.batch, "dense: seq_lens length");
    let cap = (mbps * bs) as i64;
    let mut res = Attention::empty(rows, heads);
    let (mut keys, mut positions, mut scores) = (Vec::new(), Vec::new(), Vec::new());
    for b in 0..p.batch {
        let seq_len = p.seq_lens[b];
        let fault = |code| Fault {
            code,
            row: b as u32,
            value: seq_len as i64,
        };
        let len = if seq_len < 0 {
            res.faults.push(fault(fault_code::NEGATIVE_SEQ_LEN));
            0
        } else if seq_len as i64 > cap {
            res.faults.push(fault(fault_code::SEQ_LEN_TOO_LARGE));
            cap as usize
        } else {
            seq_len as usize
        };
        keys.clear();
        positions.clear();
        let table = &p.block_table[b * mbps..][..mbps];
        for (j, &entry) in table.iter().enumerate().take(len.div_ceil(bs)) {
            if entry < 0 || entry as usize >= p.cache.num_blocks {
                res.faults.push(Fault {
                    code: fault_code::BAD_BLOCK_ID,
                    row: b as u32,
                    value: entry as i64,
                });
                continue;
            }
            for pos in j * bs..len.min((j + 1) * bs) {
                keys.push(p.cache.row(entry as usize * bs + pos % bs));
                positions.push(pos);
            }
        }
        for i in 0..q_len {
            let visible = len as i64 - q_len as i64 + i as i64 + 1;
            let n = positions.partition_point(|&pos| (pos as i64) < visible);
            let r = b * q_len + i;
            attend_heads(
                &p.q[r * heads * HEAD_DIM..][..heads * HEAD_DIM],
                &keys[..n],
                p.softmax_scale,
                &mut res.out[r * heads * LATENT_DIM..][..heads * LATENT_DIM],
                &mut res.lse[r * heads..][..heads],
                &mut scores,
            );
        }
    }
    res
}

/// Sparse (DSA top-k) decode; rows = num_tokens.
///
/// Token t uses entries `0..n`, `n = clamp(topk_len[t], 0, topk)` (or topk): -1 is skipped
/// silently, any other id outside `[0, num_blocks·block_size)` is skipped and records
/// BAD_SLOT_ID (once per entry); a duplicated id counts once per entry.
pub fn sparse_decode(p: &SparseProblem) -> Attention {
    let (heads, topk, tokens) = (p.num_heads, p.topk, p.num_tokens);
    p.cache.check();
    assert_eq!(p.q.len(), tokens * heads * HEAD_DIM, "sparse: q length");
    assert_eq!(p.indices.len(), tokens * topk, "sparse: indices length");
    if let Some(l) = p.topk_len {
        assert_eq!(l.len(), tokens, "sparse: topk_len length");
    }
    let slots = p.cache.num_slots() as i64;
    let mut res = Attention::empty(tokens, heads);
    let (mut keys, mut scores) = (Vec::new(), Vec::new());
    for t in 0..tokens {
        let n = p.topk_len.map_or(topk, |l| {
            if l[t] < 0 || l[t] as usize > topk {
                res.faults.push(Fault {
                    code: fault_code::BAD_TOPK_LEN,
                    row: t as u32,
                    value: l[t] as i64,
                });
            }
            l[t].clamp(0, topk as i32) as usize
        });
        keys.clear();
        for &id in &p.indices[t * topk..][..n] {
            if id == -1 {
                continue;
            }
            if id < 0 || id as i64 >= slots {
                res.faults.push(Fault {
                    code: fault_code::BAD_SLOT_ID,
                    row: t as u32,
                    value: id as i64,
                });
                continue;
            }
            keys.push(p.cache.row(id as usize));
        }
        attend_heads(
            &p.q[t * heads * HEAD_DIM..][..heads * HEAD_DIM],
            &keys,
            p.softmax_scale,
            &mut res.out[t * heads * LATENT_DIM..][..heads * LATENT_DIM],
            &mut res.lse[t * heads..][..heads],
            &mut scores,
        );
    }
    res
}

/// Index gather: global slot ids `[num_tokens, topk]` (-1 where invalid) and the faults.
///
/// req_id outside `[0, batch)`: the whole row is -1, one BAD_REQ_ID fault. Otherwise L =
/// `clamp(seq_lens[req], 0, max_blocks_per_seq·block_size)` (a seq_len outside that range of a
/// request that some token uses records NEGATIVE_SEQ_LEN / SEQ_LEN_TOO_LARGE, row =
/// request); pos < 0 or ≥ L gives -1; a
/// block-table entry outside `[0, num_blocks)` gives -1 and a BAD_BLOCK_ID fault per entry.
pub fn gather_slots(p: &GatherProblem) -> (Vec<i32>, Vec<Fault>) {
    let (topk, mbps, bs) = (p.topk, p.max_blocks_per_seq, p.block_size);
    assert!(bs > 0, "gather: block_size must be > 0");
    assert_eq!(
        p.positions.len(),
        p.num_tokens * topk,
        "gather: positions length"
    );
    assert_eq!(p.req_id.len(), p.num_tokens, "gather: req_id length");
    assert_eq!(
        p.block_table.len(),
        p.batch * mbps,
        "gather: block_table length"
    );
    assert_eq!(p.seq_lens.len(), p.batch, "gather: seq_lens length");
    let cap = (mbps * bs) as i64;
    let mut slots = vec![-1; p.num_tokens * topk];
    let mut faults = Vec::new();
    // a seq_len outside [0, cap] of a request some token uses: clamped, recorded (row =
    // request) as dense decode does
    for b in 0..p.batch {
        let used = p.req_id[..p.num_tokens]
            .iter()
            .any(|&r| r as usize == b && r >= 0);
        let len = p.seq_lens[b] as i64;
        if used && (len < 0 || len > cap) {
            faults.push(Fault {
                code: if len < 0 {
                    fault_code::NEGATIVE_SEQ_LEN
                } else {
                    fault_code::SEQ_LEN_TOO_LARGE
                },
                row: b as u32,
                value: len,
            });
        }
    }
    for (t, row) in slots
        .chunks_exact_mut(topk.max(1))
        .take(p.num_tokens)
        .enumerate()
    {
        let req = p.req_id[t];
        if req < 0 || req as usize >= p.batch {
            faults.push(Fault {
                code: fault_code::BAD_REQ_ID,
                row: t as u32,
                value: req as i64,
            });
            continue;
        }
        let req = req as usize;
        let len = (p.seq_lens[req] as i64).clamp(0, cap);
        for (slot, &pos) in row.iter_mut().zip(&p.positions[t * topk..][..topk]) {
            if pos < 0 || pos as i64 >= len {
                continue;
            }
            let pos = pos as usize;
            let entry = p.block_table[req * mbps + pos / bs];
            if entry < 0 || entry as usize >= p.num_blocks {
                faults.push(Fault {
                    code: fault_code::BAD_BLOCK_ID,
                    row: t as u32,
                    value: entry as i64,
                });
                continue;
            }
            *slot = (entry as usize * bs + pos % bs) as i32;
        }
    }
    (slots, faults)
}

/// Combine two partial results over disjoint key sets by their lse; faults are concatenated.
pub fn merge(a: &Attention, b: &Attention) -> Attention {
    assert_eq!(a.num_heads, b.num_heads, "merge: num_heads");
    assert_eq!(a.lse.len(), b.lse.len(), "merge: rows");
    assert_eq!(a.out.len(), b.out.len(), "merge: out length");
    let mut res = Attention::empty(a.rows(), a.num_heads);
    let outs = res.out.chunks_exact_mut(LATENT_DIM);
    let parts = a
        .out
        .chunks_exact(LATENT_DIM)
        .zip(b.out.chunks_exact(LATENT_DIM));
    for (((o, (oa, ob)), l), (&la, &lb)) in outs
        .zip(parts)
        .zip(&mut res.lse)
        .zip(a.lse.iter().zip(&b.lse))
    {
        let max = la.max(lb);
        if max == f64::NEG_INFINITY {
            continue;
        }
        let (wa, wb) = ((la - max).exp(), (lb - max).exp());
        for ((o, &x), &y) in o.iter_mut().zip(oa).zip(ob) {
            *o = (wa * x + wb * y) / (wa + wb);
        }
        *l = max + (wa + wb).ln();
    }
    res.faults = a.faults.iter().chain(&b.faults).copied().collect();
    res
}
