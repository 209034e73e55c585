//! Concurrency: work of different plans in flight at once gives bitwise the results the
//! same calls give alone.
//!
//! - two streams of one context, one with a dense plan and one with a sparse plan, their
//!   launches interleaved (no synchronization between them);
//! - two host threads, each driving its own stream and plan;
//! - two GPUs, one thread each (where the machine has two; otherwise the test says
//!   `SKIPPED ... one GPU` on stderr, which libtest does not capture, and passes).
//!
//! Each stream's calls are first run alone (the other stream idle) and checked against the
//! reference on two heads; the concurrent runs must then match those bits exactly (the same
//! inputs and plan shape give the same bits: fixed combine order).

use std::io::Write;
use std::sync::{Arc, Barrier};

use mla_decode::cudarc::driver::{CudaContext, CudaStream};
use mla_decode::half::{bf16, f16};
use mla_decode::{DecodePlan, Error, ErrorFlag, PlanKind, PlanOptions};

use crate::kit::*;

/// Calls per stream, and rounds of the concurrent run.
const CALLS: usize = 3;
const ROUNDS: usize = 3;

/// The logical bits of one call's out and lse.
type Bits = (Vec<u16>, Vec<u32>);

/// One stream's work: its plan, flag and calls (each with its own inputs and outputs).
struct Lane<P: Problem> {
    stream: Arc<CudaStream>,
    plan: DecodePlan,
    flag: ErrorFlag,
    calls: Vec<Call<P>>,
}

struct Call<P: Problem> {
    dev: P::Dev,
    qd: DevQuery<P::Elem>,
    out: DevOut<P::Elem>,
    lse: DevLse,
    problem: P,
}

impl<P: Problem> Lane<P> {
    /// Uploads `problems` (all of one plan shape) on `stream` and makes their plan there.
    fn new(stream: Arc<CudaStream>, problems: &[(P, HostQuery<P::Elem>)], seed: u64) -> Self
    where
        P: Clone,
    {
        let mut rng = Rng::new(seed);
        let plan = problems[0].0.plan(&stream, PlanOptions::default());
        let calls = problems
            .iter()
            .map(|(p, q)| Call {
                dev: p.upload(&stream),
                qd: q.upload(&stream),
                out: DevOut::random(&mut rng, &stream, p.rows(), p.heads()),
                lse: DevLse::random(&mut rng, &stream, p.rows(), p.heads()),
                problem: p.clone(),
            })
            .collect();
        Lane {
            flag: ErrorFlag::new(&stream).unwrap(),
            stream,
            plan,
            calls,
        }
    }

    /// Poisons every output and clears the flag (on the lane's stream).
    fn reset(&mut self) {
        for c in &mut self.calls {
            c.out.poison(&self.stream);
            c.lse.poison(&self.stream);
        }
        self.flag.reset(&self.stream).unwrap();
    }

    /// Enqueues call `i` (no synchronization).
    fn enqueue(&mut self, i: usize) {
        let c = &mut self.calls[i];
        c.problem
            .decode(
                &self.stream,
                &c.dev,
                &mut self.plan,
                &c.qd,
                &mut c.out,
                Some(&mut c.lse),
                Some(&mut self.flag),
            )
            .unwrap();
    }

    /// Synchronizes and reads every call's outputs; the flag must be clear.
    fn read(&self) -> Vec<Outputs<P::Elem>> {
        let got: Vec<_> = self
            .calls
            .iter()
            .map(|c| Outputs::read(&self.stream, &c.out, Some(&c.lse), &self.flag))
            .collect();
        assert_eq!(got[0].flag, [0; 4], "no call has a bad value");
        got
    }

    /// Every call alone: reset, enqueue all, read.
    fn run_alone(&mut self) -> Vec<Bits> {
        self.reset();
        for i in 0..self.calls.len() {
            self.enqueue(i);
        }
        self.read().iter().map(|o| o.logical_bits()).collect()
    }

    /// Checks the outputs of a run against the reference on two heads.
    fn check_reference(
        &self,
        label: &str,
        got: &[Outputs<P::Elem>],
        rng: &mut Rng,
        qs: &[HostQuery<P::Elem>],
    ) {
        for (i, (c, q)) in self.calls.iter().zip(qs).enumerate() {
            let heads = rng.sample(c.problem.heads(), 2.min(c.problem.heads()));
            let want = c.problem.reference_of(q, &heads);
            // check_outputs compares the listed heads only (reference head k = device heads[k])
            check_outputs(&format!("{label} call {i}"), &got[i], &want, &heads);
        }
    }
}

