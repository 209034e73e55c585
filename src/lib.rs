//! # mla-decode
//!
//! Hand-written CUDA kernels for dense and DSA-sparse Multi-head Latent Attention decode,
//! built first for sm_120 (RTX PRO 6000 / RTX 50xx) and also for sm_90 (H100/H200).
#![warn(missing_docs)]

pub mod ffi;
pub mod reference;
