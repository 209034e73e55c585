//! Dense paged decode over a randomly permuted block table, requests with their own lengths.

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::reference::{self, DenseProblem};
use mla_decode::{
    dense_decode, BlockTable, DecodePlan, DenseArgs, DenseShape, Element, KvCache, KvFormat,
    PlanOptions, TableShape,
};

use super::super::check::{self, RefRow};
use super::super::rng::Rng;
use super::super::spec::CacheKind;
use super::super::spec::{CaseSpec, DenseSpec};
use super::super::Res;
use super::{
    bench_softmax_scale, lens_label, Cache, DecodeCase, DecodeKind, Io, Meta, Rotated, FLOP_PER_ROW,
};

/// A dense problem: requests with their own lengths.
#[derive(Clone, Debug)]
pub struct DenseSetup {
    pub batch: usize,
    pub q_len: usize,
    pub heads: usize,
    pub block_size: usize,
    /// `[batch]` cached tokens per request.
    pub seq_lens: Vec<i32>,
    pub softmax_scale: f32,
}

/// What a dense case adds to [`DecodeCase`]: the block table and the lengths.
pub struct DenseKind {
    setup: DenseSetup,
    kv_format: KvFormat,
    max_blocks: usize,
    table_host: Vec<i32>,
    table: CudaSlice<i32>,
    seq_lens: CudaSlice<i32>,
}

/// Dense paged decode.
pub type DenseCase<T> = DecodeCase<T, DenseKind>;

/// Query rows that see each cache row, summed: row `i` of a request of `L` tokens and
/// `q_len` rows sees `L - q_len + 1 + i` of them (causal).
pub fn visible_rows(seq_lens: &[i32], q_len: usize) -> f64 {
    let q = q_len as i64;
    seq_lens
        .iter()
        .map(|&l| {
            (0..q)
                .map(|i| (i64::from(l.max(0)) - q + 1 + i).max(0) as f64)
                .sum::<f64>()
        })
        .sum()
}

impl<T: Element> DecodeCase<T, DenseKind> {
    /// The lengths of `spec` (drawn from its `seed` for `uniform`), a table of `l` (or the
    /// longest length) columns, random inputs from `rng`.
    pub fn from_spec(stream: &Arc<CudaStream>, spec: &DenseSpec, rng: &mut Rng) -> Res<Self> {
        let setup = DenseSetup {
            batch: spec.batch,
            q_len: spec.q_len,
            heads: spec.heads,
            block_size: spec.block_size,
            seq_lens: spec
                .seq_lens()
                .into_iter()
                .map(i32::try_from)
                .collect::<Result<_, _>>()?,
            softmax_scale: bench_softmax_scale(),
        };
        let name = CaseSpec::Dense(spec.clone()).name();
        let mut case =
            Self::with_table_in(stream, name, setup, Some(spec.table_len()), spec.kv, rng)?;
        case.meta.lens = Some(spec.lens_label());
        Ok(case)
    }

    /// Random cache blocks (as many as the lengths need), table and queries for `setup`.
    pub fn new(
        stream: &Arc<CudaStream>,
        name: String,
        setup: DenseSetup,
        rng: &mut Rng,
    ) -> Res<Self> {
        Self::with_table(stream, name, setup, None, rng)
    }

    /// As [`new`](Self::new), with a block table of `table_len` tokens' columns (at least
    /// the longest request's).
    pub fn with_table(
        stream: &Arc<CudaStream>,
        name: String,
        setup: DenseSetup,
        table_len: Option<usize>,
        rng: &mut Rng,
    ) -> Res<Self> {
        Self::with_table_in(stream, name, setup, table_len, CacheKind::Query, rng)
    }

