//! Element-wise and row-wise ops of the CPU backend.

use std::cell::RefCell;

use crate::backend::Rope;
use crate::backend::cpu::fastmath;
use crate::backend::cpu::matmul::dot;
use crate::model::RopeStyle;

/// `out = x / sqrt(mean(x²) + eps) ⊙ w`, one row.
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (ss + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * inv);
    }
}

thread_local! {
    static ROPE: RefCell<Vec<(f32, f32)>> = const { RefCell::new(Vec::new()) };
}

/// Rotates every head of one row for position `pos`.
pub(crate) fn rope_row(x: &mut [f32], pos: usize, r: Rope) {
    let half = r.head_dim / 2;
    ROPE.with(|t| {
        let mut t = t.borrow_mut();
        t.clear();
        // Angles in f64: at long positions an f32 product drifts.
        for i in 0..half {
            let freq = (r.theta as f64).powf(-((2 * i) as f64) / r.head_dim as f64);
            let (s, c) = (pos as f64 * freq).sin_cos();
            t.push((c as f32, s as f32));
        }
        for h in 0..r.n_heads {
            let head = &mut x[h * r.head_dim..(h + 1) * r.head_dim];
            for (i, &(c, s)) in t.iter().enumerate() {
                let (a, b) = match r.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Half => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    })
}

/// `gate = silu(gate) ⊙ up`.
pub(crate) fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let v = *g;
        *g = v / (1.0 + fastmath::exp(-v)) * u;
    }
}
