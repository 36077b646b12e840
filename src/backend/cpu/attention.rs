//! Paged attention on the CPU: one query row against the written positions
//! of one sequence, streamed page by page through its [`LayerView`].
//!
//! Scores, softmax and the weighted sum run over positions in order, so the
//! result does not depend on the page size, on the batch, or on whether the
//! query came from a prefill or a decode step.

use std::cell::RefCell;

use crate::backend::AttnShape;
use crate::backend::cpu::matmul::dot;
use crate::kv::{KvSlice, LayerView};

/// Per-thread buffers, reused across calls (no allocation per token).
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    conv: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Rows `[tokens_in_page, kv_dim]` as f32, converting when stored narrower.
fn as_f32<'a>(s: KvSlice<'a>, conv: &'a mut Vec<f32>) -> &'a [f32] {
    match s {
        KvSlice::F32(v) => v,
        other => {
            conv.resize(other.len(), 0.0);
            other.to_f32_into(conv);
            conv
        }
    }
}

/// `out[h] = softmax(q[h] · K[0..n_keys]ᵀ / sqrt(d)) · V[0..n_keys]` for
/// every query head `h`, with K/V of the head's group.
pub(crate) fn attend_row(
    q: &[f32],
    kv: &LayerView<'_>,
    n_keys: usize,
    shape: AttnShape,
    out: &mut [f32],
) {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let Scratch { scores, conv } = &mut *s;
        attend_row_with(q, kv, n_keys, shape, out, scores, conv);
    })
}

fn attend_row_with(
    q: &[f32],
    kv: &LayerView<'_>,
    n_keys: usize,
    shape: AttnShape,
    out: &mut [f32],
    scores: &mut Vec<f32>,
    conv: &mut Vec<f32>,
) {
    let hd = shape.head_dim;
    let kvd = shape.kv_dim();
    let group = shape.n_heads / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let ps = kv.page_size();
    let n_pages = n_keys.div_ceil(ps);
    scores.clear();
    scores.resize(shape.n_heads * n_keys, 0.0);

    for p in 0..n_pages {
        let t0 = p * ps;
        let tn = (n_keys - t0).min(ps);
        let keys = as_f32(kv.keys(p), conv);
        for t in 0..tn {
            let row = &keys[t * kvd..(t + 1) * kvd];
            for h in 0..shape.n_heads {
                let kh = h / group;
                scores[h * n_keys + t0 + t] =
                    dot(&q[h * hd..(h + 1) * hd], &row[kh * hd..(kh + 1) * hd]) * scale;
            }
        }
    }
    for h in 0..shape.n_heads {
        softmax(&mut scores[h * n_keys..(h + 1) * n_keys]);
    }
    out.fill(0.0);
    for p in 0..n_pages {
        let t0 = p * ps;
        let tn = (n_keys - t0).min(ps);
        let vals = as_f32(kv.values(p), conv);
        for t in 0..tn {
            let row = &vals[t * kvd..(t + 1) * kvd];
            for h in 0..shape.n_heads {
                let kh = h / group;
                let w = scores[h * n_keys + t0 + t];
                let o = &mut out[h * hd..(h + 1) * hd];
                for (o, v) in o.iter_mut().zip(&row[kh * hd..(kh + 1) * hd]) {
                    *o += w * v;
                }
            }
        }
    }
}

/// In-place softmax in f32, max-subtracted.
pub(crate) fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}
