//! The tensor-core prefill kernel, run before any GPU sees it.
//!
//! The incident behind this crate was a decode reading KV slots its request
//! never wrote. A new attention kernel is where such a read would come
//! from: a fragment indexed one row off, a causal mask one position late, a
//! tile loaded past the sequence. The machine this is developed on has no
//! GPU, so the kernel body (cuda/prefill_mma.cuh) is also compiled for the
//! host against a SIMT emulator (tests/support/sim/simt_host.h: one OS thread per
//! CUDA thread, barriers for __syncthreads and shuffles, mma.sync computed
//! from the PTX ISA's fragment layout). tests/support/sim/prefill_mma_main.cpp runs
//! ragged batches over shuffled pages in arenas that are NaN everywhere a
//! sequence was not given, for f16, bf16 and FP8 (whose tiles the kernel
//! widens to f16 in shared memory), head_dim 64 and 128, page
//! sizes 16 and 64, groups 1 to 64, prompts of one to five K/V tiles (the
//! emulator lands each cp.async copy only at its wait, so a tile read
//! before it has landed is NaN), and compares every output with an f64
//! reference at the tolerance the GPU test uses (8 unit roundoffs of the KV
//! dtype). A stray read turns an output NaN and fails the case. The wide
//! kernel (two m-tiles a warp, 128 rows a block) runs on the same cases and
//! must give the 64-row kernel's output bit for bit.
//!
//! The emulator does not model memory ordering or timing; the GPU tests in
//! tests/cuda_kernels.rs remain the word on the real hardware.
//!
//! Without a C++ compiler the test prints `SKIP` and passes.

use std::io::Write;
use std::process::Command;

use crate::support::sim_host as host;

#[test]
fn tensor_core_prefill_matches_the_reference_on_a_simt_emulator() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(
        "tensor_core_prefill_matches_the_reference_on_a_simt_emulator",
        "prefill_mma_main.cpp",
        dir.path(),
    ) else {
        return;
    };
    let run = Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    let _ = write!(std::io::stderr(), "{report}");
    let passed = report.lines().filter(|l| l.starts_with("PASS ")).count();
    assert!(
        run.status.success() && passed == 8,
        "the emulated kernel disagrees with the reference ({passed} of 8 cases pass):\n{report}{}",
        String::from_utf8_lossy(&run.stderr)
    );
}
