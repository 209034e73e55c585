//! The decode benchmark (`harness = false`).
//!
//! ```text
//! cargo bench --bench decode -- [--json PATH] [--filter SUBSTR] [--case SPEC]... [--check]
//!     [--sm120-occupancy on|off|both] [--iters N] [--no-graph] [--flush rotate|memset]
//!     [--list]
//! ```
//! Measures the device's copy bandwidth, then every case (docs/DESIGN.md, "Performance model and
//! how it is measured"): the median of `--iters` CUDA-event timings after warm-up, inputs
//! out of L2 (the KV cache rotated over copies spanning ≥ 4× L2, or a memset flush before
//! each run: `common::gpu::FlushMode`), random inputs; a dense or sparse step is one decode
//! call (decode + combine; the split is derived from the lengths inside the call), the gather
//! and the append have their own rows; small cases also report CUDA-graph replay. See `USAGE`
//! for the details.

mod common;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use common::gpu::{cold_l2_for, FlushMode, ROTATE_L2_FACTOR, ROTATE_MAX_BYTES, ROTATE_MAX_COPIES};
use common::report::{self, row_name, Row, Table};
use common::spec::{self, CaseSpec};
use common::{flag_value, parse_count, Gpu, MeasureOpts, Res, BENCH_SEED};

const USAGE: &str = "\
usage: cargo bench --bench decode -- [OPTIONS]

  --case SPEC                 a case to run instead of the default grid (repeatable):
                                dense:b=64,q=1,h=8,l=4096,bs=64,dtype=bf16
                                  (b, h, l required; q=1, bs=64, dtype=bf16 by default)
                                dense:h=8,lens=LENS[,b=N][,l=L][,seed=S]
                                  (mixed lengths: LENS is uniform:LO-HI, each length
                                  drawn in LO..=HI from seed S (default 0; b required),
                                  or A*N+B*M+..., N requests of A tokens, then M of B;
                                  b must equal the count when given; the longest length,
                                  or l, sizes the block table; every length >= q;
                                  long=N with b, l: the same as lens=N*1+l*(b-1))
                                sparse:t=128,h=8,k=2048,dtype=bf16[,pool=65536][,bs=64]
                                  (t, h required; slot ids drawn without repeats per
                                  token from `pool` cache slots)
                                sparse:t=64,h=8,klen=uniform:LO-HI[,k=K][,seed=S]
                                  (per-row topk_len drawn in LO..=HI; k defaults to HI
                                  and must be >= HI; A*N+... runs work too)
                                dense/sparse ...,kv=fp8_ds_mla|fp8_ds_mla_pow2|fp8
                                  (the cache format: fp8_ds_mla with raw (vLLM) or pow2
                                  (FlashMLA) scales, per-tensor fp8; default the query's
                                  dtype; the JSON names it in kv_format and scale_rule)
                                gather:t=128,k=2048[,l=65536][,bs=64]
                                  (the index gather alone)
                                append:t=128[,kv=KV][,dtype=bf16][,bs=64][,pool=P]
                                  (append_kv alone: t new rows of dtype to t distinct
                                  random slots of a cache of P slots, default
                                  max(65536, t), P >= t; kv as above, default the
                                  dtype's own; --check compares the written rows
                                  byte for byte with the reference quantizer)
  --filter SUBSTR             keep the rows whose name contains SUBSTR
  --sm120-occupancy on|off|both
                              run plans padded to sm_120's occupancy (rows named
                              `... [sm120-occ]`), unpadded, or both (default both)
  --check                     compare outputs and lse with the f64 reference (sampled:
                              up to 8 requests/tokens and 16 heads per case); exit 1
                              when relerr > 1e-2 (bf16) / 2e-3 (f16) or lse_err > 1e-3
  --iters N                   timed runs per row (default 100), after 5 warm-up runs
  --no-graph                  skip the CUDA-graph replay timing
  --flush rotate|memset       how the runs keep the inputs out of L2 (default rotate):
                                rotate: each case holds R identical copies of its KV
                                  cache (the sparse slot pool) and run i reads copy
                                  i mod R, R = ceil(4 x L2 / bytes of the cache rows one
                                  step reads) + 1, no flush; a case that would need more
                                  than 256 copies or 8 GiB of them, the gather (no
                                  cache) and the append (which writes its cache) get
                                  the memset (the L2 column says which)
                                memset: a memset of max(2 x L2, 256 MiB) before each run,
                                  outside the events (Triton's do_bench; it leaves L2
                                  dirty, which costs large cases a few µs of write-back)
  --json PATH                 also write the results as JSON
  --list                      print the rows that would run, and exit
  --bench                     (passed by cargo; ignored)

