//! Random problems on the host: dense (lengths, shuffled block tables with junk past each
//! request's blocks, padded cache blocks), sparse (index rows with holes, duplicates and bad
//! ids, optional topk_len) and the index gather. [`super::dev`] uploads and runs them,
//! [`super::reference`] computes what they should give.

use mla_decode::reference::{self, Fault, GatherProblem};
use mla_decode::{CacheLayout, DenseShape, KvFormat, SparseShape};

use super::host::{repack, Half, HostCache};
use super::rng::Rng;

/// Work budget of a random case: (query row, head, cache row) triples the reference computes.
pub const WORK_BUDGET: usize = 2_000_000;

// ---------------------------------------------------------------------------------------------
// Dense

/// What a dense problem is made of (lengths are used as given, even out of range).
#[derive(Clone, Debug)]
pub struct DenseSpec {
    /// Query rows per request.
    pub q_len: usize,
    /// Heads.
    pub heads: usize,
    /// Rows per block.
    pub block_size: usize,
    /// Block-table columns.
    pub max_blocks_per_seq: usize,
    /// Extra columns between table rows (filled with junk).
    pub table_pad: usize,
    /// Padding after every cache block, in elements (multiple of 8).
    pub block_pad: usize,
    /// Cache blocks no request uses.
    pub spare_blocks: usize,
    /// Junk (bad ids) in the columns past a request's length (else random valid ids).
    pub junk_unused: bool,
    /// seq_lens (batch = its length).
    pub seq_lens: Vec<i32>,
    /// The scale.
    pub scale: f32,
}

impl DenseSpec {
    /// `lens` with a random block size, a table one block longer than the longest request
    /// needs, random table and block padding, two spare blocks, junk past each request's
    /// blocks and a random scale.
    pub fn random_layout(rng: &mut Rng, q_len: usize, heads: usize, lens: &[usize]) -> DenseSpec {
        let bs = rng.pick(&mla_decode::BLOCK_SIZES);
        let longest = lens.iter().copied().max().unwrap_or(0);
        DenseSpec {
            q_len,
            heads,
            block_size: bs,
            max_blocks_per_seq: longest.div_ceil(bs) + 1,
            table_pad: rng.below(3),
            block_pad: 8 * rng.below(3),
            spare_blocks: 2,
            junk_unused: true,
            seq_lens: lens.iter().map(|&l| l as i32).collect(),
            scale: rng.softmax_scale(),
        }
    }
}

/// A dense problem on the host.
#[derive(Clone, Debug)]
pub struct DenseSetup<T> {
    /// Requests.
    pub batch: usize,
    /// Query rows per request.
    pub q_len: usize,
    /// Heads.
    pub heads: usize,
    /// Block-table columns.
    pub mbps: usize,
    /// Elements between table rows.
    pub table_stride: usize,
    /// The cache.
    pub cache: HostCache<T>,
    /// `[batch, table_stride]`.
    pub table: Vec<i32>,
    /// `[batch]`.
    pub seq_lens: Vec<i32>,
    /// The scale.
    pub scale: f32,
}

/// A junk block-table entry: outside `[0, num_blocks)`.
pub fn junk_block(rng: &mut Rng, num_blocks: usize) -> i32 {
    rng.pick(&[
        -1,
        -5,
        i32::MIN,
        i32::MAX,
        num_blocks as i32,
        num_blocks as i32 + 1000,
    ])
}

/// A random length in `0..=max_len`, often an edge (0, 1, around a block, max_len, a multiple
/// of the block size).
pub fn edge_len(rng: &mut Rng, max_len: usize, bs: usize) -> usize {
    match rng.below(10) {
        0 => 0,
        1 => 1,
        2 => bs - 1,
        3 => bs,
        4 => bs + 1,
        5 => max_len,
        6 => rng.below(max_len / bs + 1) * bs,
        _ => rng.below(max_len + 1),
    }
}

