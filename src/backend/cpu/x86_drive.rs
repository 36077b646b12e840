//! The quantized decode kernels' one driver, generic over the instruction
//! set ([`Lanes`]): `x86_avx2` (eight lanes, one weight row a register)
//! and `x86_avx512` (sixteen lanes, two weight rows a register) supply
//! only their intrinsics, and this module the rest: the loop over weight
//! rows and blocks, the scale and offset arithmetic of each block type,
//! the scale widening, the prefetches and the tiling of the output.
//!
//! Every lane runs the same chain whatever the instruction set: a weight
//! row's value is made by the scalar definition's operations in its order
//! (`backend::quant`), then multiplied into one accumulator per pair of
//! rows in chunk order, then reduced by the lane tree of `x86::tree`. The
//! chain `Avx2::tile` runs over the dequantized rows, so the fused matmul
//! gives the same bits as the f32 tiles, on either instruction set.
//!
//! Nothing here carries a target feature: every function is
//! `#[inline(always)]` into the `#[target_feature]` entry points that
//! [`entry_points`] writes in each instruction set's module, where the
//! intrinsics inline.

use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
use std::ops::Range;

use crate::backend::cpu::kernel::SplitBlock;
use crate::backend::cpu::x86_blocks::{
    Decoded, Q4K, Q5_1, Q5K, Q6K, QK, block_bytes, block_values, decode, group, has_offset,
    scale_at, signed,
};
use crate::backend::cpu::x86_quant::{PREFETCH, SCALE_RUN, widen_scales};

/// An instruction set's registers as the quantized kernels use them: one
/// register holds `N` weight rows' eight lanes each (row `h` in lanes
/// `8h..8h + 8`), and an activation chunk is broadcast to every row's
/// lanes.
///
/// Every method is `unsafe`: its caller runs with the instruction set's
/// target features, and pointers point where the method says.
pub(crate) trait Lanes<const N: usize> {
    /// One register.
    type V: Copy;
    /// The eight-lane set, for a weight row left over from the pairs.
    type Single: Store;

    /// Every lane zero.
    unsafe fn zero() -> Self::V;

    /// Row `h`'s lanes all `*s[h]`.
    unsafe fn splat(s: [&f32; N]) -> Self::V;

    /// Row `h`'s lanes: the eight bytes at `q[h]` widened to f32, as `i8`
    /// when `signed`, else as `u8`.
    unsafe fn bytes8(q: [*const u8; N], signed: bool) -> Self::V;

    /// The 32 quants of one split block of each row as f32: Q8_0 (`q8`)
    /// the 32 signed bytes at `q[h]`; Q4_1 the 16 bytes at `q[h]`, value
    /// `j` in the low nibble of byte `j` and `j + 16` in its high nibble.
    /// Register `c` holds row `h`'s values `8c..8c + 8`.
    unsafe fn split_quants(q8: bool, q: [*const u8; N]) -> [Self::V; 4];

    /// `a * b`, each lane rounded once.
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;

    /// `a - b`, each lane rounded once.
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;

    /// `a * b + c` fused.
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;

    /// `x * w + acc` fused, `x` the eight floats at `x` in every row's
    /// lanes.
    unsafe fn fma_x(x: *const f32, w: Self::V, acc: Self::V) -> Self::V;

    /// Each row's lane tree (`x86::tree`).
    unsafe fn sums(v: Self::V) -> [f32; N];
}

/// An eight-lane set that also stores its lanes (the dequantized rows).
pub(crate) trait Store: Lanes<1> {
    /// The eight lanes of `v` at `p`.
    unsafe fn store(p: *mut f32, v: Self::V);
}

/// `[f(0), .., f(N - 1)]`, for the per-row arguments of [`Lanes`].
#[inline(always)]
fn each<T, const N: usize>(f: impl FnMut(usize) -> T) -> [T; N] {
    std::array::from_fn(f)
}