Times are medians of CUDA-event timings, inputs kept out of L2 as --flush says (the JSON
names the mode in \"l2\", and each row's own \"l2\" and \"copies\"; the table's L2 column:
\"rot R\" or \"memset\"). GB/s counts the cache rows the step reads (the sum of the lengths;
sparse: of the topk_len) x the format's row bytes (1152; fp8_ds_mla 656, fp8 576) + q + out (+ ids read x 4 and topk_len for sparse);
the append's: rows read (576 x 2 bytes) + slot ids (8) + rows written (the row bytes); % copy
compares it with a 1 GiB device-to-device copy; TFLOP/s counts 2 x (576 + 512) per (query
row, head, cache row it sees: causal, row i of q rows sees L - q + 1 + i). The JSON's
\"lens\" spells the lengths: L*B, uniform:LO-HI or A*N+B*M.
A step is one decode call (decode + combine; the split is derived from seq_lens inside
the call, so every layer of a decode step costs the same).
Cases under 64 MB also report the replay time of the step captured in a CUDA graph.";

const WARMUP: usize = 5;

#[derive(Debug)]
struct Args {
    json: Option<PathBuf>,
    filter: Option<String>,
    cases: Vec<CaseSpec>,
    check: bool,
    /// The sm120_occupancy values to run.
    occupancy: Vec<bool>,
    iters: usize,
    graph: bool,
    flush: FlushMode,
    list: bool,
}

/// `Ok(None)`: `--help` was asked for.
fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut args = Args {
        json: None,
        filter: None,
        cases: Vec::new(),
        check: false,
        occupancy: vec![false, true],
        iters: 100,
        graph: true,
        flush: FlushMode::default(),
        list: false,
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--bench" => {}
            "--help" | "-h" => return Ok(None),
            "--json" => args.json = Some(flag_value(&mut it, &arg)?.into()),
            "--filter" => args.filter = Some(flag_value(&mut it, &arg)?),
            "--case" => args
                .cases
                .push(CaseSpec::parse(&flag_value(&mut it, &arg)?)?),
            "--check" => args.check = true,
            "--no-graph" => args.graph = false,
            "--list" => args.list = true,
            "--iters" => args.iters = parse_count(&flag_value(&mut it, &arg)?, &arg)?,
            "--flush" => args.flush = FlushMode::parse(&flag_value(&mut it, &arg)?)?,
            "--sm120-occupancy" => {
                args.occupancy = match flag_value(&mut it, &arg)?.as_str() {
                    "on" => vec![true],
                    "off" => vec![false],
                    "both" => vec![false, true],
                    other => return Err(format!("{arg}: expected on, off or both, got `{other}`")),
                }
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if args.cases.is_empty() {
        args.cases = spec::default_cases();
    }
    Ok(Some(args))
}

/// A case and the sm120_occupancy values to run it with (those whose rows pass the filter).
struct Planned {
    spec: CaseSpec,
    modes: Vec<bool>,
}

impl Planned {
    fn row_names(&self) -> impl Iterator<Item = String> + '_ {
        self.modes.iter().map(|&m| row_name(&self.spec.name(), m))
    }
}