/// A random dense problem of `heads` heads: q_len 1..=8, every block size, 1..=`max_batch`
/// requests of lengths at edges up to `max_len` (scaled down so that rows x heads x q_len stay
/// within `budget`), padded tables and blocks, junk or not in unused table entries, and (30 %
/// of the time) a bad block id inside a request's length (recorded in the flag).
pub fn random_dense<T: Half>(
    rng: &mut Rng,
    heads: usize,
    max_batch: usize,
    max_len: usize,
    budget: usize,
) -> DenseSetup<T> {
    let bs = rng.pick(&mla_decode::BLOCK_SIZES);
    let q_len = rng.range(1, mla_decode::MAX_Q_LEN);
    let batch = rng.range(1, max_batch);
    let mut lens: Vec<usize> = (0..batch)
        .map(|_| edge_len(rng, max_len.max(1), bs))
        .collect();
    let total: usize = lens.iter().sum();
    let cap = (budget / (heads * q_len)).max(1);
    if total > cap {
        lens.iter_mut().for_each(|l| *l = *l * cap / total);
    }
    let longest = lens.iter().copied().max().unwrap_or(0).max(1);
    let spec = DenseSpec {
        q_len,
        heads,
        block_size: bs,
        max_blocks_per_seq: longest.div_ceil(bs) + rng.below(3),
        table_pad: if rng.chance(0.5) { 0 } else { rng.range(1, 5) },
        block_pad: 8 * rng.below(4),
        spare_blocks: rng.below(4),
        junk_unused: rng.chance(0.5),
        seq_lens: lens.iter().map(|&l| l as i32).collect(),
        scale: rng.softmax_scale(),
    };
    let mut s = DenseSetup::<T>::build(rng, &spec);
    if rng.chance(0.3) {
        let b = rng.below(batch);
        let need = lens[b].div_ceil(bs);
        if need > 0 {
            let j = rng.below(need);
            s.table[b * s.table_stride + j] = junk_block(rng, s.cache.num_blocks);
        }
    }
    s
}

impl<T: Half> DenseSetup<T> {
    /// Random cache and a shuffled block table for `spec`: every block belongs to at most one
    /// request.
    pub fn build(rng: &mut Rng, spec: &DenseSpec) -> DenseSetup<T> {
        let (bs, mbps) = (spec.block_size, spec.max_blocks_per_seq);
        let cap = (mbps * bs) as i64;
        let needed: Vec<usize> = spec
            .seq_lens
            .iter()
            .map(|&l| ((l as i64).clamp(0, cap) as usize).div_ceil(bs))
            .collect();
        let num_blocks = (needed.iter().sum::<usize>() + spec.spare_blocks).max(1);
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        rng.shuffle(&mut ids);
        let mut next = ids.into_iter();
        let batch = spec.seq_lens.len();
        let stride = mbps + spec.table_pad;
        let mut table = vec![0i32; batch * stride];
        for (b, &need) in needed.iter().enumerate() {
            for j in 0..stride {
                table[b * stride + j] = if j < need {
                    next.next().expect("enough blocks")
                } else if j >= mbps || spec.junk_unused {
                    junk_block(rng, num_blocks)
                } else {
                    rng.below(num_blocks) as i32
                };
            }
        }
        DenseSetup {
            batch,
            q_len: spec.q_len,
            heads: spec.heads,
            mbps,
            table_stride: stride,
            cache: HostCache::random(rng, num_blocks, bs, spec.block_pad),
            table,
            seq_lens: spec.seq_lens.clone(),
            scale: spec.scale,
        }
    }

    /// Query rows.
    pub fn tokens(&self) -> usize {
        self.batch * self.q_len
    }

    /// The plan's shape.
    pub fn shape(&self) -> DenseShape {
        DenseShape {
            batch: self.batch,
            q_len: self.q_len,
            num_heads: self.heads,
            block_size: self.cache.block_size,
            max_blocks_per_seq: self.mbps,
            kv_format: T::DTYPE.kv_format(),
        }
    }

