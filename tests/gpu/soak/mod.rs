//! The random-API soak: many random calls across the whole API (dense and sparse decode,
//! append, gather) on one stream, with plans of random shapes kept and reused, random
//! strides and layouts (queries in every layout, padded outputs, padded tables, index
//! rows and cache blocks), random lengths, and about one call in five bad:
//!
//! - **good** calls (80 %) must match the f64 reference (decode: a random pair of heads;
//!   append: the whole cache, byte for byte; gather: every slot id) with a clear flag;
//! - **device-visible bad** ones (10 %: bad block ids, negative and too-large seq_lens, bad
//!   slot ids, bad topk_len, bad append slots, bad req ids) must give the contract's
//!   skip/clamp result, the same reference, and a flag holding one of the faults the
//!   reference reports;
//! - **host-visible bad** ones (10 %: a wrong plan, a bad scale, a cache of the wrong
//!   format, short buffers, a view made for other heads, a misaligned or too-short
//!   `kv`, bad strides, counts out of range, an fp8 cache with an f16/bf16 plan) must return
//!   a typed error (`InvalidArgument` naming the parameter that was made bad) and
//!   launch nothing: the outputs keep their poison (the append cache its bytes) and the
//!   flag stays clear, although each such call also carries a value the device would
//!   record.
//!
//! The flag is reset before every call that gets one, so a good call right after a bad one
//! shows that nothing stuck. Counts: `soak_random_api` makes `MLA_SOAK_CALLS` calls (300
//! by default, so the normal GPU test run stays fast; the soak proper is 10,000),
//! `sanitize_soak_random_api` `MLA_SANITIZE_SOAK_CALLS` calls (150; the sanitizer soak is
//! 500) of smaller shapes, for compute-sanitizer (memcheck, racecheck, synccheck).
//! The seed is printed (`MLA_TEST_SEED` replays a run), and so is a summary.

mod cache_ops;
mod decode;

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::half::{bf16, f16};
use mla_decode::{DType, DecodePlan, Error, ErrorFlag, KvFormat, PlanKind};

use crate::kit::*;

/// What a call is made to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Valid everywhere: must match the reference, flag clear.
    Good,
    /// Valid on the host, with values only the device sees that are bad.
    DeviceBad,
    /// Refused on the host.
    HostBad,
}

/// The largest shapes a soak draws (the sanitizer's are smaller: it is 10-100x slower).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Most query rows of a decode call.
    pub rows: usize,
    /// Most heads.
    pub heads: usize,
    /// Most cache rows a dense request can hold (block-table capacity).
    pub len: usize,
    /// Most sparse entries per row.
    pub topk: usize,
    /// Reference work of a decode call: query rows × cache rows it may see (two heads are
    /// checked).
    pub work: usize,
}

const SOAK_LIMITS: Limits = Limits {
    rows: 32,
    heads: 128,
    len: 4096,
    topk: 4096,
    work: 24_000,
};

const SANITIZE_LIMITS: Limits = Limits {
    rows: 16,
    heads: 32,
    len: 1024,
    topk: 1024,
    work: 8_000,
};

/// Slots of each shared cache that decode calls read.
pub(crate) const SHARED_SLOTS: usize = 8192;

/// A random-content f16/bf16 cache (host mirror and device copy) that every decode call of
/// its dtype and block size reads: sharing them keeps 10,000 calls from generating 10,000
/// caches.
pub(crate) struct Shared<T> {
    pub host: HostCache<T>,
    pub dev: CudaSlice<T>,
}

/// The element types, with the soak's shared caches of each.
pub(crate) trait SoakElem: Half {
    /// The shared caches of this dtype, by block size.
    fn shared(s: &mut Soak) -> &mut HashMap<usize, Rc<Shared<Self>>>;
}

impl SoakElem for f16 {
    fn shared(s: &mut Soak) -> &mut HashMap<usize, Rc<Shared<f16>>> {
        &mut s.shared_f16
    }
}

impl SoakElem for bf16 {
    fn shared(s: &mut Soak) -> &mut HashMap<usize, Rc<Shared<bf16>>> {
        &mut s.shared_bf16
    }
}

/// Counts per (call, kind), for the summary.
#[derive(Default, Debug)]
struct Stats {
    calls: HashMap<(&'static str, &'static str), usize>,
    good_after_bad: usize,
    plans_made: usize,
}

/// The soak's state: the stream, the shared caches, the plan pool, the append caches.
pub(crate) struct Soak {
    pub stream: Arc<CudaStream>,
    pub rng: Rng,
    pub limits: Limits,
    /// Reset before every call that gets it.
    pub flag: ErrorFlag,
    shared_f16: HashMap<usize, Rc<Shared<f16>>>,
    shared_bf16: HashMap<usize, Rc<Shared<bf16>>>,
    /// Plans kept and reused: a call of a plan's kind picks one of them (or makes one).
    plans: Vec<DecodePlan>,
    /// Caches that appends write into (one per format), with their host mirrors.
    pub append_caches: Vec<cache_ops::AppendCache>,
    stats: Stats,
}

