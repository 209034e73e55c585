//! The host side of continuous batching: requests, the block allocator, the DSA indexer's
//! choice of positions, and each step's inputs as the device buffers will hold them.
//!
//! Nothing here touches the GPU. An engine has all of this already (vLLM's scheduler and
//! block manager); what matters is the shape of what ends up in the device buffers:
//! - `table` `[requests, max_blocks]` int32: each request's blocks, `-1` past them;
//! - `seq_lens` `[requests]` int32: rows in the cache, the new token's row included;
//! - `slot_mapping` `[requests]` int64: where the new token's row goes
//!   (`block · block_size + offset`);
//! - `positions` `[layers, requests, TOPK]` int32: per layer, the request-logical positions
//!   the indexer picked (`-1` past `topk_len`);
//! - `topk_len` `[requests]` int32: how many of them are real (`min(TOPK, seq_len)`).

use mla_decode::half::bf16;

use crate::rng::mix;
pub use crate::rng::Rng;

/// Rows per cache block.
pub const BLOCK_SIZE: usize = 64;
/// Positions the DSA indexer picks per token (GLM-5 and DeepSeek-V3.2: 2048).
pub const TOPK: usize = 2048;
/// Tokens a request generates before it finishes, by default: uniform in this range,
/// inclusive.
pub const GEN_TOKENS: (usize, usize) = (16, 512);

/// A key for [`fill_values`] from its parts (a seed, what the values are, and indices).
pub fn key(parts: &[u64]) -> u64 {
    parts.iter().fold(0x243f_6a88_85a3_08d3, |h, &p| {
        mix(h ^ p.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    })
}

/// Fills `out` with values uniform in [-1, 1) (a grid of 2^-15, rounded to bf16) that depend
/// only on `key`: the model's activations, made up. The cache row of (layer, request,
/// position) and the query of (set, layer, token, head) are such values, so the check can
/// make them again instead of keeping a host copy of every cache.
pub fn fill_values(key: u64, out: &mut [bf16]) {
    let mut state = key;
    for chunk in out.chunks_mut(4) {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let bits = mix(state);
        for (i, v) in chunk.iter_mut().enumerate() {
            let u = ((bits >> (16 * i)) & 0xffff) as f32;
            *v = bf16::from_f32(u / 32768.0 - 1.0);
        }
    }
}

/// The key of the cache row that `layer` stores for position `pos` of request `uid`.
pub fn row_key(seed: u64, layer: usize, uid: u64, pos: usize) -> u64 {
    key(&[seed, 1, layer as u64, uid, pos as u64])
}

/// The key of the query of `head` for batch row `token` of `layer`, in query set `set`.
pub fn q_key(seed: u64, set: usize, layer: usize, token: usize, head: usize) -> u64 {
    key(&[seed, 2, set as u64, layer as u64, token as u64, head as u64])
}

/// One request being decoded.
#[derive(Clone, Debug)]
pub struct Request {
    /// Identifies the request's rows (the generator's key), new for every request.
    pub uid: u64,
    /// Prompt tokens (prefilled when it is admitted).
    pub prompt: usize,
    /// Rows in the cache.
    pub len: usize,
    /// The request finishes when `len` reaches this.
    pub end: usize,
    /// Its cache blocks, in position order.
    pub blocks: Vec<i32>,
}

/// The batch: one request per row, refilled as requests finish, and the step's inputs.
pub struct Batch {
    /// The requests, one per batch row.
    pub requests: Vec<Request>,
    /// Block-table columns: enough for the longest request.
    pub max_blocks: usize,
    /// Blocks in each layer's cache (one block id serves the same position in every layer).
    pub num_blocks: usize,
    /// Free blocks.
    free: Vec<i32>,
    /// Prompt lengths are drawn uniformly from this range, inclusive.
    prompt_lens: (usize, usize),
    /// Tokens each request generates: uniform in this range, inclusive.
    gen_tokens: (usize, usize),
    next_uid: u64,
    rng: Rng,
    /// Scratch of the indexer.
    scratch: Scratch,
    /// Requests admitted by the last [`Batch::begin_step`] (their prompts need a prefill).
    pub admitted: Vec<usize>,
    /// Requests that finished in the last [`Batch::begin_step`], summed over all steps.
    pub finished: usize,
    /// `[requests, max_blocks]`.
    pub table: Vec<i32>,
    /// `[requests]`.
    pub seq_lens: Vec<i32>,
    /// `[requests]`.
    pub slot_mapping: Vec<i64>,
    /// `[requests]`.
    pub topk_len: Vec<i32>,
    /// `[layers, requests, TOPK]`.
    pub positions: Vec<i32>,
}

impl Batch {
    /// `requests` requests with prompts of `prompt_lens` tokens that generate `gen_tokens`
    /// tokens each (their prefills are pending: [`Batch::admitted`] lists every row), over a
    /// pool that can hold every request at its longest.
    pub fn new(
        requests: usize,
        layers: usize,
        prompt_lens: (usize, usize),
        gen_tokens: (usize, usize),
        seed: u64,
    ) -> Batch {
        let max_len = prompt_lens.1 + gen_tokens.1;
        let max_blocks = max_len.div_ceil(BLOCK_SIZE);
        let num_blocks = requests * max_blocks;
        let mut rng = Rng::new(seed);
        // A shuffled free list: requests get scattered blocks, as in a long-running engine.
        let mut free: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..free.len()).rev() {
            free.swap(i, rng.below(i + 1));
        }
        let mut batch = Batch {
            requests: Vec::with_capacity(requests),
            max_blocks,
            num_blocks,
            free,
            prompt_lens,
            gen_tokens,
            next_uid: 0,
            rng,
            scratch: Scratch::default(),
            admitted: Vec::new(),
            finished: 0,
            table: vec![-1; requests * max_blocks],
            seq_lens: vec![0; requests],
            slot_mapping: vec![-1; requests],
            topk_len: vec![0; requests],
            positions: vec![-1; layers * requests * TOPK],
        };
        for row in 0..requests {
            let r = batch.new_request();
            batch.requests.push(r);
            batch.admitted.push(row);
        }
        batch
    }

    /// The batch size.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// A new request with its prompt's blocks allocated.
    fn new_request(&mut self) -> Request {
        let (lo, hi) = self.prompt_lens;
        let prompt = self.rng.range(lo, hi);
        let end = prompt + self.rng.range(self.gen_tokens.0, self.gen_tokens.1);
        let blocks = (0..prompt.div_ceil(BLOCK_SIZE))
            .map(|_| {
                self.free
                    .pop()
                    .expect("the pool holds every request at its longest")
            })
            .collect();
        self.next_uid += 1;
        Request {
            uid: self.next_uid,
            prompt,
            len: prompt,
            end,
            blocks,
        }
    }

    /// The global slot id of position `pos` of the request in `row`.
    pub fn slot(&self, row: usize, pos: usize) -> i64 {
        let r = &self.requests[row];
        r.blocks[pos / BLOCK_SIZE] as i64 * BLOCK_SIZE as i64 + (pos % BLOCK_SIZE) as i64
    }

    /// Starts a step: finished requests leave (their blocks go back to the pool) and new ones
    /// take their rows ([`Batch::admitted`]: prefill their prompts before this step's
    /// decode), every request gets a slot for its new token (a new block when it crosses a
    /// block boundary), and the indexer picks each layer's positions.
    pub fn begin_step(&mut self) {
        self.admitted.clear();
        for row in 0..self.len() {
            if self.requests[row].len >= self.requests[row].end {
                let blocks = std::mem::take(&mut self.requests[row].blocks);
                self.free.extend(blocks);
                self.requests[row] = self.new_request();
                self.admitted.push(row);
                self.finished += 1;
            }
        }
        let n = self.len();
        for row in 0..n {
            let pos = self.requests[row].len;
            if pos % BLOCK_SIZE == 0 {
                let b = self
                    .free
                    .pop()
                    .expect("the pool holds every request at its longest");
                self.requests[row].blocks.push(b);
            }
            self.requests[row].len += 1;
            self.slot_mapping[row] = self.slot(row, pos);
            let r = &self.requests[row];
            let table_row = &mut self.table[row * self.max_blocks..][..self.max_blocks];
            table_row.fill(-1);
            table_row[..r.blocks.len()].copy_from_slice(&r.blocks);
            self.seq_lens[row] = r.len as i32;
            self.topk_len[row] = r.len.min(TOPK) as i32;
        }
        let rows = self.positions.chunks_exact_mut(TOPK);
        for (i, out) in rows.enumerate() {
            let len = self.requests[i % n].len;
            indexer(&mut self.rng, &mut self.scratch, len, out);
        }
    }

    /// Positions of `layer` for batch row `row` (`TOPK` entries, `-1` past `topk_len`).
    pub fn positions_of(&self, layer: usize, row: usize) -> &[i32] {
        &self.positions[(layer * self.len() + row) * TOPK..][..TOPK]
    }
}

