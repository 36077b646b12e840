//! Element-wise and row-wise ops of the CPU backend.

use std::cell::RefCell;

use crate::backend::Rope;
use crate::backend::cpu::Isa;
use crate::backend::cpu::fastmath;
use crate::backend::cpu::kernel::dot;
use crate::backend::{RopeScaling, RopeStyle};

/// `out = x / sqrt(mean(x²) + eps) ⊙ w`, one row.
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (ss + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * inv);
    }
}

/// The cos/sin table of the last positions rotated on this thread: a pass
/// rotates q and k of every layer at the same positions, so the table is
/// computed once per pass, not `2 * n_layers` times.
#[derive(Default)]
struct RopeTable {
    theta: f32,
    scaling: RopeScaling,
    head_dim: usize,
    positions: Vec<usize>,
    /// `[positions.len()][head_dim / 2]` of `(cos, sin)`.
    cs: Vec<(f32, f32)>,
}

thread_local! {
    static ROPE: RefCell<RopeTable> = RefCell::new(RopeTable::default());
}

/// Rotates every head of row `i` of `x` (`[positions.len(), n_heads *
/// head_dim]`) for position `positions[i]`.
pub(crate) fn rope_rows(isa: Isa, x: &mut [f32], positions: &[usize], r: Rope) {
    let half = r.head_dim / 2;
    let width = r.n_heads * r.head_dim;
    ROPE.with(|t| {
        let mut t = t.borrow_mut();
        if t.theta != r.theta
            || t.scaling != r.scaling
            || t.head_dim != r.head_dim
            || t.positions != positions
        {
            t.theta = r.theta;
            t.scaling = r.scaling;
            t.head_dim = r.head_dim;
            t.positions.clear();
            t.positions.extend_from_slice(positions);
            t.cs.clear();
            // One frequency per pair, shared by every position.
            let freqs: Vec<f64> = (0..half).map(|i| r.inv_freq(i)).collect();
            for &pos in positions {
                // Angles in f64: at long positions an f32 product drifts.
                for &f in &freqs {
                    let (s, c) = (pos as f64 * f).sin_cos();
                    t.cs.push((c as f32, s as f32));
                }
            }
        }
        for (row, cs) in x
            .chunks_exact_mut(width)
            .zip(t.cs.chunks_exact(half.max(1)))
        {
            #[cfg(target_arch = "x86_64")]
            if isa.avx2()
                && r.style == RopeStyle::Interleaved
                && crate::backend::cpu::x86::rope_fits(r.head_dim)
            {
                // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the
                // CPU reported AVX2 and FMA.
                unsafe { crate::backend::cpu::x86::rope_interleaved_row(row, r.head_dim, cs) };
                continue;
            }
            let _ = isa;
            for head in row.chunks_exact_mut(r.head_dim) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = match r.style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::Half => (i, i + half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c - x1 * s;
                    head[b] = x0 * s + x1 * c;
                }
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

/// `x *= by`.
pub(crate) fn scale(x: &mut [f32], by: f32) {
    for v in x {
        *v *= by;
    }
}

/// GELU (tanh approximation) gating: `gate = gelu(gate) ⊙ up`, with
/// `gelu(g) = g/2 · (1 + tanh(sqrt(2/π) · (g + 0.044715 g³)))`.
pub(crate) fn gelu_glu(gate: &mut [f32], up: &[f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        let t = (C * (x + 0.044_715 * x * x * x)).tanh();
        *g = 0.5 * x * (1.0 + t) * u;
    }
}

/// `x = cap · tanh(x / cap)`.
pub(crate) fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}
