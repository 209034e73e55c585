//! # An engine's decode step, end to end
//!
//! ```text
//! cargo run --release --example engine_step -- [--layers 8] [--requests 16] [--steps 64]
//!     [--check-every 16] [--kv bf16|fp8_ds_mla|fp8] [--dense] [--lens 100-8192]
//!     [--gen 16-512] [--seed 1] [--soak REPLAYS] [--watchdog 60]
//! ```
//!
//! A GLM-5-shaped slice of a model on one GPU of a TP8 deployment
//! (`MlaConfig::glm5().tensor_parallel(8)`: 8 heads, softmax scale 1/16, bf16 queries):
//! `--layers` layers, each with its own paged KV cache (blocks of 64 rows), serving
//! `--requests` requests with continuous batching. Prompt lengths are drawn from `--lens`
//! (seeded); each request generates `--gen` tokens (16 to 512), then leaves, and a new
//! request takes its batch row (its prompt is prefilled into every layer's cache by `append_kv`). Every
//! decode step does, for every layer, what the attention backend of a DSA model
//! (DeepSeek-V3.2, GLM-5) does:
//!
//! 1. `append_kv_split`: the new token's 576-wide row into the layer's cache, from its latent
//!    and RoPE parts (`kv_c`, `k_pe`), through the slot mapping (the slot the block allocator
//!    gave each request's next position);
//! 2. `gather_slots`: the indexer's top-2048 request-logical positions (fewer for shorter
//!    requests, `topk_len`) to global slot ids of that cache;
//! 3. `sparse_decode` over those slot ids: GLM-5's attention;
//! 4. with `--dense`, also `dense_decode` over every cached position, into outputs of its
//!    own: what a dense MLA model (DeepSeek-V3) runs instead, here so that one step covers
//!    the whole API.
//!
//! **The whole step (every layer) is captured once as a CUDA graph** (`capture_graph`), over
//! buffers allocated for the largest step, and replayed every step. Before each replay the
//! host writes that step's inputs into the captured buffers with stream-ordered copies:
//! block table, lengths, slot mapping, `topk_len`, positions, new rows and queries. Nothing
//! is allocated and nothing is captured again; the flag is reset inside the graph and read
//! after each replay without blocking (`ErrorFlag::read_async_into`).
//!
//! Step 0 runs the same calls directly (the warm-up every graph needs: first launches
//! outside a capture) and is checked; then every `--check-every` replays (and after the last)
//! a sample of layers, requests and heads is checked against the f64 reference
//! (`mla_decode::reference`): the appended row's bytes, the gathered slot ids (exact), the
//! sparse and dense outputs and lse. The device's free memory must not shrink after the
//! first replay, and a watchdog thread aborts the run if a replay, copy or synchronize does
//! not return within `--watchdog` seconds.
//!
//! It prints the GPU time of a replay (CUDA events; per step and per layer), decode tokens
//! per second (on the GPU, and end to end with the host's work and the prefills), the flag
//! state and the check results, and exits non-zero if anything failed.
//!
//! `--soak N` replays N steps (checks every 1,000 unless `--check-every` says otherwise): the
//! graph-replay soak of docs/DEVELOPING.md, e.g. `--soak 24000 --layers 2 --dense --gen
//! 500-3000` (requests that live longer: fewer prefills made up on the host).
//!
//! `--kv` picks the cache format: `bf16`, or an fp8 format (`fp8_ds_mla`: 656-byte rows with
//! per-128 scales; `fp8`: e4m3 with a per-tensor scale), which `append_kv` quantizes into
//! and decode reads; the checks expect the quantized bytes and the dequantized values.
//!
//! Without a GPU it prints "no GPU" and exits 0.

mod batch;
// The tests' and the bench's one random generator (SplitMix64; seeded, so every run is the same).
mod check;
mod engine;
#[path = "../../tests/kit/rng.rs"]
#[allow(dead_code)]
mod rng;
mod watch;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use mla_decode::cudarc::driver::CudaContext;
use mla_decode::{capture_graph, cuda_available, DeviceInfo, FlagReading, KvFormat, MlaConfig};

use batch::{Batch, Rng, BLOCK_SIZE, GEN_TOKENS, TOPK};
use check::Report;
use engine::{Engine, Shape};
use watch::{free_memory, ReplayTimer, Watchdog};

