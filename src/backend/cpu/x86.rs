//! AVX2 + FMA kernels, entered only when the CPU has both.
//!
//! The kernel type [`Avx2`] is private to this module, so AVX2 instructions
//! can only run inside the `#[target_feature]` entry points below, which a
//! `CpuBackend` calls only after `Isa::detect` saw AVX2 and FMA.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_fmadd_ps, _mm256_hadd_ps, _mm256_loadu_ps,
    _mm256_permute2f128_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps,
};

use crate::backend::AttnShape;
use crate::backend::cpu::attention::{self, Scratch};
use crate::backend::cpu::matmul::{Kernel, LANES, matmul_cols_k};
use crate::kv::LayerView;

/// AVX2 + FMA arithmetic: eight lanes per register, fused multiply-add,
/// and the lane tree `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))` for every dot
/// product, whether reduced alone ([`tree`]) or eight at a time
/// ([`reduce8`]).
struct Avx2;

/// The lane tree of one accumulator, in scalar code.
#[inline(always)]
fn tree(v: __m256) -> f32 {
    let mut l = [0f32; LANES];
    // SAFETY: stores 8 floats into an 8-float local; AVX is available in
    // every caller (see `Avx2`).
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), v) };
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// The lane trees of eight accumulators at once: lane `j` of the result is
/// `tree(v[j])`, bit for bit.
#[inline(always)]
fn reduce8(v: &[__m256; 8]) -> __m256 {
    // SAFETY: pure register arithmetic; AVX is available in every caller.
    unsafe {
        let ab = _mm256_hadd_ps(v[0], v[1]);
        let cd = _mm256_hadd_ps(v[2], v[3]);
        let ef = _mm256_hadd_ps(v[4], v[5]);
        let gh = _mm256_hadd_ps(v[6], v[7]);
        let abcd = _mm256_hadd_ps(ab, cd);
        let efgh = _mm256_hadd_ps(ef, gh);
        let lo = _mm256_permute2f128_ps::<0x20>(abcd, efgh);
        let hi = _mm256_permute2f128_ps::<0x31>(abcd, efgh);
        _mm256_add_ps(lo, hi)
    }
}

impl Kernel for Avx2 {
    const FMA: bool = true;