/// Stores the dot products of weight rows `j..` (`sums[r][i]`: row `j + r`
/// with activation row `i`) at `out[(j + r - cols.start) * col_stride + i
/// * row_stride]`.
#[inline(always)]
pub(crate) fn put_sums<const M: usize>(
    out: &mut [f32],
    cols: &Range<usize>,
    j: usize,
    sums: &[[f32; M]],
    (row_stride, col_stride): (usize, usize),
) {
    for (r, s) in sums.iter().enumerate() {
        for (i, v) in s.iter().enumerate() {
            out[(j + r - cols.start) * col_stride + i * row_stride] = *v;
        }
    }
}

/// Each accumulator's lane trees: `[unit][row of the unit][activation
/// row]`.
///
/// # Safety
/// `I`'s features.
#[inline(always)]
unsafe fn lane_sums<I: Lanes<N>, const N: usize, const M: usize, const P: usize>(
    acc: &[[I::V; M]; P],
) -> [[[f32; M]; N]; P] {
    // Loops, not `array::map`: the maps measured 0.87x on Q4_0 decode
    // (their closures kept the reduction out of line).
    let mut sums = [[[0f32; M]; N]; P];
    for (s, a) in sums.iter_mut().zip(acc) {
        for (i, v) in a.iter().enumerate() {
            // SAFETY: the caller runs with `I`'s features.
            let lanes = unsafe { I::sums(*v) };
            for (sh, l) in s.iter_mut().zip(lanes) {
                sh[i] = l;
            }
        }
    }
    sums
}

/// A weight format the driver multiplies: its rows as the kernels take
/// them, and the dot products of `P` units of `N` rows each.
pub(crate) trait Format: Copy {
    /// One weight row.
    type Row<'w>: Copy;