/// How much the device's free memory may shrink after the first replay (room for the
/// driver's own bookkeeping; a leak per replay would exceed it within a few hundred).
const MEMORY_SLACK: usize = 8 << 20;

/// Command-line options.
#[derive(Clone, Debug)]
struct Options {
    layers: usize,
    requests: usize,
    steps: usize,
    soak: Option<usize>,
    check_every: Option<usize>,
    kv: KvFormat,
    dense: bool,
    lens: (usize, usize),
    gen: (usize, usize),
    seed: u64,
    watchdog_s: u64,
}

const USAGE: &str = "usage: engine_step [--layers N] [--requests N] [--steps N] [--check-every N]
       [--kv bf16|fp8_ds_mla|fp8] [--dense] [--lens LO-HI] [--gen LO-HI] [--seed N]
       [--soak REPLAYS] [--watchdog SECONDS]
defaults: 8 layers, 16 requests, 64 steps, a check every 16 steps (1000 with --soak),
          bf16 cache, sparse decode only, prompts of 100-8192 tokens, 16-512 generated
          tokens per request, seed 1, watchdog 60 s";

impl Options {
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Options, String> {
        let mut o = Options {
            layers: 8,
            requests: 16,
            steps: 64,
            soak: None,
            check_every: None,
            kv: KvFormat::Bf16,
            dense: false,
            lens: (100, 8192),
            gen: GEN_TOKENS,
            seed: 1,
            watchdog_s: 60,
        };
        while let Some(arg) = args.next() {
            let mut value = || args.next().ok_or(format!("{arg}: missing value"));
            let number = |v: String| {
                v.parse::<usize>()
                    .map_err(|_| format!("{arg}: `{v}` is not a count"))
            };
            match arg.as_str() {
                "--layers" => o.layers = number(value()?)?,
                "--requests" => o.requests = number(value()?)?,
                "--steps" => o.steps = number(value()?)?,
                "--soak" => o.soak = Some(number(value()?)?),
                "--check-every" => o.check_every = Some(number(value()?)?),
                "--seed" => o.seed = number(value()?)? as u64,
                "--watchdog" => o.watchdog_s = number(value()?)? as u64,
                "--dense" => o.dense = true,
                "--kv" => {
                    o.kv = match value()?.as_str() {
                        "bf16" => KvFormat::Bf16,
                        "fp8_ds_mla" => KvFormat::Fp8DsMla,
                        "fp8" | "fp8_per_tensor" => KvFormat::Fp8PerTensor,
                        other => return Err(format!("--kv {other}: want bf16, fp8_ds_mla or fp8")),
                    }
                }
                "--lens" | "--gen" => {
                    let v = value()?;
                    let (lo, hi) = v.split_once('-').ok_or(format!("{arg} {v}: want LO-HI"))?;
                    let range = (number(lo.to_string())?, number(hi.to_string())?);
                    if range.0 == 0 || range.0 > range.1 {
                        return Err(format!("{arg} {v}: want 1 <= LO <= HI"));
                    }
                    if arg == "--lens" {
                        o.lens = range;
                    } else {
                        o.gen = range;
                    }
                }
                "-h" | "--help" => return Err(String::new()),
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        if o.layers == 0 || o.requests == 0 || o.watchdog_s == 0 || o.check_every == Some(0) {
            return Err("--layers, --requests, --watchdog and --check-every must be > 0".into());
        }
        if o.lens.0 == 0 || o.lens.0 > o.lens.1 {
            return Err(format!(
                "--lens {}-{}: want 1 <= LO <= HI",
                o.lens.0, o.lens.1
            ));
        }
        Ok(o)
    }

    /// Replays after the warm-up step.
    fn replays(&self) -> usize {
        self.soak.unwrap_or(self.steps)
    }

    fn check_every(&self) -> usize {
        self.check_every
            .unwrap_or(if self.soak.is_some() { 1000 } else { 16 })
    }
}

fn main() -> ExitCode {
    let opts = match Options::parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("engine_step: {e}");
            }
            eprintln!("{USAGE}");
            return if e.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            };
        }
    };
    // cudarc panics without the driver library: ask first.
    if !cuda_available() {
        println!("engine_step: no GPU (no CUDA driver or device here): nothing to run.");
        return ExitCode::SUCCESS;
    }
    match run(&opts) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("engine_step: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Everything: `Ok(false)` when a check, the flag or the memory watch failed.
fn run(opts: &Options) -> Result<bool, Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    // SAFETY: everything below runs on one stream, so cudarc's per-buffer events order
    // nothing, and they would break the capture. Off before the first allocation.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let info = DeviceInfo::query(&ctx)?;
    let cfg = MlaConfig::glm5().tensor_parallel(8)?;
    let mut batch = Batch::new(opts.requests, opts.layers, opts.lens, opts.gen, opts.seed);
    let shape = Shape {
        layers: opts.layers,
        requests: opts.requests,
        heads: cfg.num_heads,
        max_blocks: batch.max_blocks,
        num_blocks: batch.num_blocks,
        max_prompt: opts.lens.1,
        format: opts.kv,
        dense: opts.dense,
        scale: cfg.softmax_scale(),
        seed: opts.seed,
    };
    println!(
        "device: {} ({}, {} SMs)",
        info.name,
        info.sm_name(),
        info.sm_count
    );
    println!(
        "model: GLM-5 at TP8: {} heads per GPU, softmax scale {}, {} layers, {} cache in blocks of {BLOCK_SIZE}",
        shape.heads, shape.scale, shape.layers, shape.format
    );
    println!(
        "batch: {} requests, prompts of {}..={} tokens, {}..={} generated each; per layer and step: \
         append + gather + top-{TOPK} sparse decode{}",
        opts.requests,
        opts.lens.0,
        opts.lens.1,
        opts.gen.0,
        opts.gen.1,
        if opts.dense { " + dense decode" } else { "" }
    );
    let mut engine = Engine::new(&stream, shape)?;
    let watchdog = Watchdog::start(Duration::from_secs(opts.watchdog_s));
    let mut rng = Rng::new(opts.seed ^ 0x5eed);

    // The first prompts, prefilled by append.
    let t0 = Instant::now();
    prefill(&mut engine, &batch, &watchdog, 0)?;
    engine.prefill_flag.check(&stream)?;
    let rows: usize = batch.requests.iter().map(|r| r.len).sum();
    println!(
        "prefill: {rows} rows into each layer's cache in {:.2} s",
        t0.elapsed().as_secs_f64()
    );

    // Step 0, launched directly: the warm-up before the capture, checked like any step.
    batch.begin_step();
    engine.upload_step(&batch, 0)?;
    engine.enqueue_step()?;
    engine.flag.check(&stream)?;
    let mut ok = true;
    let mut checks = Report::default();
    ok &= report_check(&engine, &batch, 0, &mut rng, &mut checks)?;
    println!(
        "step 0 (direct launches: the warm-up): flag clear, check {}",
        if ok { "ok" } else { "FAILED" }
    );

    // The capture: once (everything it touches exists already).
    // SAFETY: the engine owns every buffer the step uses and outlives `graph`.
    let graph = unsafe { capture_graph(&stream, || engine.enqueue_step())? };
    let mut timer = ReplayTimer::new(&stream, 4)?;
    let mut reading = FlagReading::new(&stream)?;
    let mut first_fault: Option<(usize, [u32; 4])> = None;
    let mut faults = 0usize;
    let mut memory_base: Option<usize> = None;
    let mut memory_now = 0usize;
    let (replays, every) = (opts.replays(), opts.check_every());
    let mut loop_time = Duration::ZERO;
    let mut prefills = 0usize;
    println!(
        "captured the step of {} layers in one CUDA graph; {replays} replays",
        opts.layers
    );

    for step in 1..=replays {
        let t = Instant::now();
        batch.begin_step();
        prefills += batch.admitted.len();
        prefill(&mut engine, &batch, &watchdog, step)?;
        engine.upload_step(&batch, step)?;
        // The previous replay's flag (its copy has landed: the uploads above waited for it).
        let words = reading.wait_words()?;
        if words[0] != 0 {
            faults += 1;
            first_fault.get_or_insert((step - 1, words));
        }
        timer.time(&stream, || Ok(graph.launch()?))?;
        engine.flag.read_async_into(&stream, &mut reading)?;
        loop_time += t.elapsed();
        watchdog.beat(step);
        if step == 1 {
            // After the first replay (whose launch uploads the graph): from here on the
            // device's free memory must stay put.
            stream.synchronize()?;
            memory_base = Some(free_memory(&stream)?);
        }

        if step % every == 0 || step == replays {
            stream.synchronize()?;
            let words = reading.wait_words()?;
            let flag = if words[0] == 0 {
                "clear".to_string()
            } else {
                format!("{words:?}")
            };
            let prefill_words = engine.prefill_flag.read(&stream)?;
            if prefill_words[0] != 0 {
                println!("  FAIL: a prefill's append recorded a fault: {prefill_words:?}");
                ok = false;
            }
            let checked = report_check(&engine, &batch, step, &mut rng, &mut checks)?;
            ok &= checked;
            memory_now = free_memory(&stream)?;
            let base = *memory_base.get_or_insert(memory_now);
            let grown = base.saturating_sub(memory_now);
            let (lo, hi) = batch.requests.iter().fold((usize::MAX, 0), |(lo, hi), r| {
                (lo.min(r.len), hi.max(r.len))
            });
            println!(
                "step {step}: check {}, flag {flag}; lengths {lo}..={hi}; {} requests finished so \
                 far; device memory taken since the first replay: {:.1} MiB",
                if checked { "ok" } else { "FAILED" },
                batch.finished,
                grown as f64 / (1 << 20) as f64
            );
            if grown > MEMORY_SLACK {
                println!("  FAIL: device memory grew by {grown} bytes during the replays");
                ok = false;
            }
            watchdog.beat(step);
        }
    }
    stream.synchronize()?;
    let words = reading.wait_words()?;
    if words[0] != 0 {
        faults += 1;
        first_fault.get_or_insert((replays, words));
    }
    timer.finish()?;
    drop(watchdog);

    println!();
    if let Some((median, mean, max)) = timer.summary_us() {
        let n = opts.requests as f64;
        println!(
            "graph replay (GPU time, {} replays): median {median:.1} µs per step (mean {mean:.1}, \
             max {max:.1}), {:.1} µs per layer per step",
            timer.times_ms.len(),
            median / opts.layers as f64
        );
        println!(
            "decode throughput: {:.0} tokens/s on the GPU ({} tokens per step / median replay); \
             {:.0} tokens/s end to end (host work, uploads and {prefills} prefills included, checks not)",
            n / (median * 1e-6),
            opts.requests,
            n * replays as f64 / loop_time.as_secs_f64()
        );
    }
    println!(
        "checks: {} (layer, request, head) samples: worst relative error sparse {:.2e}{}, lse {:.2e}; \
         appended rows and gathered slot ids exact{}",
        checks.samples,
        checks.worst_sparse,
        if opts.dense { format!(", dense {:.2e}", checks.worst_dense) } else { String::new() },
        checks.worst_lse,
        if checks.failures.is_empty() { "" } else { " (except the failures above)" }
    );
    match first_fault {
        None => println!("flag: clear after every step"),
        Some((step, w)) => {
            println!("flag: FAULT in {faults} step(s), first after step {step}: {w:?}");
            ok = false;
        }
    }
    if let Some(base) = memory_base {
        println!(
            "device memory: {:.1} MiB free after the first replay, {:.1} MiB at the last check",
            base as f64 / (1 << 20) as f64,
            memory_now as f64 / (1 << 20) as f64
        );
    }
    println!("{}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}

/// Prefills the prompts of the requests [`Batch::begin_step`] admitted.
fn prefill(
    engine: &mut Engine,
    batch: &Batch,
    watchdog: &Watchdog,
    step: usize,
) -> mla_decode::Result<()> {
    for &row in &batch.admitted {
        engine.prefill(batch, row)?;
        watchdog.beat(step);
    }
    Ok(())
}

/// Checks step `step` (synchronizes), prints what failed, adds it to `all`; false on failure.
fn report_check(
    engine: &Engine,
    batch: &Batch,
    step: usize,
    rng: &mut Rng,
    all: &mut Report,
) -> mla_decode::Result<bool> {
    engine.stream.synchronize()?;
    let r = check::check_step(engine, batch, step, rng)?;
    let ok = r.failures.is_empty();
    for f in r.failures.iter().take(10) {
        println!("  FAIL: {f}");
    }
    if r.failures.len() > 10 {
        println!("  ... and {} more", r.failures.len() - 10);
    }
    all.absorb(r);
    Ok(ok)
}
