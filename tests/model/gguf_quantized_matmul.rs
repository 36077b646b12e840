//! A matrix kept in a ggml block format on the CPU backend multiplies to
//! the same f32 bits as the same matrix dequantized up front, for every
//! supported format, every instruction set, alone or batched, on one thread
//! or split over several (one to eight rows take the fused kernels: split
//! Q8_0/Q4_1, decoded groups for the others, AVX-512 pairs where the ISA has
//! them; more take dequantized tiles); and it takes the bytes of its blocks,
//! not 4 per element.

use handoff::backend::{Backend, CpuBackend, Isa};
use handoff::model::gguf::{GgmlType, QuantMatrix};

/// Deterministic bytes with every block's f16 scale fields set to small
/// finite values (random bytes there could be Inf/NaN).
fn blocks(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let bb = ty.block_bytes() as usize;
    let n = rows * cols / ty.block_elems() as usize;
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let f16_at: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    let mut out = Vec::with_capacity(n * bb);
    for _ in 0..n {
        let mut b: Vec<u8> = (0..bb).map(|_| next() as u8).collect();
        for &at in f16_at {
            let v = ((next() % 2000) as f32 / 1000.0 - 1.0) * 0.05;
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
        }
        out.extend(b);
    }
    out
}

fn activations(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
        })
        .collect()
}

const TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn quantized_matmul_gives_the_dequantized_reference_bits_batched_or_alone() {
    for isa in Isa::available() {
        for threads in [1, 2] {
            let b = CpuBackend::with_isa(threads, isa)
                .unwrap()
                .min_parallel_work(1);
            for ty in TYPES {
                // k of 256 and 512 (K-quants need 256), n not a multiple
                // of any tile, so leftover columns are covered; a k of 48
                // blocks of 32, past the 32-block runs in which the AVX2
                // kernels widen scales; and for the 32-value types, rows
                // that end inside a 256-value group (576: two groups and
                // two blocks; 288: one group and one block).
                let small = [(13, 576), (5, 288)];
                let shapes = [(37, 256), (20, 512), (9, 1536)];
                let extra = if ty.block_elems() == 32 {
                    &small[..]
                } else {
                    &[]
                };
                for &(n, k) in shapes.iter().chain(extra) {
                    let bytes = blocks(ty, n, k, n as u64 * 31 + k as u64);
                    let q = QuantMatrix::new("w", ty, n, k, bytes).unwrap();
                    let reference = b.upload(q.dequantize(), n, k).unwrap();
                    let kept = b.upload_quant(q).unwrap();
                    assert_eq!(kept.quant_type(), Some(ty), "kept in its block format");
                    for m in 1..=9 {
                        let x = activations(m * k, m as u32);
                        let (mut want, mut got) = (Vec::new(), Vec::new());
                        b.matmul(&x, &reference, &mut want).unwrap();
                        b.matmul(&x, &kept, &mut got).unwrap();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{isa:?} {threads}t {ty} {m}x{k}x{n}"
                        );
                        assert!(want.iter().all(|v| v.is_finite()));
                        for i in 0..m {
                            let mut one = Vec::new();
                            b.matmul(&x[i * k..(i + 1) * k].to_vec(), &kept, &mut one)
                                .unwrap();
                            assert_eq!(
                                bits(&one),
                                bits(&got[i * n..(i + 1) * n]),
                                "{ty} row {i} of {m}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_quantized_matrix_holds_its_blocks_bytes_and_embeds_its_rows_exactly() {
    let b = CpuBackend::with_threads(1);
    let (n, k) = (64, 512);
    let q = QuantMatrix::new("w", GgmlType::Q4_1, n, k, blocks(GgmlType::Q4_1, n, k, 9)).unwrap();
    let full = q.dequantize();
    let kept = b.upload_quant(q).unwrap();
    // 20 bytes per 32 elements: 0.625 bytes per element, not 4.
    assert_eq!(b.mat_bytes(&kept), n * k / 32 * 20);
    let mut rows = Vec::new();
    b.embed(&kept, &[5, 0, 63], &mut rows).unwrap();
    assert_eq!(bits(&rows[..k]), bits(&full[5 * k..6 * k]));
    assert_eq!(bits(&rows[2 * k..]), bits(&full[63 * k..]));
    assert!(
        b.embed(&kept, &[64], &mut rows).is_err(),
        "a token past the table is refused"
    );
}