    #[inline(always)]
    fn tile<const M: usize, const N: usize>(
        k: usize,
        x: [&[f32]; M],
        w: [&[f32]; N],
    ) -> [[f32; N]; M] {
        // Bounds: every row holds at least k elements (slicing checks it).
        let x: [&[f32]; M] = x.map(|r| &r[..k]);
        let w: [&[f32]; N] = w.map(|r| &r[..k]);
        let chunks = k / LANES;
        let mut out = [[0f32; N]; M];
        // SAFETY (whole block): the intrinsics need AVX2 + FMA, which every
        // caller of this type has (it is only used inside the
        // `#[target_feature(enable = "avx2,fma")]` functions of this module);
        // loads read `[c * 8, c * 8 + 8)` with `c < k / 8`, inside the rows
        // sliced to `k` above; stores write into local arrays of their size.
        unsafe {
            let mut acc: [[__m256; N]; M] = [[_mm256_setzero_ps(); N]; M];
            for c in 0..chunks {
                let o = c * LANES;
                let wv: [__m256; N] =
                    std::array::from_fn(|j| _mm256_loadu_ps(w[j].as_ptr().add(o)));
                for i in 0..M {
                    let xv = _mm256_loadu_ps(x[i].as_ptr().add(o));
                    for j in 0..N {
                        acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
                    }
                }
            }
            if M * N == 8 {
                let flat: [__m256; 8] = std::array::from_fn(|t| acc[t / N][t % N]);
                let mut sums = [0f32; 8];
                _mm256_storeu_ps(sums.as_mut_ptr(), reduce8(&flat));
                for (t, &v) in sums.iter().enumerate() {
                    out[t / N][t % N] = v;
                }
            } else {
                for i in 0..M {
                    for j in 0..N {
                        out[i][j] = tree(acc[i][j]);
                    }
                }
            }
        }
        for i in 0..M {
            for j in 0..N {
                for t in chunks * LANES..k {
                    out[i][j] = x[i][t].mul_add(w[j][t], out[i][j]);
                }
            }
        }
        out
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn scores(
        q: &[f32],
        keys: &[f32],
        tn: usize,
        kvd: usize,
        koff: &[usize],
        hd: usize,
        out: &mut [f32],
    ) {
        let nh = koff.len();
        let chunks = hd / LANES;
        let blocks = if chunks > 0 { nh / 8 } else { 0 };
        let fits = q.len() >= nh * hd
            && keys.len() >= tn * kvd
            && out.len() >= tn * nh
            && koff.iter().all(|&k| k + hd <= kvd);
        if !fits {
            // Not reachable from the backend (shapes are checked); stay safe.
            for t in 0..tn {
                let row = &keys[t * kvd..(t + 1) * kvd];
                for (h, &ko) in koff.iter().enumerate() {
                    out[t * nh + h] = Self::dot(&q[h * hd..(h + 1) * hd], &row[ko..ko + hd]);
                }
            }
            return;
        }
        for hb in 0..blocks {
            let h0 = hb * 8;
            // SAFETY: AVX2 + FMA as for `tile`. `fits` checked above that q
            // holds nh * hd floats, keys tn rows of kvd, out tn rows of nh,
            // and every head's K slice `koff[h] .. koff[h] + hd` lies in a
            // row; loads read `[c * 8, c * 8 + 8)` with `c < hd / 8` inside
            // those slices, the store writes heads `h0 .. h0 + 8 <= nh` of
            // row `t < tn`.
            unsafe {
                let qp = q.as_ptr().add(h0 * hd);
                let ko: [usize; 8] = std::array::from_fn(|j| koff[h0 + j]);
                if chunks == 1 {
                    // One register per head: keep the queries loaded.
                    let qv: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(qp.add(j * hd)));
                    for t in 0..tn {
                        let kp = keys.as_ptr().add(t * kvd);
                        let acc: [__m256; 8] = std::array::from_fn(|j| {
                            _mm256_fmadd_ps(
                                qv[j],
                                _mm256_loadu_ps(kp.add(ko[j])),
                                _mm256_setzero_ps(),
                            )
                        });
                        _mm256_storeu_ps(out.as_mut_ptr().add(t * nh + h0), reduce8(&acc));
                    }
                } else {
                    for t in 0..tn {
                        let kp = keys.as_ptr().add(t * kvd);
                        let mut acc = [_mm256_setzero_ps(); 8];
                        for c in 0..chunks {
                            let o = c * LANES;
                            for j in 0..8 {
                                acc[j] = _mm256_fmadd_ps(
                                    _mm256_loadu_ps(qp.add(j * hd + o)),
                                    _mm256_loadu_ps(kp.add(ko[j] + o)),
                                    acc[j],
                                );
                            }
                        }
                        _mm256_storeu_ps(out.as_mut_ptr().add(t * nh + h0), reduce8(&acc));
                    }
                }
            }
            if !hd.is_multiple_of(LANES) {
                for t in 0..tn {
                    let row = &keys[t * kvd..(t + 1) * kvd];
                    for j in 0..8 {
                        let (qh, kh) = (
                            &q[(h0 + j) * hd..(h0 + j + 1) * hd],
                            &row[koff[h0 + j]..koff[h0 + j] + hd],
                        );
                        let o = &mut out[t * nh + h0 + j];
                        for i in chunks * LANES..hd {
                            *o = qh[i].mul_add(kh[i], *o);
                        }
                    }
                }
            }
        }
        for t in 0..tn {
            let row = &keys[t * kvd..(t + 1) * kvd];
            for h in blocks * 8..nh {
                out[t * nh + h] = Self::tile::<1, 1>(
                    hd,
                    [&q[h * hd..(h + 1) * hd]],
                    [&row[koff[h]..koff[h] + hd]],
                )[0][0];
            }
        }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn weighted_add(
        out: &mut [f32],
        w: &[f32],
        vals: &[f32],
        tn: usize,
        nh: usize,
        kvd: usize,
        koff: &[usize],
        hd: usize,
    ) {
        if !hd.is_multiple_of(LANES) {
            for t in 0..tn {
                let row = &vals[t * kvd..(t + 1) * kvd];
                for (h, &ko) in koff.iter().enumerate().take(nh) {
                    Self::axpy(
                        &mut out[h * hd..(h + 1) * hd],
                        w[t * nh + h],
                        &row[ko..ko + hd],
                    );
                }
            }
            return;
        }
        // Output in 8-float units, up to eight units kept in registers
        // across all positions of the page: the same fused multiply-add per
        // element and position as `axpy`, without a store per position.
        let units = nh * hd / LANES;
        let mut u = 0;
        while u < units {
            let n = (units - u).min(8);
            let a = AvBlock {
                out: &mut *out,
                w,
                vals,
                tn,
                nh,
                kvd,
                koff,
                hd,
                first: u,
            };
            match n {
                8 => a.run::<8>(),
                7 => a.run::<7>(),
                6 => a.run::<6>(),
                5 => a.run::<5>(),
                4 => a.run::<4>(),
                3 => a.run::<3>(),
                2 => a.run::<2>(),
                _ => a.run::<1>(),
            }
            u += n;
        }
    }
}

/// `B` output units of `Avx2::weighted_add`, accumulated in registers.
struct AvBlock<'a> {
    out: &'a mut [f32],
    w: &'a [f32],
    vals: &'a [f32],
    tn: usize,
    nh: usize,
    kvd: usize,
    koff: &'a [usize],
    hd: usize,
    first: usize,
}

