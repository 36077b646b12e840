//! `out = x · Wᵀ` on the CPU.
//!
//! Every output element is one dot product computed in a fixed order (eight
//! lane accumulators over the shared dimension, a fixed reduction tree, then
//! the tail), whatever tile it falls in and whichever thread computes it. So
//! a sequence's numbers are bit-identical alone or inside any batch, which is
//! what makes greedy output independent of batching.
//!
//! Tiles reuse each loaded weight chunk for several activation rows: one
//! pass over the weights serves every sequence of a step.
//!
//! Two instruction sets, chosen once per backend ([`Isa`]): portable code
//! (SSE2 on x86-64), and AVX2 with fused multiply-add where the CPU has it.
//! The FMA variant rounds once per multiply-add, so its numbers differ from
//! the portable ones in the last bits; a backend never mixes the two.

use crate::backend::cpu::Isa;

use crate::backend::cpu::kernel::{Elem, PANEL, Portable, WeightRows, matmul_cols_k};

/// `matmul_cols_k` for the backend's instruction set and the weights'
/// storage.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: WeightRows<'_>,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    match w {
        WeightRows::F32(w) => matmul_cols_of(isa, x, m, k, w, cols, out, row_stride, col_stride),
        WeightRows::Bf16(w) => matmul_cols_of(isa, x, m, k, w, cols, out, row_stride, col_stride),
        WeightRows::F16(w) => matmul_cols_of(isa, x, m, k, w, cols, out, row_stride, col_stride),
    }
}

#[allow(clippy::too_many_arguments)]
fn matmul_cols_of<W: Elem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the CPU
            // reported AVX2 and FMA (`CpuBackend::build` validates it).
            unsafe {
                crate::backend::cpu::x86::matmul_cols(x, m, k, w, cols, out, row_stride, col_stride)
            }
        }
        _ => matmul_cols_k::<Portable, W, 2, 2, 4>(x, m, k, w, cols, out, row_stride, col_stride),
    }
}

/// Dot products at most this long use packed panels (on AVX2): there the
/// row-major tiles' horizontal reductions weigh as much as the
/// multiply-adds. Longer ones (large models) keep the row-major tiles.
pub(crate) const PACK_MAX_K: usize = 256;

/// Whether a `[rows, cols]` weight is packed (AVX2 backends only).
pub(crate) fn packs(rows: usize, cols: usize) -> bool {
    rows > 1 && cols > 0 && cols < PACK_MAX_K
}

/// `w: [n, k]` row-major into panels (see [`PANEL`]).
pub(crate) fn pack(w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let panels = n.div_ceil(PANEL);
    let mut out = vec![0f32; panels * k * PANEL];
    for (j, row) in w.chunks_exact(k).take(n).enumerate() {
        let base = (j / PANEL) * k * PANEL + j % PANEL;
        for (t, &v) in row.iter().enumerate() {
            out[base + t * PANEL] = v;
        }
    }
    out
}