/// Dense bf16 problems of one shape (16 requests of up to 4096 rows, 16 heads).
fn dense_problems(rng: &mut Rng) -> Vec<(DenseSetup<bf16>, HostQuery<bf16>)> {
    (0..CALLS)
        .map(|_| {
            let spec = DenseSpec {
                q_len: 1,
                heads: 16,
                block_size: 64,
                max_blocks_per_seq: 64,
                table_pad: 1,
                block_pad: 8,
                spare_blocks: 2,
                junk_unused: false,
                seq_lens: (0..16).map(|_| rng.range(1, 4096) as i32).collect(),
                scale: 1.0 / 16.0,
            };
            let p = DenseSetup::<bf16>::build(rng, &spec);
            let kind = QKind::random(rng);
            let q = HostQuery::random(rng, kind, p.tokens(), p.heads);
            (p, q)
        })
        .collect()
}

/// Sparse f16 problems of one shape (64 tokens, 16 heads, top-2048 of 32,768 slots).
fn sparse_problems(rng: &mut Rng) -> Vec<(SparseSetup<f16>, HostQuery<f16>)> {
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    (0..CALLS)
        .map(|_| {
            let mut p = random_sparse::<f16>(rng, 64, 16, 2048, 512, 64, style, false);
            p.scale = 1.0 / 16.0;
            let kind = QKind::random(rng);
            let q = HostQuery::random(rng, kind, p.tokens, p.heads);
            (p, q)
        })
        .collect()
}

/// The queries of `problems`.
fn queries<P, T: Clone>(problems: &[(P, HostQuery<T>)]) -> Vec<HostQuery<T>> {
    problems.iter().map(|(_, q)| q.clone()).collect()
}

/// Two streams of one context, a dense plan on one and a sparse plan on the other, their
/// launches interleaved: each stream's results are bitwise those of its calls run alone.
#[test]
#[ignore = "needs a GPU"]
fn two_streams_interleaved_match_alone() {
    let (ctx, _) = gpu();
    let mut rng = rng_for("two_streams_interleaved_match_alone");
    let dense = dense_problems(&mut rng);
    let sparse = sparse_problems(&mut rng);
    let mut a = Lane::new(ctx.new_stream().unwrap(), &dense, rng.next_u64());
    let mut b = Lane::new(ctx.new_stream().unwrap(), &sparse, rng.next_u64());

    let alone_a = a.run_alone();
    a.check_reference("dense alone", &a.read(), &mut rng, &queries(&dense));
    let alone_b = b.run_alone();
    b.check_reference("sparse alone", &b.read(), &mut rng, &queries(&sparse));

    for round in 0..ROUNDS {
        a.reset();
        b.reset();
        for i in 0..CALLS {
            // Alternate which stream goes first.
            if (i + round) % 2 == 0 {
                a.enqueue(i);
                b.enqueue(i);
            } else {
                b.enqueue(i);
                a.enqueue(i);
            }
        }
        let got_a: Vec<Bits> = a.read().iter().map(|o| o.logical_bits()).collect();
        let got_b: Vec<Bits> = b.read().iter().map(|o| o.logical_bits()).collect();
        for i in 0..CALLS {
            assert!(
                got_a[i] == alone_a[i],
                "round {round}: dense call {i} differs from its run alone"
            );
            assert!(
                got_b[i] == alone_b[i],
                "round {round}: sparse call {i} differs from its run alone"
            );
        }
    }
}

/// Runs `problems` `ROUNDS` times on a new stream of `ctx` in a thread of `scope`, after
/// `start`; returns each round's bits.
fn spawn_lane<'s, P>(
    scope: &'s std::thread::Scope<'s, '_>,
    ctx: &'s Arc<CudaContext>,
    problems: &'s [(P, HostQuery<P::Elem>)],
    seed: u64,
    start: &'s Barrier,
) -> std::thread::ScopedJoinHandle<'s, Vec<Vec<Bits>>>
where
    P: Problem + Clone + Sync,
    P::Elem: Sync,
{
    scope.spawn(move || {
        let mut lane = Lane::new(ctx.new_stream().unwrap(), problems, seed);
        start.wait();
        (0..ROUNDS).map(|_| lane.run_alone()).collect()
    })
}