impl Soak {
    fn new(stream: Arc<CudaStream>, rng: Rng, limits: Limits) -> Soak {
        let mut s = Soak {
            flag: ErrorFlag::new(&stream).unwrap(),
            stream,
            rng,
            limits,
            shared_f16: HashMap::new(),
            shared_bf16: HashMap::new(),
            plans: Vec::new(),
            append_caches: Vec::new(),
            stats: Stats::default(),
        };
        s.append_caches = cache_ops::AppendCache::all(&mut s);
        s
    }

    /// The shared cache of `T` with `block_size`-row blocks (made on first use).
    pub fn shared<T: SoakElem>(&mut self, block_size: usize) -> Rc<Shared<T>> {
        if !T::shared(self).contains_key(&block_size) {
            let pad = 8 * self.rng.below(4);
            let nb = SHARED_SLOTS / block_size;
            let host = HostCache::<T>::random(&mut self.rng, nb, block_size, pad);
            let dev = host.upload(&self.stream);
            T::shared(self).insert(block_size, Rc::new(Shared { host, dev }));
        }
        T::shared(self)[&block_size].clone()
    }

    /// A plan for which `fits` holds, taken out of the pool (put it back with
    /// [`Soak::put_plan`]): one of the pool's, or, one time in five (or when none fits), a
    /// new one of the shape `make` draws.
    pub fn take_plan(
        &mut self,
        fits: impl Fn(&PlanKind) -> bool,
        make: impl FnOnce(&mut Rng, &Limits) -> PlanKind,
    ) -> DecodePlan {
        let fitting: Vec<usize> = (0..self.plans.len())
            .filter(|&i| fits(&self.plans[i].kind()))
            .collect();
        if !fitting.is_empty() && !self.rng.chance(0.2) {
            let i = fitting[self.rng.below(fitting.len())];
            return self.plans.swap_remove(i);
        }
        let kind = make(&mut self.rng, &self.limits);
        self.stats.plans_made += 1;
        match kind {
            PlanKind::Dense(s) => DecodePlan::dense(&self.stream, s, plan_options(false)),
            PlanKind::Sparse(s) => DecodePlan::sparse(&self.stream, s, plan_options(false)),
        }
        .unwrap_or_else(|e| panic!("plan for {kind:?}: {e}"))
    }

    /// Puts a plan (back) into the pool, which keeps at most 12 (a random one goes).
    pub fn put_plan(&mut self, p: DecodePlan) {
        if self.plans.len() >= 12 {
            let i = self.rng.below(self.plans.len());
            self.plans.swap_remove(i);
        }
        self.plans.push(p);
    }

    /// A plan of the other family than `dense` from the pool, if it has one (for the "wrong
    /// plan" refusal), taken out.
    pub fn other_plan(&mut self, dense: bool) -> Option<DecodePlan> {
        let i = (0..self.plans.len())
            .find(|&i| matches!(self.plans[i].kind(), PlanKind::Dense(_)) != dense)?;
        Some(self.plans.swap_remove(i))
    }

    /// Whether the call passes the flag (then reset here): bad calls always do, good ones
    /// nine times in ten.
    pub fn flag_for(&mut self, kind: Kind) -> bool {
        let with = kind != Kind::Good || !self.rng.chance(0.1);
        if with {
            self.flag.reset(&self.stream).unwrap();
        }
        with
    }

    /// The flag's words (synchronizes).
    pub fn flag_words(&self) -> [u32; 4] {
        self.flag.read(&self.stream).unwrap()
    }

    fn count(&mut self, op: &'static str, kind: Kind) {
        let k = match kind {
            Kind::Good => "good",
            Kind::DeviceBad => "device-bad",
            Kind::HostBad => "host-bad",
        };
        *self.stats.calls.entry((op, k)).or_default() += 1;
    }
}

/// A random dtype.
pub(crate) fn random_dtype(rng: &mut Rng) -> DType {
    rng.pick(&[DType::F16, DType::Bf16])
}

/// A head count: mostly small, sometimes many.
pub(crate) fn random_heads(rng: &mut Rng, limits: &Limits, rows: usize) -> usize {
    let h = rng.pick(&[1, 2, 3, 4, 8, 8, 8, 16, 16, 32, 64, 128]);
    // keep rows × heads small enough that the host makes queries quickly
    h.min(limits.heads).min((1024 / rows).max(1))
}