    /// A fresh shuffled assignment of the cache's blocks to the requests for the current
    /// seq_lens (junk past each request's blocks and in the row padding).
    pub fn reassign_table(&mut self, rng: &mut Rng) {
        let bs = self.cache.block_size;
        let cap = (self.mbps * bs) as i64;
        let mut ids: Vec<i32> = (0..self.cache.num_blocks as i32).collect();
        rng.shuffle(&mut ids);
        let mut next = ids.into_iter();
        for b in 0..self.batch {
            let need = ((self.seq_lens[b] as i64).clamp(0, cap) as usize).div_ceil(bs);
            for j in 0..self.table_stride {
                self.table[b * self.table_stride + j] = if j < need {
                    next.next().expect("cache too small")
                } else {
                    junk_block(rng, self.cache.num_blocks)
                };
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sparse

/// A sparse problem on the host.
#[derive(Clone, Debug)]
pub struct SparseSetup<T> {
    /// Query tokens.
    pub tokens: usize,
    /// Heads.
    pub heads: usize,
    /// Entries per row.
    pub topk: usize,
    /// The cache.
    pub cache: HostCache<T>,
    /// `[tokens, stride]` (the padding holds junk).
    pub indices: Vec<i32>,
    /// Elements between index rows.
    pub stride: usize,
    /// Optional `[tokens]`.
    pub topk_len: Option<Vec<i32>>,
    /// The scale.
    pub scale: f32,
}

impl<T: Half> SparseSetup<T> {
    /// The plan's shape.
    pub fn shape(&self) -> SparseShape {
        SparseShape {
            num_tokens: self.tokens,
            num_heads: self.heads,
            topk: self.topk,
            kv_format: T::DTYPE.kv_format(),
        }
    }
}

/// A bad sparse id: not -1 and outside `[0, num_slots)`.
pub fn bad_slot(rng: &mut Rng, num_slots: usize) -> i32 {
    rng.pick(&[
        num_slots as i32,
        num_slots as i32 + 12_345,
        i32::MAX,
        -2,
        -1000,
        i32::MIN,
    ])
}

/// How the entries of one index row are drawn.
#[derive(Clone, Copy, Debug)]
pub struct RowStyle {
    /// Probability that an entry is a -1 hole.
    pub hole: f64,
    /// Probability that the row gets one bad id.
    pub bad: f64,
}

/// One row of `topk` ids over `num_slots` slots: all -1, a few slots duplicated many times, a
/// run of consecutive slots, distinct slots, or uniform with repeats; then holes and maybe
/// one bad id.
pub fn index_row(rng: &mut Rng, num_slots: usize, topk: usize, style: RowStyle) -> Vec<i32> {
    let mut row: Vec<i32> = match rng.below(10) {
        0 => vec![-1; topk],
        1 => {
            let pool: Vec<i32> = (0..rng.range(1, 4))
                .map(|_| rng.below(num_slots) as i32)
                .collect();
            (0..topk).map(|_| rng.pick(&pool)).collect()
        }
        2 => {
            let start = rng.below(num_slots);
            (0..topk)
                .map(|k| ((start + k) % num_slots) as i32)
                .collect()
        }
        3 if topk <= num_slots => rng
            .sample(num_slots, topk)
            .into_iter()
            .map(|s| s as i32)
            .collect(),
        _ => (0..topk).map(|_| rng.below(num_slots) as i32).collect(),
    };
    for id in row.iter_mut() {
        if rng.chance(style.hole) {
            *id = -1;
        }
    }
    if rng.chance(style.bad) {
        let k = rng.below(topk);
        row[k] = bad_slot(rng, num_slots);
    }
    row
}

/// A topk_len value: 0, topk, above topk, negative, or in between.
pub fn topk_len_value(rng: &mut Rng, topk: usize) -> i32 {
    match rng.below(7) {
        0 => 0,
        1 => topk as i32,
        2 => topk as i32 + rng.range(1, 1000) as i32,
        3 => -(rng.range(1, 5) as i32),
        4 => i32::MAX,
        _ => rng.range(0, topk) as i32,
    }
}

/// Indices `[tokens, stride]` (junk in the row padding) from `rows`.
pub fn pack_rows(rng: &mut Rng, rows: &[Vec<i32>], stride: usize, num_slots: usize) -> Vec<i32> {
    let mut v = Vec::with_capacity(rows.len() * stride);
    for r in rows {
        v.extend_from_slice(r);
        for _ in r.len()..stride {
            v.push(bad_slot(rng, num_slots));
        }
    }
    v
}

/// A random sparse problem: a padded cache, rows drawn by [`index_row`], a padded index
/// stride half of the time, and (`with_topk_len`) random topk_len values.
#[allow(clippy::too_many_arguments)]
pub fn random_sparse<T: Half>(
    rng: &mut Rng,
    tokens: usize,
    heads: usize,
    topk: usize,
    num_blocks: usize,
    block_size: usize,
    style: RowStyle,
    with_topk_len: bool,
) -> SparseSetup<T> {
    let pad = 8 * rng.below(4);
    let cache = HostCache::<T>::random(rng, num_blocks, block_size, pad);
    let slots = cache.num_slots();
    let rows: Vec<Vec<i32>> = (0..tokens)
        .map(|_| index_row(rng, slots, topk, style))
        .collect();
    let stride = if rng.chance(0.5) {
        topk
    } else {
        topk + rng.range(1, 9)
    };
    let indices = pack_rows(rng, &rows, stride, slots);
    let topk_len = with_topk_len.then(|| (0..tokens).map(|_| topk_len_value(rng, topk)).collect());
    SparseSetup {
        tokens,
        heads,
        topk,
        cache,
        indices,
        stride,
        topk_len,
        scale: rng.softmax_scale(),
    }
}

/// A random sparse problem of `heads` heads ([`random_sparse`]): every block size, holes,
/// duplicates, bad slot ids, optional topk_len; `small`: topk up to 100 over 1..=5 blocks and
/// 1..=4 tokens, else topk up to 2048 over up to 300 blocks and 16 tokens (within the work
/// budget).
pub fn random_sparse_case<T: Half>(rng: &mut Rng, heads: usize, small: bool) -> SparseSetup<T> {
    let bs = rng.pick(&mla_decode::BLOCK_SIZES);
    let topk = if small {
        rng.pick(&[1usize, 2, 5, 33, 64, 100])
    } else {
        rng.pick(&[1usize, 32, 64, 100, 128, 257, 1000, 2048])
    };
    let tokens = rng
        .range(1, if small { 4 } else { 17 })
        .min((WORK_BUDGET / 4 / ((heads + 4) * topk)).max(1));
    let num_blocks = if small {
        rng.range(1, 6)
    } else {
        rng.range(1, 300)
    };
    let style = RowStyle {
        hole: rng.pick(&[0.0, 0.05, 0.5]),
        bad: rng.pick(&[0.0, 0.3]),
    };
    let with_len = rng.chance(0.4);
    random_sparse::<T>(rng, tokens, heads, topk, num_blocks, bs, style, with_len)
}

// ---------------------------------------------------------------------------------------------
// Gather

/// The poison of gather outputs (the padding between rows must keep it).
pub const GATHER_POISON: i32 = -777_777;

/// An index gather problem.
#[derive(Clone, Debug)]
pub struct GatherSetup {
    /// Requests.
    pub batch: usize,
    /// Block-table columns.
    pub mbps: usize,
    /// Elements between table rows.
    pub table_stride: usize,
    /// Rows per block.
    pub block_size: usize,
    /// Cache blocks.
    pub num_blocks: usize,
    /// `[batch, table_stride]`.
    pub table: Vec<i32>,
    /// `[batch]`.
    pub seq_lens: Vec<i32>,
    /// Query tokens.
    pub tokens: usize,
    /// Positions per token.
    pub topk: usize,
    /// `[tokens, pos_stride]`.
    pub positions: Vec<i32>,
    /// Elements between rows of `positions`.
    pub pos_stride: usize,
    /// `[tokens]`.
    pub req_id: Vec<i32>,
    /// Elements between output rows.
    pub out_stride: usize,
}

impl GatherSetup {
    /// `reference::gather_slots` on the repacked inputs: `[tokens, topk]` slots and faults.
    pub fn reference(&self) -> (Vec<i32>, Vec<Fault>) {
        let positions = repack(&self.positions, self.tokens, self.pos_stride, self.topk);
        let table = repack(&self.table, self.batch, self.table_stride, self.mbps);
        reference::gather_slots(&GatherProblem {
            positions: &positions,
            num_tokens: self.tokens,
            topk: self.topk,
            req_id: &self.req_id,
            block_table: &table,
            max_blocks_per_seq: self.mbps,
            seq_lens: &self.seq_lens,
            batch: self.batch,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
        })
    }

    /// The layout of the cache the slots are for (bf16, unpadded blocks: the gather reads
    /// only its geometry).
    pub fn cache_layout(&self) -> CacheLayout {
        CacheLayout {
            format: KvFormat::Bf16,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            block_stride_bytes: self.block_size * KvFormat::Bf16.row_bytes(),
        }
    }

    /// Elements of the output buffer (a few past the last row, which must keep the poison).
    pub fn out_len(&self) -> usize {
        (self.tokens - 1) * self.out_stride + self.topk + 5
    }
}

/// A random gather: `tokens` rows of `topk` positions over `batch` requests, positions valid,
/// negative, at or past seq_len; seq_lens including 0 and the table capacity; with `faults`,
/// also negative seq_lens and ones above the capacity (clamped and recorded), bad req ids and
/// bad block ids in used columns.
pub fn random_gather(
    rng: &mut Rng,
    batch: usize,
    tokens: usize,
    topk: usize,
    block_size: usize,
    faults: bool,
) -> GatherSetup {
    let mbps = rng.range(1, 64);
    let cap = (mbps * block_size) as i32;
    let seq_lens: Vec<i32> = (0..batch)
        .map(|_| match rng.below(8) {
            0 => 0,
            1 if faults => -(rng.range(1, 9) as i32),
            2 if faults => cap + rng.range(1, 100) as i32,
            3 => cap,
            _ => rng.range(1, cap as usize) as i32,
        })
        .collect();
    let num_blocks = batch * mbps + rng.below(10);
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    rng.shuffle(&mut ids);
    let table_stride = mbps + rng.below(4);
    let mut table = vec![0i32; batch * table_stride];
    for b in 0..batch {
        for j in 0..table_stride {
            table[b * table_stride + j] = if j < mbps {
                ids[b * mbps + j]
            } else {
                junk_block(rng, num_blocks)
            };
        }
        if faults && rng.chance(0.3) {
            let j = rng.below(mbps);
            table[b * table_stride + j] = junk_block(rng, num_blocks);
        }
    }
    let req_id: Vec<i32> = (0..tokens)
        .map(|_| {
            if faults && rng.chance(0.1) {
                rng.pick(&[-1, batch as i32, i32::MAX, i32::MIN])
            } else {
                rng.below(batch) as i32
            }
        })
        .collect();
    let pos_stride = topk + rng.below(5);
    let mut positions = Vec::with_capacity(tokens * pos_stride);
    for &r in &req_id {
        let len = if (0..batch as i32).contains(&r) {
            seq_lens[r as usize].clamp(0, cap)
        } else {
            cap
        };
        for k in 0..pos_stride {
            positions.push(if k >= topk {
                i32::MIN // padding: never read
            } else {
                match rng.below(10) {
                    0 => -1,
                    1 => rng.pick(&[-2, i32::MIN, i32::MAX]),
                    2 => len + rng.below(50) as i32,
                    3 => len - 1,
                    _ => rng.below(len.max(1) as usize) as i32,
                }
            });
        }
    }
    GatherSetup {
        batch,
        mbps,
        table_stride,
        block_size,
        num_blocks,
        table,
        seq_lens,
        tokens,
        topk,
        positions,
        pos_stride,
        req_id,
        out_stride: topk + rng.below(4),
    }
}
