//! AVX2 + FMA kernels, entered only when the CPU has both.
//!
//! A leaf: it imports the shared kernel pieces (`kernel`, `attend`,
//! `fastmath`), never the modules that dispatch into it.
//!
//! The kernel type [`Avx2`] is private to this module, so AVX2 instructions
//! can only run inside the `#[target_feature]` entry points below, which a
//! `CpuBackend` calls only after `Isa::detect` saw AVX2 and FMA.

use std::arch::x86_64::{
    __m128i, __m256, _mm_loadu_si128, _mm256_add_epi32, _mm256_add_ps, _mm256_broadcast_ss,
    _mm256_castps_si256, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
    _mm256_div_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps,
    _mm256_permute_ps, _mm256_permute2f128_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setr_ps,
    _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_slli_epi32, _mm256_storeu_ps, _mm256_sub_epi32,
    _mm256_sub_ps,
};

use crate::backend::cpu::attend::{self as attention, TileKv};
use crate::backend::cpu::fastmath;
use crate::backend::cpu::kernel::{Elem, ElemKind, Kernel, LANES, PANEL, matmul_cols_k};

/// AVX2 + FMA arithmetic: eight lanes per register, fused multiply-add,
/// and the lane tree `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))` for every dot
/// product, whether reduced alone ([`tree`]) or eight at a time
/// ([`reduce8`]).
pub(crate) struct Avx2;

/// The lane tree of one accumulator, in scalar code.
#[inline(always)]
pub(crate) fn tree(v: __m256) -> f32 {
    let mut l = [0f32; LANES];
    // SAFETY: stores 8 floats into an 8-float local; AVX is available in
    // every caller (see `Avx2`).
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), v) };
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// The lane trees of eight accumulators at once: lane `j` of the result is
/// `tree(v[j])`, bit for bit.
#[inline(always)]
pub(crate) fn reduce8(v: &[__m256; 8]) -> __m256 {
    // SAFETY: pure register arithmetic; AVX is available in every caller.
    unsafe {
        let ab = hadd(v[0], v[1]);
        let cd = hadd(v[2], v[3]);
        let ef = hadd(v[4], v[5]);
        let gh = hadd(v[6], v[7]);
        let abcd = hadd(ab, cd);
        let efgh = hadd(ef, gh);
        let lo = _mm256_permute2f128_ps::<0x20>(abcd, efgh);
        let hi = _mm256_permute2f128_ps::<0x31>(abcd, efgh);
        _mm256_add_ps(lo, hi)
    }
}

/// `_mm256_hadd_ps(a, b)` (`[a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, ...]`)
/// as two single-uop shuffles and an add: the same sums (addition
/// commutes bit for bit), where `vhaddps` costs several uops.
#[inline(always)]
fn hadd(a: __m256, b: __m256) -> __m256 {
    // SAFETY: pure register arithmetic; AVX is available in every caller.
    unsafe {
        let even = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
        let odd = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
        _mm256_add_ps(even, odd)
    }
}

/// Eight weights at `p` as f32 lanes: f32 loaded as is, bf16 widened
/// exactly (zero-extended to 32 bits, shifted into the upper half), f16
/// widened exactly by `vcvtph2ps`.
///
/// # Safety
/// `p` must point to eight readable elements; the caller runs with AVX2
/// and, for f16, F16C.
#[inline(always)]
unsafe fn load8<W: Elem>(p: *const W) -> __m256 {
    // SAFETY: `W` is `f32`, or `Bf16`/`F16` (`#[repr(transparent)]` over
    // `u16`), as `W::KIND` says; the caller guarantees eight readable
    // elements (32 or 16 bytes), AVX2 and F16C.
    unsafe {
        match W::KIND {
            ElemKind::F32 => _mm256_loadu_ps(p.cast::<f32>()),
            ElemKind::Bf16 => {
                let h = _mm_loadu_si128(p.cast::<__m128i>());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
            ElemKind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())),
        }
    }
}

impl Kernel for Avx2 {
    const FMA: bool = true;

