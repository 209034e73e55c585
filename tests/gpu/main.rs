//! The GPU tests, in one integration-test binary (`test-gpu` on the GPU machine: every
//! test binary links all the kernels, and what travels there is capped).
//!
//! Every test is `#[ignore]`d (CPU runs list it as ignored); the device runs them with
//! `cargo test --release --test gpu -- --include-ignored --test-threads=1`. Tests whose name
//! contains `sanitize_` are small and are the ones compute-sanitizer runs.
//!
//! Data are fresh random values each run: proptest cases print their value (which holds the
//! data seed) on failure, the other tests print their seed (`MLA_TEST_SEED` replays one).
//!
//! - [`plumbing`]: hand-computed answers for the safe layer's plumbing (device info, the flag
//!   and its non-blocking reads, views and strides, validation with real buffers);
//! - [`fp8`]: the fp8 quantize-and-append bytes against the reference quantizer, fp8 decode
//!   refused as unsupported (until its kernels land), fault values of 64 bits;
//! - [`dense`], [`sparse`]: each decode against the f64 reference, and the inputs the host
//!   cannot check;
//! - [`cache_ops`]: `append_kv` and `gather_slots`;
//! - [`end_to_end`]: sparse over every slot equals dense; a GLM-5 step gather → sparse;
//! - [`repeat`]: plan reuse, CUDA-graph replay, bitwise determinism;
//! - [`rows`]: the row kernel of one-part steps, forced on random shapes, its default choice;
//! - [`graph`]: `capture_graph` (its refusals; dense and sparse steps replayed with new
//!   inputs, the flag snapshotted on the device);
//! - [`capacity`]: preallocated maximum-size buffers: every call with buffers longer than
//!   its token count, nothing past the count read or written; decode of caches whose rows
//!   lie past 4 GiB (the append's twin is in [`fp8`]);
//! - [`soak`]: random calls across the whole API, a fifth of them bad (`MLA_SOAK_CALLS`;
//!   `sanitize_soak_random_api`, `MLA_SANITIZE_SOAK_CALLS`, is the sanitizer's);
//! - [`concurrency`]: two streams, two host threads, two GPUs (skipped, saying so, on a
//!   one-GPU machine): results bitwise those of the same calls run alone.

#[path = "../kit/mod.rs"]
mod kit;

mod cache_ops;
mod capacity;
mod concurrency;
mod dense;
mod end_to_end;
mod fp8;
mod graph;
mod plumbing;
mod repeat;
mod rows;
mod soak;
mod sparse;
