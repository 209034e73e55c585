//! One GLM-5-shaped decode step on your GPU: `cargo run --release --example demo`.
//!
//! GLM-5 at tensor parallelism 8 (8 heads per GPU, softmax scale 1/16), bf16 cache in blocks
//! of 64 rows:
//! 1. dense paged decode of 16 requests whose lengths vary up to 8192;
//! 2. the DSA index gather: 2048 random logical positions per token (fewer, padded with
//!    -1, for requests shorter than that) turned into global slot ids of the same cache;
//! 3. sparse decode over those slot ids;
//! 4. steps 1 and 3 again over an fp8_ds_mla cache (656-byte rows: e4m3 latent with a scale
//!    per 128 values, bf16 RoPE; vLLM's raw scales), the format engines on sm_120 keep.
//!
//! Each result is checked against the f64 reference (`mla_decode::reference`, sampled rows),
//! then timed like the bench does (median of CUDA-event timings, L2 flushed before each run).
//! Without a GPU it says so and exits 0. The setup, timing and checks are the bench's
//! (`benches/common/`).

#[path = "../benches/common/mod.rs"]
mod common;

use std::process::ExitCode;
use std::sync::Arc;

use common::cases::{
    DenseCase, DenseSetup, GatherCase, GatherInputs, SparseCase, SparseSetup, Workload,
};
use common::report::{Row, Table};
use common::rng::Rng;
use common::spec::CacheKind;
use common::{Gpu, MeasureOpts, Res};
use mla_decode::cudarc::driver::CudaStream;
use mla_decode::half::bf16;
use mla_decode::{MlaConfig, PlanOptions, ScaleRule};

const BATCH: usize = 16;
const MAX_LEN: usize = 8192;
const TOPK: usize = 2048;
const BLOCK_SIZE: usize = 64;
const SEED: u64 = 5;

