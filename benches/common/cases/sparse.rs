//! Sparse (DSA top-k) decode: rows of slot ids drawn without repeats, optionally cut short
//! per row by topk_len.

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::reference::{self, SparseProblem};
use mla_decode::{
    sparse_decode, DecodePlan, Element, KvCache, PlanOptions, SparseArgs, SparseIndices,
    SparseShape,
};

use super::super::check::{self, RefRow};
use super::super::rng::Rng;
use super::super::spec::{CaseSpec, SparseSpec};
use super::super::Res;
use super::{
    bench_softmax_scale, Cache, DecodeCase, DecodeKind, Io, Meta, Rotated, CHUNK_ROWS, FLOP_PER_ROW,
};

/// A sparse problem: `tokens` query rows of `topk` slot ids each.
#[derive(Clone, Debug)]
pub struct SparseSetup {
    pub tokens: usize,
    pub heads: usize,
    pub topk: usize,
    pub softmax_scale: f32,
}

/// What a sparse case adds to [`DecodeCase`]: the indices and the optional topk_len.
pub struct SparseKind {
    setup: SparseSetup,
    kv_format: mla_decode::KvFormat,
    indices_host: Vec<i32>,
    indices: CudaSlice<i32>,
    topk_len_host: Option<Vec<i32>>,
    topk_len: Option<CudaSlice<i32>>,
}

/// Sparse (DSA top-k) decode.
pub type SparseCase<T> = DecodeCase<T, SparseKind>;

impl<T: Element> DecodeCase<T, SparseKind> {
    /// A cache of `pool` slots and ids drawn from it uniformly, without repeats per token;
    /// with `klen`, the per-row topk_len drawn from the case's `seed`.
    pub fn from_spec(stream: &Arc<CudaStream>, spec: &SparseSpec, rng: &mut Rng) -> Res<Self> {
        let num_blocks = spec.pool.div_ceil(spec.block_size);
        let cache = Arc::new(Cache::random_in(
            stream,
            num_blocks,
            spec.block_size,
            spec.kv,
            rng,
        )?);
        let mut pool: Vec<i32> = (0..i32::try_from(spec.pool)?).collect();
        let mut ids = Vec::with_capacity(spec.tokens * spec.topk);
        for _ in 0..spec.tokens {
            ids.extend_from_slice(rng.distinct(&mut pool, spec.topk));
        }
        let setup = SparseSetup {
            tokens: spec.tokens,
            heads: spec.heads,
            topk: spec.topk,
            softmax_scale: bench_softmax_scale(),
        };
        let topk_len = spec
            .topk_lens()
            .map(|l| l.into_iter().map(i32::try_from).collect())
            .transpose()?;
        let indices = stream.clone_htod(&ids)?;
        let name = CaseSpec::Sparse(spec.clone()).name();
        let mut case =
            Self::with_topk_len(stream, name, setup, cache, indices, ids, topk_len, rng)?;
        case.meta.lens = Some(spec.lens_label());
        Ok(case)
    }

    /// A sparse case over `cache` with the given slot ids (`indices_host` is their copy on
    /// the host, for the reference) and random queries; every row reads its `topk` ids.
    pub fn new(
        stream: &Arc<CudaStream>,
        name: String,
        setup: SparseSetup,
        cache: Arc<Cache<T>>,
        indices: CudaSlice<i32>,
        indices_host: Vec<i32>,
        rng: &mut Rng,
    ) -> Res<Self> {
        Self::with_topk_len(stream, name, setup, cache, indices, indices_host, None, rng)
    }

