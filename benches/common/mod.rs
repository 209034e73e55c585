//! Code shared by the decode bench (`benches/decode.rs`), the profile runner
//! (`examples/profile.rs`) and the demo (`examples/demo.rs`), which include it with
//! `#[path = "../benches/common/mod.rs"] mod common;`.
//!
//! - [`kit`]: the test kit (`tests/kit/`), whose random generator ([`rng`]), tolerances and
//!   error measures the bench shares with the tests;
//! - [`spec`]: the case grammar (`dense:b=64,h=8,l=4096`, `dense:h=8,lens=512*15+8192*1`,
//!   `sparse:t=128,h=8,k=2048`, `gather:t=128,k=2048`, `append:t=128,kv=fp8_ds_mla`) and the
//!   default grid;
//! - [`gpu`]: the device, the L2 flush, CUDA-event timing, the copy bandwidth, graph capture;
//! - [`cases`]: the workloads (random inputs on the device, one timed step, the check);
//! - [`check`]: sampled comparison with the f64 reference (`mla_decode::reference`);
//! - [`report`]: result rows, the table and the JSON file.
//!
//! Each includer uses a different part of this module.
#![allow(dead_code, unused_imports)]

pub mod cases;
pub mod check;
pub mod gpu;
#[path = "../../tests/kit/mod.rs"]
pub mod kit;
pub mod report;
pub mod spec;

pub use kit::rng;

pub use cases::{build, BENCH_SEED};
pub use gpu::{measure, Gpu, MeasureOpts};

/// Errors of the bench tools: library, driver, I/O and argument errors alike.
pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The value after a command-line flag.
pub fn flag_value(args: &mut impl Iterator<Item = String>, flag: &str) -> Result<String, String> {
    args.next().ok_or_else(|| format!("{flag} needs a value"))
}

/// A positive count given on the command line.
pub fn parse_count(value: &str, flag: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "{flag}: expected a positive integer, got `{value}`"
        )),
    }
}
