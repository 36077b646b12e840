//! Attention rows for head_dim 8 on AVX2 + FMA, the head layout known at
//! compile time: the arithmetic of the generic kernel (`x86::attend_row`)
//! in the same order, so the same bits.

use std::arch::x86_64::*;

use crate::backend::AttnShape;
use crate::backend::cpu::attend::{Scratch, as_f32};
use crate::backend::cpu::kernel::LANES;
use crate::backend::cpu::x86::{attend_row, exp8, reduce8};
use crate::kv::LayerView;

/// Whether [`attend_row_hd8`] has a kernel for this head layout.
pub(crate) fn has_hd8_kernel(shape: AttnShape) -> bool {
    shape.head_dim == LANES
        && matches!(
            (shape.n_heads, shape.n_kv_heads),
            (8, 1 | 2 | 4 | 8) | (16, 1 | 2 | 4 | 8 | 16)
        )
}

/// `attention::attend_row` for head_dim 8 and the head layouts of
/// [`has_hd8_kernel`]: the same arithmetic as the generic kernel, in the
/// same order (so the same bits), with the layout known at compile time.
/// (Each kernel is inlined here, where AVX2 is enabled: a function pointer
/// to one would be compiled without it.)
#[target_feature(enable = "avx2,fma")]
pub(crate) fn attend_row_hd8(
    q: &[f32],
    kv: &LayerView<'_>,
    n_keys: usize,
    shape: AttnShape,
    out: &mut [f32],
    s: &mut Scratch,
) {
    match (shape.n_heads, shape.n_kv_heads) {
        (8, 1) => hd8::<8, 1>(q, kv, n_keys, out, s),
        (8, 2) => hd8::<8, 2>(q, kv, n_keys, out, s),
        (8, 4) => hd8::<8, 4>(q, kv, n_keys, out, s),
        (8, 8) => hd8::<8, 8>(q, kv, n_keys, out, s),
        (16, 1) => hd8::<16, 1>(q, kv, n_keys, out, s),
        (16, 2) => hd8::<16, 2>(q, kv, n_keys, out, s),
        (16, 4) => hd8::<16, 4>(q, kv, n_keys, out, s),
        (16, 8) => hd8::<16, 8>(q, kv, n_keys, out, s),
        (16, 16) => hd8::<16, 16>(q, kv, n_keys, out, s),
        _ => attend_row(q, kv, n_keys, shape, out, s),
    }
}

/// One attention row for `NH` query heads over `NKV` KV heads of 8: scores
/// `[n_keys][NH]` (each position's heads reduced together by [`reduce8`],
/// every K slice loaded once for its group), the softmax eight heads per
/// register with positions in order, then the weighted sum of V with one
/// accumulator per head kept in registers across all pages.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // registers indexed by head, in step
fn hd8<const NH: usize, const NKV: usize>(
    q: &[f32],
    kv: &LayerView<'_>,
    n_keys: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
    const HD: usize = LANES;
    let kvd = NKV * HD;
    let group = NH / NKV;
    let hb = NH / LANES;
    let n = n_keys.min(kv.len());
    if n == 0 || kv.kv_dim() != kvd || q.len() < NH * HD || out.len() < NH * HD {
        // Not reachable from the backend (shapes and lengths are checked).
        out.fill(0.0);
        return;
    }
    let ps = kv.page_size().max(1);
    let n_pages = n.div_ceil(ps);
    let Scratch { scores, conv, .. } = s;
    // Grow only, no clearing: every score read below is written first.
    if scores.len() < n * NH {
        scores.resize(n * NH, 0.0);
    }
    let scale = 1.0 / (HD as f32).sqrt();
    // SAFETY (every block below): AVX2 + FMA as for `Avx2::tile`. q holds
    // NH heads of 8 and out NH heads of 8 (checked above); `scores` holds
    // n rows of NH; a page's rows are `kvd` wide and `tn` of them are
    // read, where `tn * kvd <= rows.len()` is checked per page; each head
    // reads its KV head's 8 floats at `(h / group) * 8 < kvd`.
    unsafe {
        let mut qv = [_mm256_setzero_ps(); NH];
        for h in 0..NH {
            // The generic kernel's pre-scaled query (same rounding).
            qv[h] = _mm256_mul_ps(
                _mm256_loadu_ps(q.as_ptr().add(h * HD)),
                _mm256_set1_ps(scale),
            );
        }
        // Scores, and each head's running max (`if x > m { x } else { m }`
        // per lane, as the generic kernel: max_ps returns its second
        // operand unless the first is greater).
        let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); NH];
        for p in 0..n_pages {
            let t0 = p * ps;
            let tn = (n - t0).min(ps);
            let keys = as_f32(kv.keys(p), conv);
            if keys.len() < tn * kvd {
                return out.fill(0.0);
            }
            let kp = keys.as_ptr();
            let sp = scores.as_mut_ptr().add(t0 * NH);
            for t in 0..tn {
                let row = kp.add(t * kvd);
                for b in 0..hb {
                    let mut prod = [_mm256_setzero_ps(); 8];
                    for j in 0..8 {
                        let h = b * 8 + j;
                        prod[j] = _mm256_mul_ps(qv[h], _mm256_loadu_ps(row.add((h / group) * HD)));
                    }
                    let x = reduce8(&prod);
                    m[b] = _mm256_max_ps(x, m[b]);
                    _mm256_storeu_ps(sp.add(t * NH + b * 8), x);
                }
            }
        }
        // exp(score - max): no dependency from one position to the next.
        let sp = scores.as_mut_ptr();
        for t in 0..n {
            for b in 0..hb {
                let at = sp.add(t * NH + b * 8);
                _mm256_storeu_ps(at, exp8(_mm256_sub_ps(_mm256_loadu_ps(at), m[b])));
            }
        }
        // Weighted sum of V, and each head's sum of weights, in position
        // order.
        let mut acc = [_mm256_setzero_ps(); NH];
        let mut sum = [_mm256_setzero_ps(); NH];
        for p in 0..n_pages {
            let t0 = p * ps;
            let tn = (n - t0).min(ps);
            let vals = as_f32(kv.values(p), conv);
            if vals.len() < tn * kvd {
                return out.fill(0.0);
            }
            let vp = vals.as_ptr();
            let wp = scores.as_ptr().add(t0 * NH);
            for t in 0..tn {
                let row = vp.add(t * kvd);
                let w = wp.add(t * NH);
                for b in 0..hb {
                    sum[b] = _mm256_add_ps(sum[b], _mm256_loadu_ps(w.add(b * 8)));
                }
                for h in 0..NH {
                    let v = _mm256_loadu_ps(row.add((h / group) * HD));
                    acc[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*w.add(h)), v, acc[h]);
                }
            }
        }
        let mut inv = [_mm256_setzero_ps(); NH];
        for b in 0..hb {
            inv[b] = _mm256_div_ps(_mm256_set1_ps(1.0), sum[b]);
        }
        let mut invs = [0f32; NH];
        for b in 0..hb {
            _mm256_storeu_ps(invs.as_mut_ptr().add(b * 8), inv[b]);
        }
        for h in 0..NH {
            let r = _mm256_mul_ps(acc[h], _mm256_set1_ps(invs[h]));
            _mm256_storeu_ps(out.as_mut_ptr().add(h * HD), r);
        }
    }
}