/// Two host threads, each driving its own stream and plan (dense and sparse) at once: each
/// thread's results are bitwise those of the same calls run alone.
#[test]
#[ignore = "needs a GPU"]
fn two_threads_own_streams_match_alone() {
    let (ctx, _) = gpu();
    let mut rng = rng_for("two_threads_own_streams_match_alone");
    let dense = dense_problems(&mut rng);
    let sparse = sparse_problems(&mut rng);
    let (seed_a, seed_b) = (rng.next_u64(), rng.next_u64());
    let mut a = Lane::new(ctx.new_stream().unwrap(), &dense, seed_a);
    let alone_a = a.run_alone();
    a.check_reference("dense alone", &a.read(), &mut rng, &queries(&dense));
    let mut b = Lane::new(ctx.new_stream().unwrap(), &sparse, seed_b);
    let alone_b = b.run_alone();
    b.check_reference("sparse alone", &b.read(), &mut rng, &queries(&sparse));
    drop((a, b));

    let start = Barrier::new(2);
    let (got_a, got_b) = std::thread::scope(|scope| {
        let ha = spawn_lane(scope, &ctx, &dense, seed_a, &start);
        let hb = spawn_lane(scope, &ctx, &sparse, seed_b, &start);
        (ha.join().unwrap(), hb.join().unwrap())
    });
    for round in 0..ROUNDS {
        for i in 0..CALLS {
            assert!(
                got_a[round][i] == alone_a[i],
                "round {round}: dense call {i} (thread A) differs from alone"
            );
            assert!(
                got_b[round][i] == alone_b[i],
                "round {round}: sparse call {i} (thread B) differs from alone"
            );
        }
    }
}

/// Two GPUs, one thread each, dense on one and sparse on the other, then swapped: each
/// device's results are bitwise those of the same calls run there alone; a plan made on one
/// device is refused on the other's stream. On a machine with one GPU it prints `SKIPPED`
/// (to stderr, which libtest does not capture) and passes.
#[test]
#[ignore = "needs a GPU"]
fn two_gpus_match_alone() {
    let _ = gpu(); // fails plainly without any GPU
    let count = CudaContext::device_count().unwrap();
    if count < 2 {
        let _ = writeln!(
            std::io::stderr(),
            "\nSKIPPED concurrency::two_gpus_match_alone: skipped: one GPU ({count} device), \
             nothing was tested"
        );
        return;
    }
    let mut rng = rng_for("two_gpus_match_alone");
    let ctxs = [CudaContext::new(0).unwrap(), CudaContext::new(1).unwrap()];
    for ctx in &ctxs {
        // SAFETY: every buffer lives on the one stream of its lane. (With tracking on, the
        // refused cross-device call below would record a buffer's event on a stream of the
        // other context.)
        unsafe { ctx.disable_event_tracking() };
    }
    let dense = dense_problems(&mut rng);
    let sparse = sparse_problems(&mut rng);
    let seeds = (rng.next_u64(), rng.next_u64());
    for (d, s) in [(0, 1), (1, 0)] {
        let (cd, cs) = (&ctxs[d], &ctxs[s]);
        let mut a = Lane::new(cd.new_stream().unwrap(), &dense, seeds.0);
        let alone_a = a.run_alone();
        a.check_reference(
            &format!("dense alone on GPU {d}"),
            &a.read(),
            &mut rng,
            &queries(&dense),
        );
        let mut b = Lane::new(cs.new_stream().unwrap(), &sparse, seeds.1);
        let alone_b = b.run_alone();
        b.check_reference(
            &format!("sparse alone on GPU {s}"),
            &b.read(),
            &mut rng,
            &queries(&sparse),
        );

        // A plan of one device used on the other's stream: refused, naming the plan.
        let other = cs.new_stream().unwrap();
        let c = &mut a.calls[0];
        let wrong = c
            .problem
            .decode(&other, &c.dev, &mut a.plan, &c.qd, &mut c.out, None, None);
        assert!(
            matches!(&wrong, Err(Error::InvalidArgument { arg: "plan", .. })),
            "a GPU {d} plan on GPU {s}'s stream: {wrong:?}"
        );
        assert!(matches!(a.plan.kind(), PlanKind::Dense(_)));
        drop((a, b));

        let start = Barrier::new(2);
        let (got_a, got_b) = std::thread::scope(|scope| {
            let ha = spawn_lane(scope, cd, &dense, seeds.0, &start);
            let hb = spawn_lane(scope, cs, &sparse, seeds.1, &start);
            (ha.join().unwrap(), hb.join().unwrap())
        });
        for round in 0..ROUNDS {
            for i in 0..CALLS {
                assert!(
                    got_a[round][i] == alone_a[i],
                    "GPU {d} round {round}: dense call {i} differs from alone"
                );
                assert!(
                    got_b[round][i] == alone_b[i],
                    "GPU {s} round {round}: sparse call {i} differs from alone"
                );
            }
        }
    }
}
