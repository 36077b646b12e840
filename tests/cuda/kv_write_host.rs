//! RoPE with its append in one launch, run before any GPU sees it.
//!
//! The decode step rotates q and k and appends k and v to the sequences'
//! pages. On the CUDA backend both happen in one launch
//! (`CudaDevice::rope_pair_append`, cuda/kv_write.cuh), one launch a layer
//! fewer than RoPE then the append. The pages it writes are what every
//! later read trusts, so the fused launch must store exactly what the two
//! launches store: tests/support/sim/kv_write_main.cpp runs both on the
//! host SIMT emulator, for f32, f16, bf16 and FP8 arenas, both RoPE styles, with
//! and without llama3 frequency scaling, on shuffled slots of an arena that
//! is NaN everywhere else, and requires the same bits in q, k and the whole
//! arena, and the rounded rows in exactly the given slots.
//!
//! Without a C++ compiler the test prints `SKIP` and passes.

use std::io::Write;
use std::process::Command;

use handoff::kv::F8E4M3;

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
        run.status.success() && passed == 12,
        "the fused launch disagrees with the two launches ({passed} of 12 cases pass):\n{report}{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The kernels' FP8 conversions (cuda/common.cuh, emulated as the device's
/// `cvt` instructions define them) store the bytes the host pool stores
/// (src/kv/fp8.rs): a page appended on either side reads the same.
#[test]
fn fp8_kv_elements_convert_on_the_emulator_as_on_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(
        "fp8_kv_elements_convert_on_the_emulator_as_on_the_host",
        "kv_write_main.cpp",
        dir.path(),
    ) else {
        return;
    };
    // Every code's value and the midpoints between neighbours (the ties),
    // one f32 step either side of them, the saturation edge, NaN, infinities,
    // zeros, and a sweep of bit patterns.
    let mut xs: Vec<f32> = Vec::new();
    let mut values: Vec<f32> = (0..=255u8)
        .map(|b| F8E4M3(b).to_f32())
        .filter(|x| !x.is_nan())
        .collect();
    values.sort_by(f32::total_cmp);
    for w in values.windows(2) {
        let mid = (w[0] + w[1]) / 2.0;
        xs.extend([w[0], mid, f32::from_bits(mid.to_bits() + 1)]);
        if mid != 0.0 {
            xs.push(f32::from_bits(mid.to_bits() - 1));
        }
    }
    xs.extend([447.9, 448.0, 464.0, 1e9, f32::INFINITY, f32::NEG_INFINITY]);
    xs.extend([
        f32::NAN,
        -f32::NAN,
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        f32::MIN_POSITIVE,
    ]);
    let mut bits = 12345u32;
    for _ in 0..20_000 {
        bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        xs.push(f32::from_bits(bits));
        xs.push(f32::from_bits(
            (bits & 0x807F_FFFF) | (115 + (bits >> 23) % 25) << 23,
        ));
    }
    let input = dir.path().join("fp8.bin");
    let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&input, bytes).unwrap();
    let run = Command::new(&exe).arg("fp8").arg(&input).output().unwrap();
    assert!(run.status.success(), "emulator exited {}", run.status);
    let out: Vec<u32> = String::from_utf8_lossy(&run.stdout)
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(out.len(), xs.len() + 256);
    for (x, &code) in xs.iter().zip(&out) {
        assert_eq!(
            code,
            u32::from(F8E4M3::from_f32(*x).0),
            "{x:e} ({:#010x})",
            x.to_bits()
        );
    }
    for (b, &f) in out[xs.len()..].iter().enumerate() {
        let host = F8E4M3(b as u8).to_f32();
        let device = f32::from_bits(f);
        assert!(
            host.to_bits() == f || (host.is_nan() && device.is_nan()),
            "code {b:#04x}: {device} on the emulator, {host} on the host"
        );
    }
    let _ = writeln!(
        std::io::stderr(),
        "PASS {} conversions to FP8 and all 256 codes back agree",
        xs.len()
    );
}