    #[inline(always)]
    fn tile<const M: usize, const N: usize, W: Elem>(
        k: usize,
        x: [&[f32]; M],
        w: [&[W]; N],
    ) -> [[f32; N]; M] {
        // Bounds: every row holds at least k elements (slicing checks it).
        let x: [&[f32]; M] = x.map(|r| &r[..k]);
        let w: [&[W]; N] = w.map(|r| &r[..k]);
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
                let wv: [__m256; N] = std::array::from_fn(|j| load8(w[j].as_ptr().add(o)));
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
                    out[i][j] = x[i][t].mul_add(w[j][t].f32(), out[i][j]);
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
                out[t * nh + h] = Self::tile::<1, 1, f32>(
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
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols<W: Elem>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
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
        matmul_cols_k::<Avx2, W, 4, 3, 8>(x, m, k, w, cols, out, row_stride, col_stride)
    } else {
        matmul_cols_k::<Avx2, W, 4, 2, 8>(x, m, k, w, cols, out, row_stride, col_stride)
    }
}

/// See `matmul::matmul_packed`. Tiles of 6 activation rows x 2 panels (12
/// accumulators: each step loads 2 weight registers and broadcasts 6
/// activations); a single row goes in tiles of 1 row x 8 panels.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn matmul_packed(
    x: &[f32],
    m: usize,
    k: usize,
    packed: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let np = n.div_ceil(PANEL);
    if x.len() < m * k || packed.len() < np * k * PANEL || out.len() < m * n {
        // Not reachable from the backend (shapes are checked).
        return;
    }
    let p = Packed { x, k, packed, n };
    let mut i = 0;
    while i + 6 <= m {
        p.band::<6>(i, np, out);
        i += 6;
    }
    match m - i {
        5 => p.band::<5>(i, np, out),
        4 => p.band::<4>(i, np, out),
        3 => p.band::<3>(i, np, out),
        2 => p.band::<2>(i, np, out),
        1 => {
            // One row (single stream): eight panels per tile, so eight
            // independent chains keep both FMA pipes busy.
            let mut j = 0;
            while j < np {
                let nr = (np - j).min(8);
                match nr {
                    8 => p.tile::<1, 8>(i, j, out),
                    7 => p.tile::<1, 7>(i, j, out),
                    6 => p.tile::<1, 6>(i, j, out),
                    5 => p.tile::<1, 5>(i, j, out),
                    4 => p.tile::<1, 4>(i, j, out),
                    3 => p.tile::<1, 3>(i, j, out),
                    2 => p.tile::<1, 2>(i, j, out),
                    _ => p.tile::<1, 1>(i, j, out),
                }
                j += nr;
            }
        }
        _ => {}
    }
}

/// The operands of one `matmul_packed` call (lengths checked there).
struct Packed<'a> {
    x: &'a [f32],
    k: usize,
    packed: &'a [f32],
    n: usize,
}

impl Packed<'_> {
    /// Rows `i0 .. i0 + MR` by every panel, in `MR x 2` tiles (at most 12
    /// accumulators, 2 weight registers and a broadcast: all in the 16
    /// registers, none spilled).
    #[inline(always)]
    fn band<const MR: usize>(&self, i0: usize, np: usize, out: &mut [f32]) {
        let mut j = 0;
        while j + 2 <= np {
            self.tile::<MR, 2>(i0, j, out);
            j += 2;
        }
        if j < np {
            self.tile::<MR, 1>(i0, j, out);
        }
    }

    /// Rows `i0 .. i0 + MR` by panels `p0 .. p0 + NR`.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // registers indexed in step
    fn tile<const MR: usize, const NR: usize>(&self, i0: usize, p0: usize, out: &mut [f32]) {
        let k = self.k;
        // SAFETY: AVX2 + FMA as for `Avx2::tile`. `matmul_packed` checked
        // that x holds m rows of k, packed np panels of k * 8 and out m
        // rows of n; callers pass `i0 + MR <= m` and `p0 + NR <= np`, so
        // loads read row `i0 + i < m` at `t < k` and panel `p0 + r < np` at
        // `t * 8 .. t * 8 + 8`; stores write columns below n of those rows.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); NR]; MR];
            let xp = self.x.as_ptr().add(i0 * k);
            let wp = self.packed.as_ptr().add(p0 * k * PANEL);
            for t in 0..k {
                let mut w = [_mm256_setzero_ps(); NR];
                for r in 0..NR {
                    w[r] = _mm256_loadu_ps(wp.add(r * k * PANEL + t * PANEL));
                }
                for i in 0..MR {
                    let xb = _mm256_broadcast_ss(&*xp.add(i * k + t));
                    for r in 0..NR {
                        acc[i][r] = _mm256_fmadd_ps(xb, w[r], acc[i][r]);
                    }
                }
            }
            for i in 0..MR {
                let row = (i0 + i) * self.n;
                for r in 0..NR {
                    let c = (p0 + r) * PANEL;
                    if c + PANEL <= self.n {
                        _mm256_storeu_ps(out.as_mut_ptr().add(row + c), acc[i][r]);
                    } else {
                        let mut tmp = [0f32; PANEL];
                        _mm256_storeu_ps(tmp.as_mut_ptr(), acc[i][r]);
                        out[row + c..row + self.n].copy_from_slice(&tmp[..self.n - c]);
                    }
                }
            }
        }
    }
}

