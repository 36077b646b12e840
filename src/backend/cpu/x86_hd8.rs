//! Attention tiles for head_dim 8 on AVX2 + FMA, the head layout known at
//! compile time: the arithmetic of the generic tile kernel (`x86::tile`)
//! in the same order, so the same bits.

use std::arch::x86_64::*;

use crate::backend::AttnShape;
use crate::backend::cpu::attend::{self as attention, Seg, TileKv};
use crate::backend::cpu::kernel::LANES;
use crate::backend::cpu::x86::{Avx2, exp8, reduce8};

/// Whether [`tile_hd8`] has a kernel for this head layout.
pub(crate) fn has_hd8_kernel(shape: AttnShape) -> bool {
    shape.head_dim == LANES
        && matches!(
            (shape.n_heads, shape.n_kv_heads),
            (8, 1 | 2 | 4 | 8) | (16, 1 | 2 | 4 | 8 | 16)
        )
}

/// `attend::tile_with` for head_dim 8 and the head layouts of
/// [`has_hd8_kernel`]: the same arithmetic as the generic kernel, in the
/// same order (so the same bits), with the layout known at compile time.
/// (Each kernel is inlined here, where AVX2 is enabled: a function pointer
/// to one would be compiled without it.)
#[target_feature(enable = "avx2,fma")]
pub(crate) fn tile_hd8(qs: &[f32], kv: &TileKv<'_>, part: &mut [f32], scores: &mut Vec<f32>) {
    let TileKv { segs, n, shape, .. } = *kv;
    match (shape.n_heads, shape.n_kv_heads) {
        (8, 1) => hd8::<8, 1>(qs, segs, n, part, scores),
        (8, 2) => hd8::<8, 2>(qs, segs, n, part, scores),
        (8, 4) => hd8::<8, 4>(qs, segs, n, part, scores),
        (8, 8) => hd8::<8, 8>(qs, segs, n, part, scores),
        (16, 1) => hd8::<16, 1>(qs, segs, n, part, scores),
        (16, 2) => hd8::<16, 2>(qs, segs, n, part, scores),
        (16, 4) => hd8::<16, 4>(qs, segs, n, part, scores),
        (16, 8) => hd8::<16, 8>(qs, segs, n, part, scores),
        (16, 16) => hd8::<16, 16>(qs, segs, n, part, scores),
        _ => attention::tile_with::<Avx2>(qs, kv, part, scores),
    }
}

/// One tile's partial result for `NH` query heads over `NKV` KV heads of
/// 8: scores `[n][NH]` (each position's heads reduced together by
/// [`reduce8`], every K slice loaded once for its group) with each head's
/// running max, `exp(score - max)` eight heads per register, then each
/// head's sum of weights and weighted sum of V, with one accumulator per
/// head kept in registers across the tile, positions in order.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // registers indexed by head, in step
fn hd8<const NH: usize, const NKV: usize>(
    qs: &[f32],
    segs: &[Seg<'_>],
    n: usize,
    part: &mut [f32],
    scores: &mut Vec<f32>,
) {
    const HD: usize = LANES;
    let kvd = NKV * HD;
    let group = NH / NKV;
    let hb = NH / LANES;
    let have: usize = segs.iter().map(|s| s.n).sum();
    let fits = segs
        .iter()
        .all(|s| s.keys.len() >= s.n * kvd && s.vals.len() >= s.n * kvd);
    if n == 0 || n > have || !fits || qs.len() < NH * HD || part.len() < NH * (HD + 2) {
        // Not reachable from the backend (shapes and lengths are checked).
        part.fill(f32::NAN);
        return;
    }
    // Grow only, no clearing: every score read below is written first.
    if scores.len() < n * NH {
        scores.resize(n * NH, 0.0);
    }
    // SAFETY (every block below): AVX2 + FMA as for `Avx2::tile`. qs holds
    // NH heads of 8 and part NH * 10 floats (checked above); `scores` holds
    // n rows of NH; a segment's rows are `kvd` wide and at most `s.n` of
    // them are read (checked above); each head reads its KV head's 8 floats
    // at `(h / group) * 8 < kvd`.
    unsafe {
        let mut qv = [_mm256_setzero_ps(); NH];
        for h in 0..NH {
            qv[h] = _mm256_loadu_ps(qs.as_ptr().add(h * HD));
        }
        // Scores, and each head's running max (`if x > m { x } else { m }`
        // per lane, as the generic kernel: max_ps returns its second
        // operand unless the first is greater).
        let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); NH];
        let mut t0 = 0;
        for s in segs {
            let tn = s.n.min(n - t0);
            let kp = s.keys.as_ptr();
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
            t0 += tn;
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
        let mut t0 = 0;
        for s in segs {
            let tn = s.n.min(n - t0);
            let vp = s.vals.as_ptr();
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
            t0 += tn;
        }
        let p = part.as_mut_ptr();
        for b in 0..hb {
            _mm256_storeu_ps(p.add(b * 8), m[b]);
            _mm256_storeu_ps(p.add(NH + b * 8), sum[b]);
        }
        for h in 0..NH {
            _mm256_storeu_ps(p.add(2 * NH + h * HD), acc[h]);
        }
    }
}
