//! Dense layers with bf16 or f16 weights on tensor cores, run before any GPU
//! sees them.
//!
//! A bf16 or f16 checkpoint's weights stay 16-bit on the device (half the
//! bytes to read per token) and meet the activations in mma.sync tiles
//! (cuda/linear_mma.cuh). The machine this is developed on has no GPU, so
//! the kernel body is compiled for the host against the SIMT emulator
//! (tests/support/sim/: mma.sync computed from the PTX fragment layout,
//! written independently of the kernel's indexing) by
//! tests/support/sim/linear_mma_main.cpp, which checks every output of
//! ragged shapes (m not a multiple of 16, n not of 128, k not of 16, odd k)
//! against an f64 reference within the split-activation precision the
//! kernel states, requires each row computed alone to give the batched
//! run's bits (batch invariance: from 32 rows the batch runs the wide 32 x
//! 32 tile, from 128 the pipelined 128 x 64 prefill tile, and a row alone
//! the 16 x 16 one), the other tiles over the whole batch to give them too,
//! a NaN in one row of x to stay in that row, accumulating into a residual
//! to give the bits of the product then the add, a group launch (q, k and
//! v in one launch) to give each product the bits of its own launch, and
//! the stages carried in a launch (RMSNorm in the loads of x, SwiGLU of a
//! gate and up pair in the stores) to give the bits of the rms_norm and
//! swiglu kernels and the separate matmuls. A set of the cases runs again
//! with f16 weights, which the kernel splits into exact bf16 parts: within
//! the same stated precision (a kernel that dropped the low parts fails
//! it), with the same invariances.
//!
//! Without a C++ compiler the test prints `SKIP` and passes; the GPU test
//! in cuda_backend.rs runs a bf16 model on the device against the CPU.

use std::process::Command;

use crate::support::sim_host as host;

#[test]
fn bf16_tensor_core_matmul_matches_the_reference_and_is_batch_invariant_on_a_simt_emulator() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(
        "bf16_tensor_core_matmul_matches_the_reference_and_is_batch_invariant_on_a_simt_emulator",
        "linear_mma_main.cpp",
        dir.path(),
    ) else {
        return;
    };
    let run = Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "emulated cases failed:\n{report}");
    assert_eq!(
        report.lines().filter(|l| l.starts_with("ok ")).count(),
        46,
        "{report}"
    );
}
