//! The index gather alone: request-logical positions to global slot ids.

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::reference::{self, GatherProblem};
use mla_decode::{
    gather_slots, BlockTable, CacheLayout, ErrorFlag, GatherArgs, KvCache, KvFormat, TableShape,
};

use super::super::check::{self, Accuracy};
use super::super::kit::cache_bytes;
use super::super::rng::Rng;
use super::super::spec::{CaseSpec, GatherSpec};
use super::super::Res;
use super::{Meta, Workload};

/// The host side of a gather: positions `[tokens, topk]` of requests `req_id[tokens]`.
#[derive(Clone, Debug)]
pub struct GatherInputs {
    pub positions: Vec<i32>,
    pub topk: usize,
    pub req_id: Vec<i32>,
    /// `[batch, max_blocks]`.
    pub block_table: Vec<i32>,
    pub max_blocks: usize,
    /// `[batch]`.
    pub seq_lens: Vec<i32>,
    pub num_blocks: usize,
    pub block_size: usize,
}

impl GatherInputs {
    /// The cache the slot ids are for: bf16, unpadded blocks.
    pub fn cache_layout(&self) -> CacheLayout {
        CacheLayout {
            format: KvFormat::Bf16,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            block_stride_bytes: self.block_size * KvFormat::Bf16.row_bytes(),
        }
    }
}

/// The index gather alone: request-logical positions to global slot ids.
///
/// It reads no KV cache and rotates nothing: its runs keep the memset flush in either
/// `--flush` mode (its inputs, a few MB of positions and tables, would need some hundred
/// copies to span 4× L2). `gather_slots` takes the cache's descriptor, which must describe
/// a buffer of the cache's size: the case allocates one, uninitialized and never read
/// (9.7 GB for the default `gather:t=128,k=2048`, one 65,536-row request per token).
pub struct GatherCase {
    meta: Meta,
    host: GatherInputs,
    positions: CudaSlice<i32>,
    req_id: CudaSlice<i32>,
    table: CudaSlice<i32>,
    seq_lens: CudaSlice<i32>,
    /// The cache's bytes (uninitialized: the gather reads only the descriptor).
    cache: CudaSlice<u8>,
    out: CudaSlice<i32>,
    flag: ErrorFlag,
}

impl GatherCase {
    /// One request of `seq_len` tokens per query token, distinct random positions.
    pub fn from_spec(stream: &Arc<CudaStream>, spec: &GatherSpec, rng: &mut Rng) -> Res<Self> {
        let max_blocks = spec.seq_len.div_ceil(spec.block_size);
        let num_blocks = spec.tokens * max_blocks;
        let mut block_table: Vec<i32> = (0..i32::try_from(num_blocks)?).collect();
        rng.shuffle(&mut block_table);
        let mut logical: Vec<i32> = (0..i32::try_from(spec.seq_len)?).collect();
        let mut positions = Vec::with_capacity(spec.tokens * spec.topk);
        for _ in 0..spec.tokens {
            positions.extend_from_slice(rng.distinct(&mut logical, spec.topk));
        }
        let inputs = GatherInputs {
            positions,
            topk: spec.topk,
            req_id: (0..i32::try_from(spec.tokens)?).collect(),
            block_table,
            max_blocks,
            seq_lens: vec![i32::try_from(spec.seq_len)?; spec.tokens],
            num_blocks,
            block_size: spec.block_size,
        };
        Self::new(stream, CaseSpec::Gather(*spec).name(), inputs)
    }

    pub fn new(stream: &Arc<CudaStream>, name: String, host: GatherInputs) -> Res<Self> {
        let tokens = host.req_id.len();
        let entries = (tokens * host.topk) as f64;
        let meta = Meta {
            name,
            kind: "gather",
            dtype: None,
            kv_format: None,
            scale_rule: None,
            batch: tokens,
            q_len: 1,
            heads: 0,
            seq_len: host.seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize,
            topk: host.topk,
            lens: None,
            block_size: host.block_size,
            // positions read, slot ids written, req_id read
            bytes: entries * 8.0 + tokens as f64 * 4.0,
            flop: 0.0,
            copies: None,
        };
        Ok(GatherCase {
            meta,
            positions: stream.clone_htod(&host.positions)?,
            req_id: stream.clone_htod(&host.req_id)?,
            table: stream.clone_htod(&host.block_table)?,
            seq_lens: stream.clone_htod(&host.seq_lens)?,
            cache: cache_bytes(stream, &host.cache_layout()),
            out: stream.alloc_zeros::<i32>(tokens * host.topk)?,
            flag: ErrorFlag::new(stream)?,
            host,
        })
    }

    /// The slot ids the last step wrote, `[tokens, topk]`.
    pub fn into_output(self) -> CudaSlice<i32> {
        self.out
    }
}

impl Workload for GatherCase {
    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn step(&mut self, stream: &Arc<CudaStream>) -> mla_decode::Result<()> {
        let h = &self.host;
        let table = TableShape {
            batch: h.seq_lens.len(),
            max_blocks_per_seq: h.max_blocks,
        };
        let args = GatherArgs {
            positions: &self.positions,
            positions_stride: h.topk,
            req_id: &self.req_id,
            block_table: BlockTable::new(&self.table, table),
            seq_lens: &self.seq_lens,
            kv_cache: KvCache::new(&self.cache, h.cache_layout()),
            topk: h.topk,
            num_tokens: h.req_id.len(),
            out_stride: h.topk,
        };
        gather_slots(stream, &args, &mut self.out, Some(&mut self.flag))
    }

    fn check_flag(&self, stream: &Arc<CudaStream>) -> Res<()> {
        Ok(self.flag.check(stream)?)
    }

    /// Exact: `relerr` is the fraction of ids that differ from the reference's.
    fn check(&mut self, stream: &Arc<CudaStream>) -> Res<Accuracy> {
        let h = &self.host;
        let (want, _faults) = reference::gather_slots(&GatherProblem {
            positions: &h.positions,
            num_tokens: h.req_id.len(),
            topk: h.topk,
            req_id: &h.req_id,
            block_table: &h.block_table,
            max_blocks_per_seq: h.max_blocks,
            seq_lens: &h.seq_lens,
            batch: h.seq_lens.len(),
            block_size: h.block_size,
            num_blocks: h.num_blocks,
        });
        let got = stream.clone_dtoh(&self.out)?;
        let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        Ok(Accuracy {
            relerr: wrong as f64 / want.len().max(1) as f64,
            lse_err: None,
            tolerance: 0.0, // exact
        })
    }
}
