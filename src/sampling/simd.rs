//! A row's weights on the widest vector unit the CPU has.
//!
//! [`super::row`]'s weight is written in plain float and integer lane
//! operations, so the compiler vectorises a loop of it; built for the
//! baseline x86-64 target that is two f64 lanes. The same loop compiled
//! with AVX2 (four lanes) or AVX-512 (eight) gives the same bits: every
//! operation is the same correctly rounded one, and Rust never fuses a
//! multiply into an add, whatever the target features.

use super::row::weight_scaled;

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