impl AvBlock<'_> {
    #[inline(always)]
    fn run<const B: usize>(self) {
        let head: [usize; B] = std::array::from_fn(|j| (self.first + j) * LANES / self.hd);
        let src: [usize; B] =
            std::array::from_fn(|j| self.koff[head[j]] + (self.first + j) * LANES % self.hd);
        let o = &mut self.out[self.first * LANES..(self.first + B) * LANES];
        let fits = self.vals.len() >= self.tn * self.kvd
            && self.w.len() >= self.tn * self.nh
            && (0..B).all(|j| src[j] + LANES <= self.kvd && head[j] < self.nh);
        if !fits {
            // Not reachable from the backend (shapes are checked); stay
            // correct with bounds-checked scalar code.
            for t in 0..self.tn {
                for j in 0..B {
                    let w = self.w[t * self.nh + head[j]];
                    let v = &self.vals[t * self.kvd + src[j]..t * self.kvd + src[j] + LANES];
                    for (o, &x) in o[j * LANES..(j + 1) * LANES].iter_mut().zip(v) {
                        *o = w.mul_add(x, *o);
                    }
                }
            }
            return;
        }
        // SAFETY: AVX2 + FMA as for `tile`. `o` is exactly B * 8 floats;
        // `fits` checked that vals holds tn rows of kvd and w tn rows of nh,
        // that each unit's 8 source floats lie inside a row and its head
        // inside a w row; t < tn.
        unsafe {
            let mut acc: [__m256; B] =
                std::array::from_fn(|j| _mm256_loadu_ps(o.as_ptr().add(j * LANES)));
            for t in 0..self.tn {
                let row = self.vals.as_ptr().add(t * self.kvd);
                let wt = self.w.as_ptr().add(t * self.nh);
                for j in 0..B {
                    let v = _mm256_loadu_ps(row.add(src[j]));
                    acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(*wt.add(head[j])), v, acc[j]);
                }
            }
            for (j, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(j * LANES), *a);
            }
        }
    }
}

/// See `matmul::matmul_cols`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    // Rows left over by 4 use 1 x 8 tiles, whose eight accumulators are
    // reduced together. Blocks of 4 rows: for short dot products (small
    // models) the reduction weighs as much as the multiply-adds, so 4 x 2
    // tiles (reduced together); for long ones 4 x 3 tiles, whose twelve
    // accumulators load fewer bytes per multiply-add. Every tile gives
    // the same bits (same lane tree).
    if k >= 256 {
        matmul_cols_k::<Avx2, 4, 3, 8>(x, m, k, w, cols, out, row_stride, col_stride)
    } else {
        matmul_cols_k::<Avx2, 4, 2, 8>(x, m, k, w, cols, out, row_stride, col_stride)
    }
}

/// See `attention::attend_row`.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn attend_row(
    q: &[f32],
    kv: &LayerView<'_>,
    n_keys: usize,
    shape: AttnShape,
    out: &mut [f32],
    s: &mut Scratch,
) {
    attention::attend_row_with::<Avx2>(q, kv, n_keys, shape, out, s)
}