    /// As [`new`](Self::new), row `t` reading its first `topk_len[t]` ids when given.
    #[allow(clippy::too_many_arguments)]
    pub fn with_topk_len(
        stream: &Arc<CudaStream>,
        name: String,
        setup: SparseSetup,
        cache: Arc<Cache<T>>,
        indices: CudaSlice<i32>,
        indices_host: Vec<i32>,
        topk_len: Option<Vec<i32>>,
        rng: &mut Rng,
    ) -> Res<Self> {
        let io = Io::new(stream, setup.tokens, setup.heads, rng)?;
        let used = used_entries(&indices_host, setup.topk, topk_len.as_deref());
        let rows_read = used.iter().filter(|&&id| id >= 0).count() as f64;
        // ids read (+ the topk_len array)
        let index_bytes = match &topk_len {
            None => (setup.tokens * setup.topk * 4) as f64,
            Some(l) => 4.0 * (used.len() + l.len()) as f64,
        };
        let meta = Meta {
            name,
            kind: "sparse",
            dtype: Some(T::DTYPE),
            kv_format: Some(cache.kind.json_format(T::DTYPE)),
            scale_rule: cache.kind.scale_rule(),
            batch: setup.tokens,
            q_len: 1,
            heads: setup.heads,
            seq_len: 0,
            topk: setup.topk,
            lens: Some(format!("{}*{}", setup.topk, setup.tokens)),
            block_size: cache.block_size,
            bytes: rows_read * cache.row_bytes() as f64 + io.bytes() + index_bytes,
            flop: FLOP_PER_ROW * setup.heads as f64 * rows_read,
            copies: None,
        };
        let distinct_rows = distinct_slots(&used, cache.num_blocks * cache.block_size);
        let kind = SparseKind {
            kv_format: cache.format(),
            topk_len: topk_len
                .as_ref()
                .map(|l| stream.clone_htod(l))
                .transpose()?,
            topk_len_host: topk_len,
            setup,
            indices_host,
            indices,
        };
        Ok(DecodeCase {
            meta,
            kind,
            kv: Rotated::new(cache, distinct_rows),
            io,
            plan: None,
            reference: None,
        })
    }
}

/// The ids the rows read: the first `topk_len[t]` (clamped to `0..=topk`) of row `t`, or all.
pub fn used_entries(ids: &[i32], topk: usize, topk_len: Option<&[i32]>) -> Vec<i32> {
    ids.chunks_exact(topk.max(1))
        .enumerate()
        .flat_map(|(t, row)| {
            let n = topk_len.map_or(topk, |l| l[t].clamp(0, topk as i32) as usize);
            row[..n].iter().copied()
        })
        .collect()
}

/// How many distinct slots in `0..slots` the ids name (-1 and other ids out of range
/// count for none).
fn distinct_slots(ids: &[i32], slots: usize) -> usize {
    let mut seen = vec![false; slots];
    let mut n = 0;
    for &id in ids {
        if let Some(s) = usize::try_from(id).ok().and_then(|i| seen.get_mut(i)) {
            n += usize::from(!*s);
            *s = true;
        }
    }
    n
}

impl SparseKind {
    fn reference_of<T: Element>(
        &self,
        t: usize,
        cache: &Cache<T>,
        rows: &[f64],
        io: &Io<T>,
        heads: &[usize],
    ) -> Vec<RefRow> {
        let s = &self.setup;
        let ids: Vec<i32> = self.indices_host[t * s.topk..][..s.topk]
            .iter()
            .map(|&id| if id < 0 { id } else { id % CHUNK_ROWS as i32 })
            .collect();
        let q = io.q_f64(&[t], heads);
        let att = reference::sparse_decode(&SparseProblem {
            q: &q,
            num_tokens: 1,
            num_heads: heads.len(),
            cache: cache.reference_cache(rows),
            indices: &ids,
            topk: s.topk,
            topk_len: self.topk_len_host.as_ref().map(|l| &l[t..=t]),
            softmax_scale: f64::from(s.softmax_scale),
        });
        check::rows_of(&att, &[t], heads)
    }
}

impl<T: Element> DecodeKind<T> for SparseKind {
    fn plan(
        &self,
        stream: &Arc<CudaStream>,
        options: PlanOptions,
    ) -> mla_decode::Result<DecodePlan> {
        let shape = SparseShape {
            num_tokens: self.setup.tokens,
            num_heads: self.setup.heads,
            topk: self.setup.topk,
            kv_format: self.kv_format,
        };
        DecodePlan::sparse(stream, shape, options)
    }

    fn launch(
        &self,
        stream: &Arc<CudaStream>,
        plan: &mut DecodePlan,
        kv: KvCache<'_>,
        io: &mut Io<T>,
    ) -> mla_decode::Result<()> {
        let s = &self.setup;
        let (q, mut out, mut lse, flag) = io.views();
        let args = SparseArgs {
            q,
            kv_cache: kv,
            indices: SparseIndices::contiguous(&self.indices, s.topk),
            topk_len: self.topk_len.as_ref().map(|l| l as _),
            softmax_scale: s.softmax_scale,
        };
        sparse_decode(stream, plan, &args, &mut out, Some(&mut lse), Some(flag))
    }

    fn reference(&self, cache: &Cache<T>, rows: &[f64], io: &Io<T>) -> Vec<RefRow> {
        let heads = check::spread(self.setup.heads, check::MAX_HEADS);
        let tokens = check::spread(self.setup.tokens, check::MAX_ROWS);
        check::parallel(&tokens, |t| self.reference_of(t, cache, rows, io, &heads))
    }
}