/// Two heads of `heads` to check (one when there is one).
pub(crate) fn checked_heads(rng: &mut Rng, heads: usize) -> Vec<usize> {
    let mut h: Vec<usize> = rng.sample(heads, heads.min(2));
    h.sort_unstable();
    h
}

/// What a host-visible bad call must return.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Refusal {
    /// `InvalidArgument` naming this parameter or field (one of the call's `names`).
    Arg(&'static str),
    /// `Unsupported` (no call the soak makes is, since fp8 decode landed).
    #[allow(dead_code)]
    Unsupported,
}

/// Asserts that `r` is the refusal `want`, with an argument of `names`.
#[track_caller]
pub(crate) fn check_refused(label: &str, r: mla_decode::Result<()>, want: Refusal, names: &[&str]) {
    match (&r, want) {
        (Err(Error::InvalidArgument { arg, reason }), Refusal::Arg(expected)) => {
            assert!(
                names.contains(arg),
                "{label}: `{arg}` ({reason}) is not an argument of the call"
            );
            assert_eq!(
                *arg, expected,
                "{label}: refused for `{arg}` ({reason}), want `{expected}`"
            );
        }
        (Err(Error::Unsupported(_)), Refusal::Unsupported) => {}
        _ => panic!("{label}: want {want:?}, got {r:?}"),
    }
}

/// Which call the soak makes next.
#[derive(Clone, Copy, Debug)]
enum Op {
    Dense,
    Sparse,
    Append,
    Gather,
}

fn calls_from_env(var: &str, default: usize) -> usize {
    match std::env::var(var) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{var}={v:?}: not a count")),
        Err(_) => default,
    }
}

/// Runs `calls` random calls; panics at the first one that breaks the contract.
fn soak(test: &str, calls: usize, limits: Limits) {
    let (_ctx, stream) = gpu();
    let mut s = Soak::new(stream, rng_for(test), limits);
    let mut after_bad = false;
    let started = std::time::Instant::now();
    for i in 0..calls {
        let kind = match s.rng.below(10) {
            0 => Kind::DeviceBad,
            1 => Kind::HostBad,
            _ => Kind::Good,
        };
        let op = s.rng.pick(&[Op::Dense, Op::Sparse, Op::Append, Op::Gather]);
        let label = format!("{test}: call {i} ({op:?}, {kind:?})");
        let name = match op {
            Op::Dense => {
                let dtype = random_dtype(&mut s.rng);
                with_dtype!(dtype, T => decode::dense::<T>(&mut s, &label, kind));
                "dense_decode"
            }
            Op::Sparse => {
                let dtype = random_dtype(&mut s.rng);
                with_dtype!(dtype, T => decode::sparse::<T>(&mut s, &label, kind));
                "sparse_decode"
            }
            Op::Append => {
                cache_ops::append(&mut s, &label, kind);
                "append_kv"
            }
            Op::Gather => {
                cache_ops::gather(&mut s, &label, kind);
                "gather_slots"
            }
        };
        s.count(name, kind);
        if kind == Kind::Good && after_bad {
            s.stats.good_after_bad += 1;
        }
        after_bad = kind != Kind::Good;
    }
    let mut rows: Vec<_> = s.stats.calls.iter().collect();
    rows.sort();
    eprintln!(
        "{test}: {calls} calls in {:.1} s, {} plans made, {} good calls right after a bad one:",
        started.elapsed().as_secs_f64(),
        s.stats.plans_made,
        s.stats.good_after_bad
    );
    for ((op, kind), n) in rows {
        eprintln!("  {op:14} {kind:10} {n}");
    }
    // Nothing left behind: the last calls' work is done and the stream is healthy.
    s.stream.synchronize().unwrap();
}

/// The random-API soak (`MLA_SOAK_CALLS`, default 300; the soak proper is 10,000).
#[test]
#[ignore = "needs a GPU"]
fn soak_random_api() {
    soak(
        "soak_random_api",
        calls_from_env("MLA_SOAK_CALLS", 300),
        SOAK_LIMITS,
    );
}

/// The soak's subset for compute-sanitizer (`MLA_SANITIZE_SOAK_CALLS`, default 150; the
/// sanitizer soak is 500), smaller shapes.
#[test]
#[ignore = "needs a GPU"]
fn sanitize_soak_random_api() {
    soak(
        "sanitize_soak_random_api",
        calls_from_env("MLA_SANITIZE_SOAK_CALLS", 150),
        SANITIZE_LIMITS,
    );
}

/// An fp8 cache format.
pub(crate) fn fp8_format(rng: &mut Rng) -> KvFormat {
    rng.pick(&[KvFormat::Fp8DsMla, KvFormat::Fp8PerTensor])
}
