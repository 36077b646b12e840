//! A row's weights on the widest vector unit the CPU has.
//!
//! [`super::row`]'s weight is written in plain float and integer lane
//! operations, so the compiler vectorises a loop of it; built for the
//! baseline x86-64 target that is two f64 lanes. The same loop compiled
//! with AVX2 (four lanes) or AVX-512 (eight) gives the same bits: every
//! operation is the same correctly rounded one, and Rust never fuses a
//! multiply into an add, whatever the target features.

use super::row::{exp_nonpositive, weight_scaled};

/// Lanes of [`exp_sum`]'s partial sums: element `i` is added to sum
/// `i % EXP_LANES`, and the sums are then added in lane order, so the
/// result is the same bits at every vector width.
const EXP_LANES: usize = 8;

/// `Σ e^(logits[i] - max)` (differences in f64, each `<= 0`), summed in
/// [`EXP_LANES`] interleaved partial sums.
pub(super) fn exp_sum(logits: &[f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (detected just above).
            return unsafe { exp_sum_avx512(logits, max) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (detected just above).
            return unsafe { exp_sum_avx2(logits, max) };
        }
    }
    exp_sum_plain(logits, max)
}

#[inline(always)]
fn exp_sum_plain(logits: &[f32], max: f32) -> f64 {
    let mut acc = [0.0f64; EXP_LANES];
    let mut chunks = logits.chunks_exact(EXP_LANES);
    for c in &mut chunks {
        for (a, &l) in acc.iter_mut().zip(c) {
            *a += exp_nonpositive(l as f64 - max as f64);
        }
    }
    for (a, &l) in acc.iter_mut().zip(chunks.remainder()) {
        *a += exp_nonpositive(l as f64 - max as f64);
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp_sum_avx512(logits: &[f32], max: f32) -> f64 {
    exp_sum_plain(logits, max)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn exp_sum_avx2(logits: &[f32], max: f32) -> f64 {
    exp_sum_plain(logits, max)
}

/// `out[i] = weight(logits[i], max)` with `scale = log2e_over(temperature)`.
pub(super) fn weights_into(logits: &[f32], max: f32, scale: f64, out: &mut Vec<u64>) {
    out.clear();
    out.resize(logits.len(), 0);
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (detected just above), all the
            // function's target features require.
            unsafe { weights_avx512(logits, max, scale, out) };
            return;
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (detected just above).
            unsafe { weights_avx2(logits, max, scale, out) };
            return;
        }
    }
    weights_plain(logits, max, scale, out);
}

#[inline(always)]
fn weights_plain(logits: &[f32], max: f32, scale: f64, out: &mut [u64]) {
    for (o, &l) in out.iter_mut().zip(logits) {
        *o = weight_scaled(l, max, scale);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn weights_avx512(logits: &[f32], max: f32, scale: f64, out: &mut [u64]) {
    weights_plain(logits, max, scale, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn weights_avx2(logits: &[f32], max: f32, scale: f64, out: &mut [u64]) {
    weights_plain(logits, max, scale, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::row::{log2e_over, weight};

    #[test]
    fn every_vector_width_sums_exponentials_as_the_plain_loop_and_libm_agrees() {
        let logits: Vec<f32> = (0..1003)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.037 - 30.0)
            .chain([0.0, -0.0, 1e-30, -f32::MAX, 12.5, -800.0])
            .collect();
        let max = 12.5;
        assert_eq!(
            exp_sum(&logits, max).to_bits(),
            exp_sum_plain(&logits, max).to_bits()
        );
        let libm: f64 = logits.iter().map(|&l| (l as f64 - max as f64).exp()).sum();
        let ours = exp_sum(&logits, max);
        assert!((ours - libm).abs() <= 1e-11 * libm, "{ours} vs {libm}");
        for x in [0.0, -1e-9, -0.5, -1.0, -20.0, -699.0] {
            let (a, b) = (exp_nonpositive(x), x.exp());
            assert!((a - b).abs() <= 1e-11 * b, "e^{x}: {a} vs {b}");
        }
        assert_eq!(exp_nonpositive(-701.0), 0.0);
        assert_eq!(exp_nonpositive(f64::NEG_INFINITY), 0.0);
    }

    #[test]
    fn every_vector_width_weighs_as_the_scalar_rule() {
        let logits: Vec<f32> = (0..1003)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.037 - 30.0)
            .chain([0.0, -0.0, 1e-30, -f32::MAX, 12.5])
            .collect();
        for t in [1e-3f32, 0.7, 1.0, 3.0, 1e30] {
            let max = 12.5;
            let want: Vec<u64> = logits.iter().map(|&l| weight(l, max, t)).collect();
            let mut got = Vec::new();
            weights_into(&logits, max, log2e_over(t), &mut got);
            assert_eq!(got, want, "t {t}");
            let mut plain = vec![0; logits.len()];
            weights_plain(&logits, max, log2e_over(t), &mut plain);
            assert_eq!(plain, want, "t {t}");
        }
    }
}
