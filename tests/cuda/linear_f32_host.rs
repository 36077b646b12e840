//! Dense layers with f32 weights (f32 checkpoints, quantized GGUF widened
//! to f32), run before any GPU sees them.
//!
//! At batch 1 a dense layer is a stream of weight bytes, so the kernel
//! (cuda/linear_f32.cuh) splits k across a block's warps and has each warp
//! issue the 16-byte loads of several k-blocks before it multiplies. It is
//! compiled for the host against the SIMT emulator by
//! tests/support/sim/linear_f32_main.cpp, which checks every output of
//! ragged shapes (odd k, k not a multiple of a k-block, n not of a block's
//! columns) against an f64 reference within f32 rounding, and requires the
//! bits of the batched run from each row alone, from the two other block
//! shapes (1, 4 and 8 rows of x a block) and from x off 16-byte alignment;
//! a NaN in one row of x stays in that row, and accumulating into a
//! residual gives the bits of the product then the add.
//!
//! Without a C++ compiler the test prints `SKIP` and passes; the GPU test
//! `matmul_and_adds_match_reference_whatever_the_batch` in cuda_kernels.rs
//! runs the kernel itself.

use std::process::Command;

use crate::support::sim_host as host;

#[test]
fn f32_matmul_matches_the_reference_and_gives_every_row_the_same_bits_whatever_its_batch_on_a_simt_emulator()
 {
    let test = "f32_matmul_matches_the_reference_and_gives_every_row_the_same_bits_whatever_its_batch_on_a_simt_emulator";
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(test, "linear_f32_main.cpp", dir.path()) else {
        return;
    };
    let run = Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "emulated cases failed:\n{report}");
    assert_eq!(
        report.lines().filter(|l| l.starts_with("ok ")).count(),
        12,
        "{report}"
    );
}