/// `out = x · Wᵀ` (`x: [m, k]`, `out: [m, n]`) from packed panels. Each
/// output element is one chain of fused multiply-adds over `t = 0..k` in
/// order, whichever tile computes it, so rows are bit-identical alone or
/// batched.
pub(crate) fn matmul_packed(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    packed: &[f32],
    n: usize,
    out: &mut [f32],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the CPU
            // reported AVX2 and FMA (`CpuBackend::build` validates it).
            unsafe { crate::backend::cpu::x86::matmul_packed(x, m, k, packed, n, out) }
        }
        // Only AVX2 backends pack; stay correct regardless.
        _ => {
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0f32;
                    for t in 0..k {
                        s = x[i * k + t]
                            .mul_add(packed[(j / PANEL) * k * PANEL + t * PANEL + j % PANEL], s);
                    }
                    out[i * n + j] = s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::kernel::{Bf16, F16, Half};

    fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for t in 0..k {
                    s += x[i * k + t] as f64 * w[j * k + t] as f64;
                }
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_naive_for_odd_shapes_and_is_batch_invariant_on_every_isa() {
        for isa in Isa::available() {
            for (m, k, n) in [
                (1, 1, 1),
                (3, 7, 5),
                (5, 17, 9),
                (2, 64, 8),
                (7, 33, 13),
                (6, 300, 7),
            ] {
                let x = data(m * k, 1);
                let w = data(n * k, 2);
                let mut out = vec![0f32; m * n];
                matmul_cols(isa, &x, m, k, WeightRows::F32(&w), 0..n, &mut out, n, 1);
                let want = naive(&x, m, k, &w, n);
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-4, "{isa:?} {m}x{k}x{n}: {a} vs {b}");
                }
                // Each row alone gives bit-identical numbers.
                for i in 0..m {
                    let mut one = vec![0f32; n];
                    let xi = &x[i * k..(i + 1) * k];
                    matmul_cols(isa, xi, 1, k, WeightRows::F32(&w), 0..n, &mut one, n, 1);
                    assert_eq!(one, out[i * n..(i + 1) * n]);
                }
            }
        }
    }

    /// Values that are exactly bf16 (what a bf16 checkpoint loads as).
    fn bf16_data(n: usize, seed: u32) -> Vec<f32> {
        data(n, seed)
            .into_iter()
            .map(|v| f32::from_bits(v.to_bits() & 0xffff_0000))
            .collect()
    }

    /// Values that are exactly f16, subnormals and signed zeros included.
    fn f16_data(n: usize, seed: u32) -> Vec<f32> {
        let mut v: Vec<f32> = data(n, seed)
            .into_iter()
            .map(|v| half::f16::from_f32(v * 3.0).to_f32())
            .collect();
        for (i, x) in v.iter_mut().enumerate().step_by(5) {
            let special = [-0.0, 6.0e-8, -3.0e-5, 65504.0][i % 4];
            *x = half::f16::from_f32(special).to_f32();
        }
        v
    }

    /// `matmul_cols` with weights stored as `H` and as f32 agree bit for
    /// bit, over every tile shape of both kernels: k below and above 256,
    /// rows in blocks and left over, columns left over by the tile and
    /// ranges not starting at 0.
    fn check_storage<H: Half>(make: fn(usize, u32) -> Vec<f32>, view: fn(&[H]) -> WeightRows<'_>) {
        for isa in Isa::available() {
            for (m, k, n) in [
                (1, 8, 1),
                (3, 7, 5),
                (5, 17, 9),
                (9, 64, 13),
                (6, 300, 7),
                (4, 512, 12),
            ] {
                let x = data(m * k, 3);
                let w = make(n * k, 4);
                let halves: Vec<H> = w.iter().map(|&v| H::exact(v).unwrap()).collect();
                for cols in [0..n, 1..n.max(2) - 1] {
                    let width = cols.len();
                    let mut want = vec![f32::NAN; m * width];
                    let mut got = vec![f32::NAN; m * width];
                    let f32_rows = WeightRows::F32(&w);
                    matmul_cols(isa, &x, m, k, f32_rows, cols.clone(), &mut want, width, 1);
                    let rows = view(&halves);
                    matmul_cols(isa, &x, m, k, rows, cols.clone(), &mut got, width, 1);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{isa:?} {m}x{k}x{n} cols {cols:?}");
                }
            }
        }
    }

    #[test]
    fn bf16_weights_give_the_f32_kernels_numbers_bit_for_bit() {
        check_storage::<Bf16>(bf16_data, |h| WeightRows::Bf16(h));
    }

    #[test]
    fn f16_weights_give_the_f32_kernels_numbers_bit_for_bit() {
        check_storage::<F16>(f16_data, |h| WeightRows::F16(h));
    }

    #[test]
    fn only_exact_values_become_16_bit() {
        assert_eq!(Bf16::exact(1.0).map(|b| b.f32()), Some(1.0));
        assert_eq!(
            Bf16::exact(-0.0).map(|b| b.f32().to_bits()),
            Some((-0.0f32).to_bits())
        );
        assert!(Bf16::exact(f32::INFINITY).is_some());
        assert!(Bf16::exact(1.0 + f32::EPSILON).is_none());
        assert!(Bf16::exact(0.1).is_none());

        assert_eq!(F16::exact(0.5).map(|h| h.f32()), Some(0.5));
        assert_eq!(
            F16::exact(-0.0).map(|h| h.f32().to_bits()),
            Some((-0.0f32).to_bits())
        );
        // Past f16's range, below its smallest subnormal, or finer than
        // its mantissa: not exact.
        assert!(F16::exact(70000.0).is_none());
        assert!(F16::exact(1.0e-9).is_none());
        assert!(F16::exact(1.0 + 1.0 / 4096.0).is_none());
        // A NaN payload the format cannot carry is refused, not changed.
        let payload = f32::from_bits(0x7f80_0001);
        assert!(F16::exact(payload).is_none() && Bf16::exact(payload).is_none());
    }

    #[test]
    fn packed_panels_match_naive_and_every_row_is_the_same_alone_or_batched() {
        // Every tile shape: bands of 6, 5..2 rows, a single row; panel
        // counts odd and even, a last panel cut short (n not a multiple of
        // 8); k short and up to the packing limit.
        for isa in Isa::available() {
            for (k, n) in [
                (1, 1),
                (7, 5),
                (64, 32),
                (64, 172),
                (172, 64),
                (255, 9),
                (64, 512),
            ] {
                assert!(packs(n, k) || n == 1);
                let w = data(n * k, 5);
                let p = pack(&w, n, k);
                for m in [1, 2, 3, 4, 5, 6, 7, 13, 16] {
                    let x = data(m * k, 6 + m as u32);
                    let mut out = vec![f32::NAN; m * n];
                    matmul_packed(isa, &x, m, k, &p, n, &mut out);
                    let want = naive(&x, m, k, &w, n);
                    for (a, b) in out.iter().zip(&want) {
                        assert!(
                            (a - b).abs() < 1e-4 * (1.0 + b.abs()),
                            "{isa:?} {m}x{k}x{n}: {a} vs {b}"
                        );
                    }
                    for i in 0..m {
                        let mut one = vec![f32::NAN; n];
                        matmul_packed(isa, &x[i * k..(i + 1) * k], 1, k, &p, n, &mut one);
                        assert_eq!(one, out[i * n..(i + 1) * n], "{isa:?} row {i} of {m}");
                    }
                }
            }
        }
    }
}