/// The indexer's scratch: a pool of positions, a bitmap of those taken.
#[derive(Default)]
struct Scratch {
    pool: Vec<i32>,
    taken: Vec<u64>,
}

/// The DSA indexer, made up: `min(TOPK, len)` distinct positions of `0..len` in random order
/// (all of them when the request is shorter than TOPK), `-1` after them. A real indexer
/// scores every cached position against the token's indexer query and keeps the top ones.
fn indexer(rng: &mut Rng, scratch: &mut Scratch, len: usize, out: &mut [i32]) {
    out.fill(-1);
    let k = len.min(TOPK);
    if 2 * k >= len {
        // Most positions are picked: a partial Fisher-Yates shuffle of all of them.
        let pool = &mut scratch.pool;
        pool.clear();
        pool.extend(0..len as i32);
        for i in 0..k {
            pool.swap(i, i + rng.below(len - i));
        }
        out[..k].copy_from_slice(&pool[..k]);
        return;
    }
    // Few are picked: draw until k distinct ones came up.
    let taken = &mut scratch.taken;
    taken.clear();
    taken.resize(len.div_ceil(64), 0);
    let mut n = 0;
    while n < k {
        let p = rng.below(len);
        let (w, bit) = (p / 64, 1u64 << (p % 64));
        if taken[w] & bit == 0 {
            taken[w] |= bit;
            out[n] = p as i32;
            n += 1;
        }
    }
}
