//! The attention algorithm over any [`Kernel`]: scores, softmax and the
//! weighted sum over positions in order, page by page. A leaf: the
//! instruction-set modules run it with their kernel, and `attention`
//! dispatches to them.

use std::cell::RefCell;

use crate::backend::AttnShape;
use crate::backend::cpu::fastmath;
use crate::backend::cpu::kernel::Kernel;
use crate::kv::{KvSlice, LayerView};

/// Per-thread buffers, reused across calls (no allocation per token).
#[derive(Default)]
pub(crate) struct Scratch {
    /// `[n_keys][n_heads]`: one position's scores for all heads together.
    pub(crate) scores: Vec<f32>,
    /// Per-head running max, then per-head 1/sum.
    head: Vec<f32>,
    /// The query, pre-scaled by 1/sqrt(head_dim).
    q: Vec<f32>,
    /// Per query head, the offset of its KV head in a K/V row.
    koff: Vec<usize>,
    pub(crate) conv: Vec<f32>,
}

thread_local! {
    pub(crate) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Rows `[tokens_in_page, kv_dim]` as f32, converting when stored narrower.
pub(crate) fn as_f32<'a>(s: KvSlice<'a>, conv: &'a mut Vec<f32>) -> &'a [f32] {
    match s {
        KvSlice::F32(v) => v,
        other => {
            conv.resize(other.len(), 0.0);
            other.to_f32_into(conv);
            conv
        }
    }
}

#[inline(always)]
pub(crate) fn attend_row_with<K: Kernel>(
    q: &[f32],
    kv: &LayerView<'_>,
    n_keys: usize,
    shape: AttnShape,
    out: &mut [f32],
    s: &mut Scratch,
) {
    let Scratch {
        scores,
        head,
        q: qs,
        koff,
        conv,
    } = s;
    let nh = shape.n_heads;
    let hd = shape.head_dim;
    let kvd = shape.kv_dim();
    let group = nh / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let ps = kv.page_size();
    let n_pages = n_keys.div_ceil(ps);
    qs.clear();
    qs.extend(q.iter().map(|&x| x * scale));
    // Where each query head's KV head starts in a K row.
    koff.clear();
    koff.extend((0..nh).map(|h| (h / group) * hd));
    scores.clear();
    scores.resize(n_keys * nh, 0.0);

    for p in 0..n_pages {
        let t0 = p * ps;
        let tn = (n_keys - t0).min(ps);
        let keys = as_f32(kv.keys(p), conv);
        K::scores(
            qs,
            keys,
            tn,
            kvd,
            koff,
            hd,
            &mut scores[t0 * nh..(t0 + tn) * nh],
        );
    }
    softmax_columns(scores, nh, head);

    out.fill(0.0);
    for p in 0..n_pages {
        let t0 = p * ps;
        let tn = (n_keys - t0).min(ps);
        let vals = as_f32(kv.values(p), conv);
        let w = &scores[t0 * nh..(t0 + tn) * nh];
        K::weighted_add(out, w, vals, tn, nh, kvd, koff, hd);
    }
    for (o, &inv) in out.chunks_exact_mut(hd).zip(head.iter()) {
        for x in o {
            *x *= inv;
        }
    }
}

/// Per head (column of `scores: [n_keys][nh]`): subtracts the max, takes
/// `exp`, and leaves `1 / sum` in `inv_sum[h]`. Sums run over positions in
/// order. Heads go eight at a time in fixed-size blocks the compiler keeps
/// in registers; a remainder of fewer than eight heads goes one by one.
#[inline(always)]
fn softmax_columns(scores: &mut [f32], nh: usize, inv_sum: &mut Vec<f32>) {
    const B: usize = 8;
    inv_sum.clear();
    inv_sum.resize(nh, 0.0);
    let n = scores.len() / nh;
    let blocks = nh / B;
    for hb in 0..blocks {
        let col = |t: usize| t * nh + hb * B;
        let mut m = [f32::NEG_INFINITY; B];
        for t in 0..n {
            let x = &scores[col(t)..col(t) + B];
            for l in 0..B {
                m[l] = if x[l] > m[l] { x[l] } else { m[l] };
            }
        }
        let mut sum = [0f32; B];
        for t in 0..n {
            let x = &mut scores[col(t)..col(t) + B];
            for l in 0..B {
                x[l] = fastmath::exp(x[l] - m[l]);
                sum[l] += x[l];
            }
        }
        for l in 0..B {
            inv_sum[hb * B + l] = 1.0 / sum[l];
        }
    }
    for h in blocks * B..nh {
        let mut m = f32::NEG_INFINITY;
        for t in 0..n {
            m = m.max(scores[t * nh + h]);
        }
        let mut sum = 0f32;
        for t in 0..n {
            let x = &mut scores[t * nh + h];
            *x = fastmath::exp(*x - m);
            sum += *x;
        }
        inv_sum[h] = 1.0 / sum;
    }
}
