//! Dense layers with f32 weights (f32 checkpoints), and with weights kept in
//! a GGUF checkpoint's ggml blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
//! Q5_K, Q6_K), run before any GPU sees them.
//!
//! At batch 1 a dense layer is a stream of weight bytes, so the kernel
//! (cuda/linear_f32.cuh) splits k across a block's warps and has each warp
//! issue the loads of several k-blocks before it multiplies. It is compiled
//! for the host against the SIMT emulator by
//! tests/support/sim/linear_f32_main.cpp, which checks every output of
//! ragged shapes (odd k, k not a multiple of a k-block, n not of a block's
//! columns) against an f64 reference within f32 rounding, and requires the
//! bits of the batched run from each row alone, from the two other block
//! shapes (1, 4 and 8 rows of x a block) and from x off 16-byte alignment;
//! a NaN in one row of x stays in that row, and accumulating into a
//! residual gives the bits of the product then the add.
//!
//! Quantized weights stay in their blocks on the device and are widened as
//! they load. This test writes random blocks of each format with the values
//! this crate's own widening gives them (`QuantMatrix::dequantize`, what the
//! CPU backend computes with), and the emulated program requires the
//! block-reading matmul to give the bits of the f32 matmul on those values,
//! at every block shape and accumulating, and the block-reading embedding
//! gather to give the values themselves: so a GGUF model on the GPU reads a
//! quarter of the bytes and computes what it computed widened to f32.
//!
//! Without a C++ compiler the test prints `SKIP` and passes; the GPU test
//! `matmul_and_adds_match_reference_whatever_the_batch` in cuda_kernels.rs
//! runs the f32 kernel itself.

use std::io::Write;
use std::process::Command;

use handoff::backend::{GgmlType, QuantMatrix};

use crate::support::sim_host as host;

/// SplitMix64.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Random blocks of `ty` for `rows` x `cols`, with finite f16 scales (and
/// minimums) of unlike magnitudes, as a QuantMatrix.
fn random_blocks(ty: GgmlType, rows: usize, cols: usize, rng: &mut u64) -> QuantMatrix {
    let (block, values, scales): (usize, usize, &[usize]) = match ty {
        GgmlType::Q8_0 => (34, 32, &[0]),
        GgmlType::Q4_0 => (18, 32, &[0]),
        GgmlType::Q4_1 => (20, 32, &[0, 2]),
        GgmlType::Q5_0 => (22, 32, &[0]),
        GgmlType::Q5_1 => (24, 32, &[0, 2]),
        GgmlType::Q4K => (144, 256, &[0, 2]),
        GgmlType::Q5K => (176, 256, &[0, 2]),
        _ => (210, 256, &[208]),
    };
    let mut data: Vec<u8> = (0..rows * cols / values * block)
        .map(|_| next(rng) as u8)
        .collect();
    for b in data.chunks_exact_mut(block) {
        for &at in scales {
            let r = next(rng);
            let v =
                ((r >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32 * 0.1 / (1 + r % 7) as f32;
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    QuantMatrix::new("w", ty, rows, cols, data).unwrap()
}

#[test]
fn f32_and_ggml_block_matmuls_match_the_reference_and_give_every_row_the_same_bits_on_a_simt_emulator()
 {
    let test = "f32_and_ggml_block_matmuls_match_the_reference_and_give_every_row_the_same_bits_on_a_simt_emulator";
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(test, "linear_f32_main.cpp", dir.path()) else {
        return;
    };
    // (format code of params.cuh, ggml type, rows, cols): k within one
    // k-block of 128, across several and not a multiple of it.
    let cases = [
        (0u32, GgmlType::Q8_0, 9usize, 96usize),
        (1, GgmlType::Q4_0, 5, 288),
        (2, GgmlType::Q4_1, 7, 160),
        (2, GgmlType::Q4_1, 3, 1056),
        (0, GgmlType::Q8_0, 4, 544),
        (3, GgmlType::Q4K, 5, 512),
        (4, GgmlType::Q5K, 3, 256),
        (5, GgmlType::Q6K, 4, 768),
        (6, GgmlType::Q5_0, 6, 160),
        (7, GgmlType::Q5_1, 5, 288),
    ];
    let mut rng = 0x6767_u64;
    let mut file = Vec::new();
    file.extend_from_slice(&(cases.len() as u32).to_le_bytes());
    for (code, ty, rows, cols) in cases {
        let q = random_blocks(ty, rows, cols, &mut rng);
        let values = q.dequantize();
        assert!(values.iter().all(|v| v.is_finite()));
        for v in [code, rows as u32, cols as u32, q.bytes().len() as u32] {
            file.extend_from_slice(&v.to_le_bytes());
        }
        file.extend_from_slice(q.bytes());
        for v in values {
            file.extend_from_slice(&v.to_le_bytes());
        }
    }
    let path = dir.path().join("blocks.bin");
    std::fs::File::create(&path)
        .unwrap()
        .write_all(&file)
        .unwrap();
    let run = Command::new(&exe).arg(&path).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "emulated cases failed:\n{report}");
    assert_eq!(
        report.lines().filter(|l| l.starts_with("ok ")).count(),
        12 + cases.len(),
        "{report}"
    );
}