/// `ops::rms_norm_row` with eight-lane registers: the portable dot
/// product's lanes and reduction (separate multiply and add), then the
/// same scaling, so the same bits.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len().min(w.len()).min(out.len());
    let (x8, xt) = x[..n].as_chunks::<LANES>();
    let mut lanes = [0f32; LANES];
    // SAFETY (both blocks): AVX as for `Avx2::tile`; loads and stores of
    // 8-float arrays.
    unsafe {
        let mut acc = _mm256_setzero_ps();
        for c in x8 {
            let v = _mm256_loadu_ps(c.as_ptr());
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    }
    let mut ss = crate::backend::cpu::kernel::reduce(&lanes);
    for &v in xt {
        ss += v * v;
    }
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    let done = n - n % LANES;
    for ((o, xc), wc) in out[..done]
        .as_chunks_mut::<LANES>()
        .0
        .iter_mut()
        .zip(x8)
        .zip(w[..done].as_chunks::<LANES>().0)
    {
        // SAFETY: see above.
        unsafe {
            let r = _mm256_mul_ps(
                _mm256_loadu_ps(wc.as_ptr()),
                _mm256_mul_ps(_mm256_loadu_ps(xc.as_ptr()), _mm256_set1_ps(inv)),
            );
            _mm256_storeu_ps(o.as_mut_ptr(), r);
        }
    }
    for ((o, &xi), &wi) in out[done..n].iter_mut().zip(&x[done..n]).zip(&w[done..n]) {
        *o = wi * (xi * inv);
    }
}

/// Head dims [`rope_interleaved_row`] takes: whole registers.
pub(crate) fn rope_fits(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(LANES)
}

/// The interleaved (adjacent pairs) rotation of `ops::rope_rows` for one
/// row, every head: `(x0, x1) -> (x0 c - x1 s, x0 s + x1 c)` as
/// `x * [c, c, ..] + swap_pairs(x) * [-s, s, ..]`: the same products, the
/// same (commuted) sums, so the same bits. `cs` holds `head_dim / 2`
/// pairs `(cos, sin)`.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn rope_interleaved_row(row: &mut [f32], head_dim: usize, cs: &[(f32, f32)]) {
    let chunks = head_dim / LANES;
    if !rope_fits(head_dim) || cs.len() < head_dim / 2 {
        return;
    }
    let heads = row.len() / head_dim;
    for j in 0..chunks {
        let p = &cs[4 * j..4 * j + 4];
        // SAFETY: AVX as for `Avx2::tile`; every head's chunk j lies in the
        // row (`h < row.len() / head_dim`, `j < head_dim / 8`).
        unsafe {
            let c = _mm256_setr_ps(
                p[0].0, p[0].0, p[1].0, p[1].0, p[2].0, p[2].0, p[3].0, p[3].0,
            );
            let s = _mm256_setr_ps(
                -p[0].1, p[0].1, -p[1].1, p[1].1, -p[2].1, p[2].1, -p[3].1, p[3].1,
            );
            for h in 0..heads {
                let x = row.as_mut_ptr().add(h * head_dim + j * LANES);
                let v = _mm256_loadu_ps(x);
                let swapped = _mm256_permute_ps::<0b10_11_00_01>(v);
                let r = _mm256_add_ps(_mm256_mul_ps(v, c), _mm256_mul_ps(swapped, s));
                _mm256_storeu_ps(x, r);
            }
        }
    }
}

/// `ops::swiglu` eight lanes at a time: the same operations (through
/// [`exp8`]), so the same bits.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn swiglu(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let (g8, _) = gate[..n].as_chunks_mut::<LANES>();
    let (u8, _) = up[..n].as_chunks::<LANES>();
    for (g, u) in g8.iter_mut().zip(u8) {
        // SAFETY: AVX2 as for `Avx2::tile`; loads and stores of 8-float
        // arrays.
        unsafe {
            let v = _mm256_loadu_ps(g.as_ptr());
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
            let r = _mm256_mul_ps(
                _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0), e)),
                _mm256_loadu_ps(u.as_ptr()),
            );
            _mm256_storeu_ps(g.as_mut_ptr(), r);
        }
    }
    let done = n - n % LANES;
    crate::backend::cpu::ops::swiglu(&mut gate[done..n], &up[done..n]);
}