    /// The `M x N x P` dot products of `M` activation rows (`x: [M, k]`)
    /// with the rows of `w`: `[unit][row of the unit][activation row]`.
    ///
    /// # Safety
    /// `I`'s features; every row in `w` holds the format's `k` values and
    /// `x` holds `M` rows of `k` floats (as the entry points check).
    unsafe fn rows<I: Lanes<N>, const N: usize, const M: usize, const P: usize>(
        self,
        x: &[f32],
        k: usize,
        w: [[Self::Row<'_>; N]; P],
    ) -> [[[f32; M]; N]; P];
}

/// Dot products of `M` (1 to 8) activation rows with every weight row `j`
/// in `cols` (`row(j)`), `P` units of `N` rows at a time (independent
/// accumulator chains, so the multiply-adds overlap), then units one at a
/// time, then a row left over by `I::Single`.
/// `out[(j - cols.start) * col_stride + i * row_stride]`.
///
/// # Safety
/// `I`'s features; every row in `cols` holds the format's `k` values, `x`
/// holds `M` rows of `k` floats and `out` every place written (as the
/// entry points check).
#[inline(always)]
pub(crate) unsafe fn matmul_cols<
    'w,
    F: Format,
    I: Lanes<N>,
    const N: usize,
    const M: usize,
    const P: usize,
>(
    format: F,
    x: &[f32],
    k: usize,
    row: impl Fn(usize) -> F::Row<'w>,
    cols: Range<usize>,
    out: &mut [f32],
    strides: (usize, usize),
) {
    let mut j = cols.start;
    while j + N * P <= cols.end {
        let rows: [[F::Row<'w>; N]; P] = each(|p| each(|h| row(j + N * p + h)));
        // SAFETY: the caller's guarantees, for rows inside `cols`.
        let sums = unsafe { format.rows::<I, N, M, P>(x, k, rows) };
        put_sums(out, &cols, j, sums.as_flattened(), strides);
        j += N * P;
    }
    while j + N <= cols.end {
        let rows: [[F::Row<'w>; N]; 1] = [each(|h| row(j + h))];
        // SAFETY: as above.
        let sums = unsafe { format.rows::<I, N, M, 1>(x, k, rows) };
        put_sums(out, &cols, j, sums.as_flattened(), strides);
        j += N;
    }
    for j in j..cols.end {
        // SAFETY: as above; `I::Single`'s features come with `I`'s.
        let sums = unsafe { format.rows::<I::Single, 1, M, 1>(x, k, [[row(j)]]) };
        put_sums(out, &cols, j, sums.as_flattened(), strides);
    }
}

/// Rows of whole blocks of type `T` (`x86_blocks`' codes), each 256 values
/// [`decode`]d onto the stack and made eight lanes at a time by
/// [`chunk`].
#[derive(Clone, Copy)]
pub(crate) struct Blocks<const T: u8>;

/// Rows of split Q8_0 (`Q8`) or Q4_1 blocks (`quant::SplitQuant`), `blocks`
/// a row, dequantized in registers.
#[derive(Clone, Copy)]
pub(crate) struct Split<const Q8: bool> {
    pub(crate) blocks: usize,
}

/// The scales (and offsets) of one run of 32 values of `N` decoded
/// groups, each widened across its row's lanes once a run: at most two
/// scales a run (Q6_K's change every 16).
struct RunScales<V> {
    /// The run's scales, from index `i0` of [`Decoded::p`].
    s: [V; 2],
    /// The run's offset, for the types that have one.
    m: V,
    i0: usize,
}

/// Run `run`'s [`RunScales`] of the groups `d`.
///
/// # Safety
/// `I`'s features; `run < 8`.
#[inline(always)]
unsafe fn run_scales<I: Lanes<N>, const N: usize, const T: u8>(
    d: &[Decoded; N],
    run: usize,
) -> RunScales<I::V> {
    let (i0, i1) = (scale_at(T, 4 * run), scale_at(T, 4 * run + 3));
    // SAFETY: the caller's features; indices below 16 (`scale_at` below
    // 8, offsets 8 further).
    unsafe {
        let splat = |i: usize| I::splat(each(|h| &d[h].p[i]));
        let s0 = splat(i0);
        let s = [s0, if i1 == i0 { s0 } else { splat(i1) }];
        let m = if has_offset(T) {
            splat(8 + i0)
        } else {
            I::zero()
        };
        RunScales { s, m, i0 }
    }
}

/// Values `8 * c..8 * c + 8` of each group `d` (chunk `c` of the run
/// whose scales are `s`), as the definition computes them: `d * sc * q -
/// dmin * m` as a multiply then a subtract (Q4_K, Q5_K), `(d * sc) * q`
/// (Q6_K), `q * d` (Q4_0, Q5_0), `q * d + m` fused (Q5_1).
///
/// # Safety
/// `I`'s features; `c < 32`, in the run of `s`.
#[inline(always)]
unsafe fn chunk<I: Lanes<N>, const N: usize, const T: u8>(
    d: &[Decoded; N],
    s: &RunScales<I::V>,
    c: usize,
) -> I::V {
    // SAFETY: the caller's features; the 8-byte loads lie inside each
    // group's `q` (c < 32).
    unsafe {
        let q = I::bytes8(each(|h| d[h].q.as_ptr().add(8 * c)), signed(T));
        let sc = s.s[scale_at(T, c) - s.i0];
        match T {
            Q6K => I::mul(sc, q),
            Q4K | Q5K => I::sub(I::mul(sc, q), s.m),
            Q5_1 => I::fmadd(q, sc, s.m),
            _ => I::mul(q, sc),
        }
    }
}

impl<const T: u8> Format for Blocks<T> {
    type Row<'w> = &'w [u8];

    #[inline(always)]
    unsafe fn rows<I: Lanes<N>, const N: usize, const M: usize, const P: usize>(
        self,
        x: &[f32],
        k: usize,
        w: [[&[u8]; N]; P],
    ) -> [[[f32; M]; N]; P] {
        // SAFETY (whole body): the caller guarantees the features, that
        // each group's blocks lie inside each row, and that x holds M rows
        // of k floats (loads read 8 at `i * k + at + 8 * c`, `8 * c` below
        // the group's values, a multiple of 32).
        unsafe {
            let mut acc = [[I::zero(); M]; P];
            let mut dec = [const { [const { Decoded::new() }; N] }; P];
            for at in (0..k).step_by(QK) {
                let (byte, blocks, values) = group(T, k, at);
                for (unit, d) in w.iter().zip(dec.iter_mut()) {
                    for (r, dr) in unit.iter().zip(d.iter_mut()) {
                        let b = r.as_ptr().add(byte);
                        // A hint: never faults, so it may point past the row.
                        for line in 0..3 {
                            let ahead = b.wrapping_add(PREFETCH + 64 * line);
                            _mm_prefetch::<_MM_HINT_T0>(ahead.cast::<i8>());
                        }
                        decode::<T>(b, blocks, dr);
                    }
                }
                for run in 0..values / 32 {
                    for (a, d) in acc.iter_mut().zip(&dec) {
                        let s = run_scales::<I, N, T>(d, run);
                        for c4 in 0..4 {
                            let c = 4 * run + c4;
                            let wc = chunk::<I, N, T>(d, &s, c);
                            for (i, ai) in a.iter_mut().enumerate() {
                                *ai = I::fma_x(x.as_ptr().add(i * k + at + 8 * c), wc, *ai);
                            }
                        }
                    }
                }
            }
            lane_sums::<I, N, M, P>(&acc)
        }
    }
}

impl<const Q8: bool> Format for Split<Q8> {
    type Row<'w> = (&'w [u8], &'w [u16]);

    #[inline(always)]
    unsafe fn rows<I: Lanes<N>, const N: usize, const M: usize, const P: usize>(
        self,
        x: &[f32],
        k: usize,
        w: [[(&[u8], &[u16]); N]; P],
    ) -> [[[f32; M]; N]; P] {
        let SplitBlock {
            quant_bytes: qb,
            scales: sb,
        } = SplitBlock::of(Q8);
        // SAFETY (whole body): the caller guarantees the features, that
        // block `b < self.blocks` of each row lies inside it (quant loads
        // read inside its `qb` bytes, scale reads inside its `sb` values),
        // and that x holds M rows of k floats (loads read 8 at `i * k + 32
        // * b + 8 * c`, c < 4).
        unsafe {
            let mut acc = [[I::zero(); M]; P];
            let mut scales = [[[0f32; 2 * SCALE_RUN]; N]; P];
            let mut b0 = 0;
            while b0 < self.blocks {
                let run = SCALE_RUN.min(self.blocks - b0);
                for (unit, s) in w.iter().zip(scales.iter_mut()) {
                    for ((_, sc), out) in unit.iter().zip(s.iter_mut()) {
                        widen_scales(sc.as_ptr().add(b0 * sb), run * sb, out.as_mut_ptr());
                    }
                }
                for bi in 0..run {
                    let b = b0 + bi;
                    for (p, a) in acc.iter_mut().enumerate() {
                        let s = &scales[p];
                        let d = I::splat(each(|h| &s[h][bi * sb]));
                        let m = I::splat(each(|h| &s[h][bi * sb + sb - 1]));
                        let at: [*const u8; N] = each(|h| w[p][h].0.as_ptr().add(b * qb));
                        for a in at {
                            // A hint: never faults, so it may point past the row.
                            _mm_prefetch::<_MM_HINT_T0>(a.wrapping_add(PREFETCH).cast::<i8>());
                        }
                        let q = I::split_quants(Q8, at);
                        for (c, qc) in q.into_iter().enumerate() {
                            let wc = if Q8 {
                                I::mul(qc, d)
                            } else {
                                I::fmadd(qc, d, m)
                            };
                            for (i, ai) in a.iter_mut().enumerate() {
                                let xc = x.as_ptr().add(i * k + 32 * b + 8 * c);
                                *ai = I::fma_x(xc, wc, *ai);
                            }
                        }
                    }
                }
                b0 += run;
            }
            lane_sums::<I, N, M, P>(&acc)
        }
    }
}

/// One row of whole blocks of type `T` as f32 into `out`. Returns false,
/// leaving `out` alone, when `out` is not whole blocks or `row` does not
/// hold them.
///
/// # Safety
/// `I`'s features.
#[inline(always)]
pub(crate) unsafe fn dequantize_blocks<I: Store, const T: u8>(row: &[u8], out: &mut [f32]) -> bool {
    let (k, bv) = (out.len(), block_values(T));
    if !k.is_multiple_of(bv) || row.len() < k / bv * block_bytes(T) {
        return false;
    }
    let mut d = [Decoded::new()];
    for at in (0..k).step_by(QK) {
        let (byte, blocks, values) = group(T, k, at);
        // SAFETY: the caller's features; the group's blocks lie inside
        // `row` (checked above); each store writes 8 floats at
        // out[at + 8 * c..], inside the group's values (a multiple of 32).
        unsafe {
            decode::<T>(row.as_ptr().add(byte), blocks, &mut d[0]);
            for run in 0..values / 32 {
                let s = run_scales::<I, 1, T>(&d, run);
                for c in 4 * run..4 * run + 4 {
                    I::store(
                        out.as_mut_ptr().add(at + 8 * c),
                        chunk::<I, 1, T>(&d, &s, c),
                    );
                }
            }
        }
    }
    true
}

/// One split row (`qs`, `scales`, whole blocks of Q8_0 when `q8`, else
/// Q4_1) as f32 into `out`. Returns false, leaving `out` alone, when the
/// slices do not hold `out.len() / 32` blocks.
///
/// # Safety
/// `I`'s features.
#[inline(always)]
pub(crate) unsafe fn dequantize_split<I: Store>(
    q8: bool,
    qs: &[u8],
    scales: &[u16],
    out: &mut [f32],
) -> bool {
    let SplitBlock {
        quant_bytes: qb,
        scales: sb,
    } = SplitBlock::of(q8);
    let blocks = out.len() / 32;
    if !out.len().is_multiple_of(32) || qs.len() < blocks * qb || scales.len() < blocks * sb {
        return false;
    }
    // Scales widened a run of blocks at a time, as in the matmul.
    let mut s = [0f32; 2 * SCALE_RUN];
    for (r, ys) in out.chunks_mut(32 * SCALE_RUN).enumerate() {
        let b0 = r * SCALE_RUN;
        // SAFETY: the caller's features; the run's `ys.len() / 32 <=
        // SCALE_RUN` blocks lie inside `scales` (checked above) and their
        // scales fit `s`.
        unsafe {
            widen_scales(
                scales.as_ptr().add(b0 * sb),
                ys.len() / 32 * sb,
                s.as_mut_ptr(),
            )
        };
        for (bi, y) in ys.chunks_exact_mut(32).enumerate() {
            // SAFETY: the caller's features; block `b0 + bi` lies inside
            // `qs` (checked above); each store writes 8 floats at
            // y[8 * c..], inside the 32-float `y`.
            unsafe {
                let d = I::splat([&s[bi * sb]]);
                let m = I::splat([&s[bi * sb + sb - 1]]);
                let q = I::split_quants(q8, [qs.as_ptr().add((b0 + bi) * qb)]);
                for (c, qc) in q.into_iter().enumerate() {
                    let v = if q8 {
                        I::mul(qc, d)
                    } else {
                        I::fmadd(qc, d, m)
                    };
                    I::store(y.as_mut_ptr().add(8 * c), v);
                }
            }
        }
    }
    true
}

/// The `#[target_feature]` entry points of one instruction set's kernels
/// (its features as a string, its [`Lanes`] type and their `N`): the
/// fused matmuls over block rows (`matmul_cols`) and split rows
/// (`matmul_cols_split`), each instantiating the driver per type so that
/// every kernel is one function with the features on.
macro_rules! entry_points {
    ($features:literal, $lanes:ty, $n:literal) => {
        use std::ops::Range;

        use $crate::backend::cpu::x86_blocks::fits;
        use $crate::backend::cpu::x86_drive::{Blocks, Split, matmul_cols as drive};
        use $crate::backend::cpu::x86_quant::split_blocks;

        /// Dot products of `M` (1 to 8) activation rows (`x: [m, k]`) with
        /// every weight row `j` in `cols` (`row(j)`: its blocks of type
        /// `code`, from `x86_blocks::code`), `P` registers of weight rows
        /// at a time: `out[(j - cols.start) * col_stride + i *
        /// row_stride]`, the bits of the f32 tiles over the dequantized
        /// rows. Returns false (nothing written) for `k` not a whole number
        /// of blocks, or arguments too short for it.
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn matmul_cols<'w, const M: usize, const P: usize>(
            code: u8,
            x: &[f32],
            k: usize,
            row: impl Fn(usize) -> &'w [u8],
            cols: Range<usize>,
            out: &mut [f32],
            row_stride: usize,
            col_stride: usize,
        ) -> bool {
            let strides = (row_stride, col_stride);
            $crate::backend::cpu::x86_blocks::with_type!(code, T => blocks_as::<M, P, T>(x, k, row, cols, out, strides))
        }

        #[target_feature(enable = $features)]
        fn blocks_as<'w, const M: usize, const P: usize, const T: u8>(
            x: &[f32],
            k: usize,
            row: impl Fn(usize) -> &'w [u8],
            cols: Range<usize>,
            out: &mut [f32],
            strides: (usize, usize),
        ) -> bool {
            if !fits::<T>(x.len(), M, k, &row, &cols, out.len(), strides) {
                return false;
            }
            // SAFETY: the lanes' features are enabled on this function;
            // `fits` checked that k is whole blocks, that every row holds
            // them, that x holds M rows of k and that out holds every
            // place written.
            unsafe { drive::<_, $lanes, $n, M, P>(Blocks::<T>, x, k, row, cols, out, strides) };
            true
        }

        /// [`matmul_cols`] over split Q8_0 (`q8`) or Q4_1 weight rows
        /// (`row(j)`: its quants and scales).
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn matmul_cols_split<'w, const M: usize, const P: usize>(
            q8: bool,
            x: &[f32],
            k: usize,
            row: impl Fn(usize) -> (&'w [u8], &'w [u16]),
            cols: Range<usize>,
            out: &mut [f32],
            row_stride: usize,
            col_stride: usize,
        ) -> bool {
            let strides = (row_stride, col_stride);
            let Some(blocks) = split_blocks(q8, x.len(), M, k, &row, &cols, out.len(), strides)
            else {
                return false;
            };
            // SAFETY: `split_blocks` checked that every row holds `blocks`
            // blocks, that x holds M rows of k and that out holds every
            // place written.
            unsafe {
                if q8 {
                    split_as::<M, P, true>(blocks, x, k, row, cols, out, strides)
                } else {
                    split_as::<M, P, false>(blocks, x, k, row, cols, out, strides)
                }
            }
            true
        }

        /// # Safety
        /// Every row in `cols` holds `blocks` blocks, `x` holds `M` rows
        /// of `k = 32 * blocks` floats and `out` every place written.
        #[target_feature(enable = $features)]
        unsafe fn split_as<'w, const M: usize, const P: usize, const Q8: bool>(
            blocks: usize,
            x: &[f32],
            k: usize,
            row: impl Fn(usize) -> (&'w [u8], &'w [u16]),
            cols: Range<usize>,
            out: &mut [f32],
            strides: (usize, usize),
        ) {
            // SAFETY: the lanes' features are enabled on this function;
            // the caller guarantees the rows, x and out.
            unsafe { drive::<_, $lanes, $n, M, P>(Split::<Q8> { blocks }, x, k, row, cols, out, strides) }
        }
    };
}
pub(crate) use entry_points;
