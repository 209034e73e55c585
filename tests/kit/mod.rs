//! The test kit: what the GPU tests (`tests/gpu/`), the CPU tests of the test machinery and
//! the bench (`benches/`, through `#[path]`) share, as FlashMLA's tests/kernelkit does.
//!
//! - [`rng`]: the one random generator, the per-test seeds, the proptest driver;
//! - [`host`]: host mirrors of device buffers (element types, strided layouts, queries,
//!   paged caches, outputs read back);
//! - [`problem`]: random dense, sparse and gather problems on the host;
//! - [`reference`]: `mla_decode::reference` run on those problems (any subset of heads);
//! - [`check`]: tolerances and comparisons (outputs, gaps, two runs, the error flag);
//! - [`fp8`]: fp8 caches quantized from a problem's cache, the problem wrapped to read them;
//! - [`dev`]: the device side (context, uploads, poisoned outputs, one decode of a
//!   [`Problem`](dev::Problem) generic over f16/bf16, [`with_dtype!`](dev::with_dtype)).
//!
//! Each includer uses a different part of it.
#![allow(dead_code, unused_imports, unused_macros)]

pub mod check;
pub mod dev;
pub mod fp8;
pub mod host;
pub mod problem;
pub mod reference;
pub mod rng;

pub use check::*;
pub use dev::*;
pub use fp8::*;
pub use host::*;
pub use problem::*;
pub use reference::*;
pub use rng::*;