/// See `attention::tile`.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn tile(qs: &[f32], kv: &TileKv<'_>, part: &mut [f32], scores: &mut Vec<f32>) {
    attention::tile_with::<Avx2>(qs, kv, part, scores)
}

/// See `attention::tile_rows`.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn tile_rows(
    qs: [&[f32]; attention::ROWS],
    kv: &TileKv<'_>,
    parts: [&mut [f32]; attention::ROWS],
    scores: &mut Vec<f32>,
) {
    attention::tile_rows_with::<Avx2>(qs, kv, parts, scores)
}

/// `e^x` on eight lanes: `fastmath::exp`'s operations in its order, so
/// every lane gives its bits.
#[inline(always)]
pub(crate) fn exp8(x: __m256) -> __m256 {
    // SAFETY: pure register arithmetic; AVX2 is available in every caller.
    unsafe {
        let x = _mm256_max_ps(
            _mm256_set1_ps(fastmath::EXP_MIN),
            _mm256_min_ps(_mm256_set1_ps(fastmath::EXP_MAX), x),
        );
        let round = _mm256_set1_ps(fastmath::ROUND);
        let big = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(fastmath::LOG2E)), round);
        let ni = _mm256_sub_epi32(_mm256_castps_si256(big), _mm256_castps_si256(round));
        let n = _mm256_sub_ps(big, round);
        let r = _mm256_sub_ps(
            _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(fastmath::LN2_HI))),
            _mm256_mul_ps(n, _mm256_set1_ps(fastmath::LN2_LO)),
        );
        let mut p = _mm256_set1_ps(fastmath::EXP_POLY[0]);
        for &c in &fastmath::EXP_POLY[1..] {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
        }
        let e = _mm256_add_ps(
            _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
            _mm256_set1_ps(1.0),
        );
        let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(ni, _mm256_set1_epi32(127)));
        _mm256_mul_ps(e, _mm256_castsi256_ps(scale))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::AttnShape;
    use crate::backend::cpu::attend::{TILE, TileBuf, tile_segs};
    use crate::backend::cpu::x86_hd8::{has_hd8_kernel, tile_hd8};
    use crate::ids::RequestId;
    use crate::kv::{KvDtype, KvGeometry};
    use crate::kv::{KvPool, PoolConfig};

    /// Whether the kernels under test can run here; when not, says so (the
    /// test then skips).
    fn avx2_fma() -> bool {
        use std::io::Write;
        let ok = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
        if !ok {
            let _ = writeln!(std::io::stderr(), "skipped: this CPU lacks AVX2+FMA");
        }
        ok
    }

    /// The bit patterns, for comparisons that must be exact.
    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(747796405).wrapping_add(1);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn rms_norm_eight_lanes_gives_the_portable_bits() {
        if !avx2_fma() {
            return;
        }
        for n in [1, 7, 8, 64, 172, 2048 + 3] {
            let x = data(n, 8);
            let w = data(n, 9);
            let mut want = vec![0f32; n];
            crate::backend::cpu::ops::rms_norm_row(&x, &w, 1e-5, &mut want);
            let mut got = vec![f32::NAN; n];
            // SAFETY: AVX2 and FMA were detected above.
            unsafe { rms_norm_row(&x, &w, 1e-5, &mut got) };
            assert_eq!(bits(&got), bits(&want), "n = {n}");
        }
    }

    #[test]
    fn rope_eight_lanes_gives_the_scalar_bits() {
        use crate::backend::Rope;
        use crate::backend::RopeStyle;
        use crate::backend::cpu::{Isa, ops};
        if !avx2_fma() {
            return;
        }
        for (n_heads, head_dim) in [(8, 8), (4, 16), (2, 64)] {
            let r = Rope {
                n_heads,
                head_dim,
                theta: 10000.0,
                style: RopeStyle::Interleaved,
                scaling: crate::backend::RopeScaling::None,
            };
            let positions = [0usize, 1, 7, 300, 5000];
            let x = data(positions.len() * n_heads * head_dim, 11);
            let (mut a, mut b) = (x.clone(), x);
            ops::rope_rows(Isa::Portable, &mut a, &positions, r);
            ops::rope_rows(Isa::Avx2Fma, &mut b, &positions, r);
            assert_eq!(bits(&a), bits(&b), "{n_heads} heads of {head_dim}");
        }
    }

    #[test]
    fn swiglu_eight_lanes_gives_the_scalar_bits() {
        if !avx2_fma() {
            return;
        }
        for n in [0, 1, 7, 8, 172, 175] {
            let mut g = data(n, 3);
            g.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x *= (i % 50) as f32);
            let u = data(n, 4);
            let mut want = g.clone();
            crate::backend::cpu::ops::swiglu(&mut want, &u);
            // SAFETY: AVX2 and FMA were detected above.
            unsafe { swiglu(&mut g, &u) };
            assert_eq!(bits(&g), bits(&want));
        }
    }

    /// The head_dim-8 kernel against the generic AVX2 kernel on random
    /// data: ragged lengths, every tile of each and every query length up
    /// to the tile's written one (prefill rows), page sizes 1, 16 and 64,
    /// f32/f16/bf16/fp8 KV, and every
    /// head layout it has a kernel for. Same arithmetic in the same order:
    /// the same bits.
    #[test]
    fn head_dim_8_kernel_equals_the_generic_kernel() {
        if !avx2_fma() {
            return;
        }
        let layouts = [(8, 4), (8, 1), (8, 2), (8, 8), (16, 2), (16, 16)];
        let mut checked = 0;
        for (li, &(nh, nkv)) in layouts.iter().enumerate() {
            let shape = AttnShape {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: 8,
            };
            assert!(has_hd8_kernel(shape));
            for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
                for page in [1, 16, 64] {
                    let geometry = KvGeometry {
                        n_layers: 1,
                        n_kv_heads: nkv,
                        head_dim: 8,
                        dtype,
                    };
                    let pool = KvPool::new(PoolConfig::new(geometry, page, 300)).unwrap();
                    let lens = [1usize, 7, 33, 100];
                    let kvd = shape.kv_dim();
                    let seqs: Vec<_> = lens
                        .iter()
                        .enumerate()
                        .map(|(i, &len)| {
                            let mut s = pool.reserve(RequestId(i as u64), len).unwrap();
                            let seed = (li * 100 + i) as u32;
                            let k = data(len * kvd, seed);
                            let v = data(len * kvd, seed + 50);
                            s.append(0, &k, &v).unwrap();
                            s
                        })
                        .collect();
                    let reader = pool.reader();
                    for (i, seq) in seqs.iter().enumerate() {
                        let view = reader.seq(seq).unwrap().layer(0).unwrap();
                        // A pre-scaled query and its heads' KV offsets.
                        let qs = data(shape.q_dim(), 7 + i as u32);
                        let koff: Vec<usize> = (0..nh).map(|h| h / (nh / nkv) * 8).collect();
                        for t0 in (0..lens[i]).step_by(TILE) {
                            let mut buf = TileBuf::default();
                            let mut segs = Vec::new();
                            tile_segs(&view, t0, t0 + TILE, &mut buf, &mut segs);
                            let have: usize = segs.iter().map(|s| s.n).sum();
                            assert_eq!(have, (lens[i] - t0).min(TILE));
                            for n in 1..=have {
                                let len = nh * 10;
                                let (mut a, mut b) = (vec![0f32; len], vec![1f32; len]);
                                let (mut sa, mut sb) = (Vec::new(), Vec::new());
                                // SAFETY: AVX2 and FMA were detected above.
                                unsafe {
                                    let kv = TileKv {
                                        koff: &koff,
                                        segs: &segs,
                                        n,
                                        shape,
                                    };
                                    tile(&qs, &kv, &mut a, &mut sa);
                                    tile_hd8(&qs, &kv, &mut b, &mut sb);
                                }
                                assert_eq!(
                                    bits(&a),
                                    bits(&b),
                                    "{nh}/{nkv} heads, {dtype:?}, page {page}, {n} keys from {t0} of {}",
                                    lens[i]
                                );
                                assert!(b.iter().all(|x| x.is_finite()));
                                checked += 1;
                            }
                        }
                    }
                    drop(seqs);
                    assert!(pool.stats().is_full());
                }
            }
        }
        assert_eq!(checked, layouts.len() * 4 * 3 * (1 + 7 + 33 + 100));
    }
}
