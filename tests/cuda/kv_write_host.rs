//! RoPE with its append in one launch, run before any GPU sees it.
//!
//! The decode step rotates q and k and appends k and v to the sequences'
//! pages. On the CUDA backend both happen in one launch
//! (`CudaDevice::rope_pair_append`, cuda/kv_write.cuh), one launch a layer
//! fewer than RoPE then the append. The pages it writes are what every
//! later read trusts, so the fused launch must store exactly what the two
//! launches store: tests/support/sim/kv_write_main.cpp runs both on the
//! host SIMT emulator, for f32, f16 and bf16 arenas, both RoPE styles, with
//! and without llama3 frequency scaling, on shuffled slots of an arena that
//! is NaN everywhere else, and requires the same bits in q, k and the whole
//! arena, and the rounded rows in exactly the given slots.
//!
//! Without a C++ compiler the test prints `SKIP` and passes.

use std::io::Write;
use std::process::Command;

use crate::support::sim_host as host;

#[test]
fn rope_with_its_append_stores_the_bits_of_rope_then_the_append_on_a_simt_emulator() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(
        "rope_with_its_append_stores_the_bits_of_rope_then_the_append_on_a_simt_emulator",
        "kv_write_main.cpp",
        dir.path(),
    ) else {
        return;
    };
    let run = Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    let _ = write!(std::io::stderr(), "{report}");
    let passed = report.lines().filter(|l| l.starts_with("PASS ")).count();
    assert!(
        run.status.success() && passed == 9,
        "the fused launch disagrees with the two launches ({passed} of 9 cases pass):\n{report}{}",
        String::from_utf8_lossy(&run.stderr)
    );
}