    /// As [`with_table`](Self::with_table), the cache in format `kv`.
    pub fn with_table_in(
        stream: &Arc<CudaStream>,
        name: String,
        setup: DenseSetup,
        table_len: Option<usize>,
        kv: CacheKind,
        rng: &mut Rng,
    ) -> Res<Self> {
        let bs = setup.block_size;
        let blocks: Vec<usize> = setup
            .seq_lens
            .iter()
            .map(|&l| (l.max(0) as usize).div_ceil(bs))
            .collect();
        let max_blocks = blocks
            .iter()
            .copied()
            .chain(table_len.map(|l| l.div_ceil(bs)))
            .max()
            .unwrap_or(0)
            .max(1);
        let num_blocks = blocks.iter().sum::<usize>().max(1);
        let mut ids: Vec<i32> = (0..i32::try_from(num_blocks)?).collect();
        rng.shuffle(&mut ids);
        let mut table_host = vec![0i32; setup.batch * max_blocks];
        let mut next = 0;
        for (row, &n) in table_host.chunks_exact_mut(max_blocks).zip(&blocks) {
            row[..n].copy_from_slice(&ids[next..next + n]);
            next += n;
        }
        let cache = Arc::new(Cache::random_in(stream, num_blocks, bs, kv, rng)?);
        let io = Io::new(stream, setup.batch * setup.q_len, setup.heads, rng)?;
        let rows_read: f64 = setup.seq_lens.iter().map(|&l| l.max(0) as f64).sum();
        let meta = Meta {
            name,
            kind: "dense",
            dtype: Some(T::DTYPE),
            kv_format: Some(kv.json_format(T::DTYPE)),
            scale_rule: kv.scale_rule(),
            batch: setup.batch,
            q_len: setup.q_len,
            heads: setup.heads,
            seq_len: setup.seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize,
            topk: 0,
            lens: Some(lens_label(&setup.seq_lens)),
            block_size: bs,
            bytes: rows_read * cache.row_bytes() as f64 + io.bytes(),
            flop: FLOP_PER_ROW * setup.heads as f64 * visible_rows(&setup.seq_lens, setup.q_len),
            copies: None,
        };
        let kind = DenseKind {
            kv_format: cache.format(),
            max_blocks,
            table: stream.clone_htod(&table_host)?,
            table_host,
            seq_lens: stream.clone_htod(&setup.seq_lens)?,
            setup,
        };
        Ok(DecodeCase {
            meta,
            kind,
            // the table's blocks are distinct, so are the rows read
            kv: Rotated::new(cache, rows_read as usize),
            io,
            plan: None,
            reference: None,
        })
    }

    pub fn setup(&self) -> &DenseSetup {
        &self.kind.setup
    }

    /// `[batch, max_blocks_per_seq]` as uploaded.
    pub fn block_table(&self) -> (&[i32], usize) {
        (&self.kind.table_host, self.kind.max_blocks)
    }
}

impl DenseKind {
    /// The reference rows of request `b` (its q_len rows, the sampled heads).
    fn reference_of<T: Element>(
        &self,
        b: usize,
        cache: &Cache<T>,
        rows: &[f64],
        io: &Io<T>,
        heads: &[usize],
    ) -> Vec<RefRow> {
        let (s, mb) = (&self.setup, self.max_blocks);
        let ref_blocks = cache.reference_blocks() as i32;
        let table: Vec<i32> = self.table_host[b * mb..][..mb]
            .iter()
            .map(|&e| e % ref_blocks)
            .collect();
        let tokens: Vec<usize> = (b * s.q_len..(b + 1) * s.q_len).collect();
        let q = io.q_f64(&tokens, heads);
        let att = reference::dense_decode(&DenseProblem {
            q: &q,
            batch: 1,
            q_len: s.q_len,
            num_heads: heads.len(),
            cache: cache.reference_cache(rows),
            block_table: &table,
            max_blocks_per_seq: mb,
            seq_lens: &s.seq_lens[b..=b],
            softmax_scale: f64::from(s.softmax_scale),
        });
        check::rows_of(&att, &tokens, heads)
    }
}

impl<T: Element> DecodeKind<T> for DenseKind {
    fn plan(
        &self,
        stream: &Arc<CudaStream>,
        options: PlanOptions,
    ) -> mla_decode::Result<DecodePlan> {
        let shape = DenseShape {
            batch: self.setup.batch,
            q_len: self.setup.q_len,
            num_heads: self.setup.heads,
            block_size: self.setup.block_size,
            max_blocks_per_seq: self.max_blocks,
            kv_format: self.kv_format,
        };
        DecodePlan::dense(stream, shape, options)
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
        let table = TableShape {
            batch: s.batch,
            max_blocks_per_seq: self.max_blocks,
        };
        let args = DenseArgs {
            q,
            kv_cache: kv,
            block_table: BlockTable::new(&self.table, table),
            seq_lens: &self.seq_lens,
            softmax_scale: s.softmax_scale,
        };
        dense_decode(stream, plan, &args, &mut out, Some(&mut lse), Some(flag))
    }

    fn reference(&self, cache: &Cache<T>, rows: &[f64], io: &Io<T>) -> Vec<RefRow> {
        let heads = check::spread(self.setup.heads, check::MAX_HEADS);
        let requests = check::spread(self.setup.batch, check::MAX_ROWS);
        check::parallel(&requests, |b| self.reference_of(b, cache, rows, io, &heads))
    }
}