fn main() -> ExitCode {
    let mut gpu = match Gpu::open() {
        Ok(Ok(gpu)) => gpu,
        Ok(Err(why)) => {
            explain_without_gpu(&why);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("demo: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&mut gpu) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("demo: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn explain_without_gpu(why: &str) {
    println!("mla-decode demo: {why}: no CUDA GPU or driver here, so nothing runs.");
    println!();
    println!("On a machine with an NVIDIA GPU (sm_120 or sm_90 builds; sm_80+ with");
    println!("MLA_CUDA_ARCHS) and its driver, this demo runs one GLM-5-shaped decode step:");
    println!(
        "8 heads per GPU (TP8), softmax scale 1/16, bf16 cache in blocks of {BLOCK_SIZE} rows:"
    );
    println!("  1. dense paged decode of {BATCH} requests with lengths up to {MAX_LEN};");
    println!("  2. the DSA index gather of {TOPK} logical positions per token into cache slots;");
    println!("  3. sparse decode over those slots;");
    println!("  4. steps 1 and 3 over an fp8_ds_mla cache (e4m3 rows with per-tile scales);");
    println!("checks each against the f64 reference and prints a throughput table");
    println!("(µs, GB/s, % of the device's copy bandwidth).");
}

/// `Ok(false)` when a check is out of tolerance.
fn run(gpu: &mut Gpu) -> Res<bool> {
    let cfg = MlaConfig::glm5().tensor_parallel(8)?;
    cfg.check()?;
    let (heads, scale) = (cfg.num_heads, cfg.softmax_scale());
    println!("device: {}", gpu.describe());
    println!("GLM-5 at TP8: {heads} heads per GPU, rows of 576 (512 latent + 64 rope), softmax scale {scale}");
    let copy_gbps = gpu.copy_bandwidth_gbps()?;
    println!("copy bandwidth: {copy_gbps:.0} GB/s\n");

    let rng = &mut Rng::new(SEED);
    let seq_lens = demo_seq_lens(rng);
    println!("seq_lens: {seq_lens:?}");
    let setup = DenseSetup {
        batch: BATCH,
        q_len: 1,
        heads,
        block_size: BLOCK_SIZE,
        seq_lens,
        softmax_scale: scale,
    };
    let name = format!("dense: {BATCH} requests, lengths <= {MAX_LEN}");
    let mut dense = DenseCase::<bf16>::new(&gpu.stream, name, setup, rng)?;
    let mut rows = vec![measure_row(gpu, &mut dense, copy_gbps)?];

    let mut gather = demo_gather(&gpu.stream, &dense, rng)?;
    rows.push(measure_row(gpu, &mut gather, copy_gbps)?);
    let indices = gather.into_output();
    let indices_host = gpu.stream.clone_dtoh(&indices)?;

    let setup = SparseSetup {
        tokens: BATCH,
        heads,
        topk: TOPK,
        softmax_scale: scale,
    };
    let name = format!("sparse: {BATCH} tokens x top-{TOPK}");
    let mut sparse = SparseCase::<bf16>::new(
        &gpu.stream,
        name,
        setup.clone(),
        dense.cache(),
        indices,
        indices_host.clone(),
        rng,
    )?;
    rows.push(measure_row(gpu, &mut sparse, copy_gbps)?);

    // The same two decodes over an fp8_ds_mla cache of the same geometry (the slot ids of
    // the gather stay valid: same block size and block count).
    let kv = CacheKind::Fp8DsMla(ScaleRule::Raw);
    let name = format!("dense fp8_ds_mla: {BATCH} requests");
    let mut dense8 =
        DenseCase::<bf16>::with_table_in(&gpu.stream, name, dense.setup().clone(), None, kv, rng)?;
    rows.push(measure_row(gpu, &mut dense8, copy_gbps)?);
    let name = format!("sparse fp8_ds_mla: {BATCH} x top-{TOPK}");
    let indices8 = gpu.stream.clone_htod(&indices_host)?;
    let mut sparse8 = SparseCase::<bf16>::new(
        &gpu.stream,
        name,
        setup,
        dense8.cache(),
        indices8,
        indices_host,
        rng,
    )?;
    rows.push(measure_row(gpu, &mut sparse8, copy_gbps)?);

    println!();
    let table = Table::new(rows.iter().map(Row::name), true);
    table.print(&rows);
    println!(
        "\nrelerr: largest relative L2 error of a sampled output row vs the f64 reference \
         (gather: fraction of wrong slot ids); lse_err: largest |lse - reference|"
    );
    let ok = rows.iter().all(Row::passed);
    println!(
        "{}",
        if ok {
            "all results match the reference"
        } else {
            "MISMATCH: a result is out of tolerance"
        }
    );
    Ok(ok)
}

/// Lengths up to [`MAX_LEN`]: one full, one of a single token, one under top-k, the rest
/// random.
fn demo_seq_lens(rng: &mut Rng) -> Vec<i32> {
    let mut lens: Vec<i32> = (0..BATCH).map(|_| 1 + rng.below(MAX_LEN) as i32).collect();
    lens[0] = MAX_LEN as i32;
    lens[1] = 1;
    lens[2] = 1000;
    lens
}

/// Token `t` belongs to request `t` and picks [`TOPK`] distinct positions of it (all of
/// them, then -1, when the request is shorter), as the DSA indexer would.
fn demo_gather(
    stream: &Arc<CudaStream>,
    dense: &DenseCase<bf16>,
    rng: &mut Rng,
) -> Res<GatherCase> {
    let seq_lens = dense.setup().seq_lens.clone();
    let mut positions = Vec::with_capacity(BATCH * TOPK);
    for &len in &seq_lens {
        let mut logical: Vec<i32> = (0..len).collect();
        let n = TOPK.min(logical.len());
        positions.extend_from_slice(rng.distinct(&mut logical, n));
        positions.resize(positions.len() + TOPK - n, -1);
    }
    let (table, max_blocks) = dense.block_table();
    let inputs = GatherInputs {
        positions,
        topk: TOPK,
        req_id: (0..BATCH as i32).collect(),
        block_table: table.to_vec(),
        max_blocks,
        seq_lens,
        num_blocks: dense.cache().num_blocks,
        block_size: BLOCK_SIZE,
    };
    let name = format!("gather: {BATCH} tokens x top-{TOPK} positions");
    GatherCase::new(stream, name, inputs)
}

/// Plans, times and checks one workload (the check compares the last timed run).
fn measure_row(gpu: &mut Gpu, w: &mut dyn Workload, copy_gbps: f64) -> Res<Row> {
    w.set_options(&gpu.stream, PlanOptions::default())?;
    let opts = MeasureOpts {
        warmup: 5,
        iters: 50,
        graph: true,
    };
    let timing = common::measure(gpu, w, &opts)?;
    let accuracy = w.check(&gpu.stream)?;
    let row = Row {
        meta: w.meta().clone(),
        sm120_occupancy: false,
        us: timing.us,
        graph_us: timing.graph_us,
        accuracy: Some(accuracy),
        copy_gbps,
    };
    println!(
        "{}: {:.2} µs, relerr {:.2e}{}",
        row.name(),
        row.us,
        accuracy.relerr,
        accuracy
            .lse_err
            .map_or(String::new(), |e| format!(", lse_err {e:.2e}"))
    );
    Ok(row)
}
