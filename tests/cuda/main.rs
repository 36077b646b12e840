//! The CUDA layer: kernels against the f64 reference (GPU only: they print SKIP without one) and their bodies on a host SIMT emulator.
//!
//! One story per module; the shared rigs are in `tests/support/`.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod cuda_backend;
mod cuda_kernels;
mod cuda_pages;
mod decode_host;
mod kv_write_host;
mod linear_f32_host;
mod linear_mma_host;
mod logprobs_host;
mod prefill_mma_host;
mod sampling_host;
mod xxh3_host;
