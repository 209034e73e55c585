//! Runs one benchmark case N times and nothing else, for Nsight Compute / Nsight Systems.
//!
//! ```text
//! cargo build --release --example profile
//! ncu --clock-control none --set full -k regex:decode_kernel -c 1 -o mla \
//!     target/release/examples/profile --case sparse:t=128,h=8,k=2048,dtype=bf16
//! ```
//! The case grammar is the bench's (`benches/common/spec.rs`), and so is the setup: the
//! same random inputs, the same way of keeping them out of L2 (`--flush`).
//!
//! No NVTX ranges: cudarc's `nvtx` feature is not enabled in this crate's Cargo.toml, so
//! select kernels with ncu's `-k regex:decode_kernel` (or `combine_kernel`, `gather_kernel`)
//! or `--launch-skip N --launch-count M`. The timed runs are bracketed by cuProfilerStart/Stop,
//! so `ncu --profile-from-start off` and
//! `nsys profile --capture-range=cudaProfilerApi` skip the setup and the warm-up.

#[path = "../benches/common/mod.rs"]
mod common;

use std::process::ExitCode;

use common::gpu::{median, set_up_cold_l2, FlushMode, TimeOpts};
use common::report::row_name;
use common::spec::CaseSpec;
use common::{flag_value, parse_count, Gpu, Res, BENCH_SEED};
use mla_decode::cudarc::driver::{profiler_start, profiler_stop};

const USAGE: &str = "\
usage: profile --case SPEC [--iters N] [--warmup N] [--sm120-occupancy]
               [--flush rotate|memset]

  --case SPEC          one case, as the bench spells it:
                         dense:b=64,q=1,h=8,l=4096,bs=64,dtype=bf16
                         sparse:t=128,h=8,k=2048,dtype=bf16[,pool=65536][,bs=64]
                         gather:t=128,k=2048[,l=65536][,bs=64]
  --iters N            timed runs (default 20), between cuProfilerStart and cuProfilerStop
  --warmup N           untimed runs before them (default 1)
  --sm120-occupancy    pad the plan to sm_120's occupancy (what ships for sm_120)
  --flush rotate|memset
                       as the bench: rotate the KV cache over copies spanning >= 4x L2
                       (default; the gather gets the memset), or a memset of
                       max(2 x L2, 256 MiB) before each run

Each run is one step as the bench times it (one decode call: decode + combine; the gather
alone for gather cases), inputs out of L2 as --flush says. Prints the schedule and the
median. (ncu flushes the caches before each profiled kernel itself, unless
--cache-control none.)

Nsight Compute, one decode kernel launch with the GPU's own clocks:
  cargo build --release --example profile
  ncu --clock-control none --set full -k regex:decode_kernel -c 1 -o mla \\
      target/release/examples/profile --case sparse:t=128,h=8,k=2048,dtype=bf16
Other kernels: -k regex:combine_kernel, gather_kernel; or --launch-skip N
--launch-count M. Only the timed runs: add --profile-from-start off.
Nsight Systems: nsys profile --capture-range=cudaProfilerApi target/release/examples/profile ...";

struct Args {
    case: CaseSpec,
    iters: usize,
    warmup: usize,
    sm120_occupancy: bool,
    flush: FlushMode,
}

/// `Ok(None)`: `--help` was asked for.
fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let (mut case, mut iters, mut warmup, mut sm120_occupancy) = (None, 20, 1, false);
    let mut flush = FlushMode::default();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--help" | "-h" => return Ok(None),
            "--case" => case = Some(CaseSpec::parse(&flag_value(&mut it, &arg)?)?),
            "--iters" => iters = parse_count(&flag_value(&mut it, &arg)?, &arg)?,
            "--warmup" => {
                let v = flag_value(&mut it, &arg)?;
                warmup = v
                    .parse()
                    .map_err(|_| format!("{arg}: expected a count, got `{v}`"))?;
            }
            "--sm120-occupancy" => sm120_occupancy = true,
            "--flush" => flush = FlushMode::parse(&flag_value(&mut it, &arg)?)?,
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    let case = case.ok_or("--case is required")?;
    Ok(Some(Args {
        case,
        iters,
        warmup,
        sm120_occupancy,
        flush,
    }))
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("profile: {e} (--help for usage)");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("profile: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Res<()> {
    let mut gpu = match Gpu::open()? {
        Ok(gpu) => gpu,
        Err(why) => {
            println!("profile: {why}: no CUDA GPU here, nothing to profile");
            return Ok(());
        }
    };
    gpu.flush_mode = args.flush;
    let mut w = common::build(&gpu.stream, &args.case, BENCH_SEED)?;
    let options = common::gpu::plan_options(args.sm120_occupancy)?;
    w.set_options(&gpu.stream, options)?;
    println!("device: {}", gpu.describe());
    println!(
        "case:   {}",
        row_name(
            &w.meta().name,
            args.sm120_occupancy && args.case.uses_plan()
        )
    );
    if let Some(s) = w.schedule() {
        println!(
            "plan:   grid {} m-tiles x {} parts, {} warps x {} query rows{}, {} B dynamic shared \
             memory, {} CTAs/SM, {} SMs, PDL {}",
            s.num_m_tiles,
            s.num_parts,
            s.internal.warps,
            s.internal.block_m,
            if s.internal.form == mla_decode::ffi::MLA_FORM_TRANSPOSED as i32 {
                " (transposed)"
            } else {
                ""
            },
            s.smem_bytes,
            s.ctas_per_sm,
            s.sm_count,
            if s.internal.pdl != 0 { "on" } else { "off" }
        );
    }
    let flush = set_up_cold_l2(&gpu, w.as_mut())?;
    match w.meta().copies {
        Some(r) => println!("l2:     KV cache rotated over {r} copies"),
        None => println!(
            "l2:     {} MiB memset before each run",
            gpu.flush_bytes() >> 20
        ),
    }

    // run i reads copy i of the cache (mod the copies); the timed runs continue the
    // warm-up's rotation
    let warmup = TimeOpts {
        warmup: args.warmup,
        iters: 0,
        flush,
    };
    gpu.time(warmup, |s, i| {
        w.select_copy(i);
        Ok(w.step(s)?)
    })?;
    let timed = TimeOpts {
        warmup: 0,
        iters: args.iters,
        flush,
    };
    profiler_start()?;
    let us = gpu.time(timed, |s, i| {
        w.select_copy(args.warmup + i);
        Ok(w.step(s)?)
    });
    profiler_stop()?;
    let us = us?;
    w.check_flag(&gpu.stream)?;

    let med = median(&us);
    let meta = w.meta();
    print!(
        "time:   median {med:.2} µs over {} runs (min {:.2}, max {:.2}), {:.0} GB/s",
        us.len(),
        us[0],
        us[us.len() - 1],
        meta.bytes / med / 1e3
    );
    if meta.flop > 0.0 {
        print!(", {:.2} TFLOP/s", meta.flop / med / 1e6);
    }
    println!();
    Ok(())
}