fn plan_rows(args: &Args) -> Vec<Planned> {
    args.cases
        .iter()
        .map(|spec| {
            let modes: &[bool] = if spec.uses_plan() {
                &args.occupancy
            } else {
                &[false]
            };
            let modes = modes
                .iter()
                .copied()
                .filter(|&m| {
                    let name = row_name(&spec.name(), m);
                    args.filter
                        .as_ref()
                        .is_none_or(|f| name.contains(f.as_str()))
                })
                .collect();
            Planned {
                spec: spec.clone(),
                modes,
            }
        })
        .filter(|p| !p.modes.is_empty())
        .collect()
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("bench decode: {e} (--help for usage)");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("bench decode: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `Ok(false)` when a case failed or a check was out of tolerance.
fn run(args: &Args) -> Res<bool> {
    let planned = plan_rows(args);
    let names: Vec<String> = planned.iter().flat_map(|p| p.row_names()).collect();
    if args.list {
        names.iter().for_each(|n| println!("{n}"));
        return Ok(true);
    }
    if names.is_empty() {
        println!("bench decode: no case matches the filter");
        return Ok(false);
    }
    let mut gpu = match Gpu::open()? {
        Ok(gpu) => gpu,
        Err(why) => {
            println!("bench decode: {why}: no CUDA GPU here, nothing measured (skipped)");
            return Ok(true);
        }
    };
    gpu.flush_mode = args.flush;
    let started = Instant::now();
    let copy_gbps = gpu.copy_bandwidth_gbps()?;
    let device_line = format!(
        "device: {}, copy bandwidth: {copy_gbps:.0} GB/s",
        gpu.describe()
    );
    println!("{device_line}");
    println!(
        "median of {} runs after {WARMUP} warm-up runs; {}",
        args.iters,
        cold_l2_line(&gpu)
    );
    let table = Table::new(names, args.check);
    println!("{}", table.header());

    let opts = MeasureOpts {
        warmup: WARMUP,
        iters: args.iters,
        graph: args.graph,
    };
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for p in &planned {
        if let Err(e) = run_case(&mut gpu, p, args.check, &opts, copy_gbps, &table, &mut rows) {
            println!("{}: FAILED: {e}", p.spec);
            failures.push(format!("{}: {e}", p.spec));
        }
    }
    if let Some(path) = &args.json {
        report::write_json(path, &gpu.info, copy_gbps, args.flush, &rows)?;
    }
    print_summary(&device_line, &table, &rows, &failures, args, started);
    Ok(failures.is_empty() && rows.iter().all(Row::passed))
}

/// Measures one case in each of its modes, printing and appending each row as it is done.
fn run_case(
    gpu: &mut Gpu,
    p: &Planned,
    check: bool,
    opts: &MeasureOpts,
    copy_gbps: f64,
    table: &Table,
    rows: &mut Vec<Row>,
) -> Res<()> {
    let mut w = common::build(&gpu.stream, &p.spec, BENCH_SEED)?;
    for &sm120_occupancy in &p.modes {
        w.set_options(&gpu.stream, common::gpu::plan_options(sm120_occupancy)?)?;
        let timing = common::measure(gpu, w.as_mut(), opts)?;
        let accuracy = if check {
            Some(w.check(&gpu.stream)?)
        } else {
            None
        };
        let row = Row {
            meta: w.meta().clone(),
            sm120_occupancy,
            us: timing.us,
            graph_us: timing.graph_us,
            accuracy,
            copy_gbps,
        };
        println!("{}", table.line(&row));
        if let Some(e) = timing.graph_error {
            println!("  (no graph time: {e})");
        }
        // the gather and the append have no cache to rotate: the memset is their rule
        if gpu.flush_mode == FlushMode::Rotate && w.cache_bytes().is_some() {
            if let Err(why) = cold_l2_for(gpu, w.as_ref()) {
                println!("  (memset flush instead: {why})");
            }
        }
        rows.push(row);
    }
    Ok(())
}

/// How the runs keep the inputs out of L2, for the header.
fn cold_l2_line(gpu: &Gpu) -> String {
    let memset = format!("{} MiB memset", gpu.flush_bytes() >> 20);
    match gpu.flush_mode {
        FlushMode::Memset => format!("L2 flushed ({memset}) before each"),
        FlushMode::Rotate => format!(
            "cold L2: KV cache rotated over R copies per case (R x cache rows read >= \
             {ROTATE_L2_FACTOR}x the {} MiB L2); the gather, the append, and cases that would \
             need more than {ROTATE_MAX_COPIES} copies or {} GiB of them: a {memset} before each",
            gpu.info.l2_cache_bytes >> 20,
            ROTATE_MAX_BYTES >> 30
        ),
    }
}

fn print_summary(
    device_line: &str,
    table: &Table,
    rows: &[Row],
    failures: &[String],
    args: &Args,
    started: Instant,
) {
    println!(
        "\n==== summary ({:.0} s) ====",
        started.elapsed().as_secs_f64()
    );
    println!("{device_line}");
    table.print(rows);
    for f in failures {
        println!("FAILED {f}");
    }
    if args.check {
        let bad = rows.iter().filter(|r| !r.passed()).count();
        match bad {
            0 => println!("check: all {} rows within tolerance", rows.len()),
            n => println!("check: {n} of {} rows OUT OF TOLERANCE", rows.len()),
        }
    }
    if let Some(path) = &args.json {
        println!("json: {}", path.display());
    }
}
