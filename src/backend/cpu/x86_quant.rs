//! AVX2 + FMA kernels over split Q8_0 and Q4_1 rows (`quant::SplitQuant`:
//! quant bytes in one run, f16 scales in another), entered only when the
//! CPU has AVX2, FMA and F16C.
//!
//! A leaf, as `x86`: rows come in as slices, never as the matrix type.
//! Every value is decoded by [`values`], the operations of the scalar
//! definition (`backend::quant`) in the same order, each rounded once, so
//! the dequantized rows and the fused matmul use the same bits as a matrix
//! dequantized up front.

use std::arch::x86_64::{
    __m128i, __m256, _MM_HINT_T0, _mm_and_si128, _mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32,
    _mm_loadl_epi64, _mm_loadu_si128, _mm_prefetch, _mm_set1_epi8, _mm_srli_epi16, _mm_srli_si128,
    _mm256_broadcast_ss, _mm256_cvtepi8_epi32, _mm256_cvtepi32_ps, _mm256_cvtepu8_epi32,
    _mm256_cvtph_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps,
    _mm256_storeu_ps,
};

use crate::backend::cpu::kernel::SplitBlock;
use crate::backend::cpu::x86::tree;

/// Bytes ahead of the block being decoded that its row's quants are
/// prefetched: a weight matrix streams from memory once per decode step,
/// and the hardware prefetcher alone leaves the loads waiting (measured:
/// 5.1 -> 3.8 ns per Q4_1 block on a 54 MB matrix, one thread).
pub(crate) const PREFETCH: usize = 2048;

/// Blocks whose scales are widened at once, into a buffer on the stack.
pub(crate) const SCALE_RUN: usize = 32;

/// The 32 values of one block, eight lanes at a time: Q8_0 (`q8`) from 32
/// signed bytes at `qs` as `q * d`; Q4_1 from 16 bytes (value `j` in the low
/// nibble of byte `j`, `j + 16` in its high nibble) as `q * d + m` fused.
///
/// # Safety
/// AVX2, FMA and F16C; `qs` points at the block's 32 (Q8_0) or 16 (Q4_1)
/// quant bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values(q8: bool, qs: *const u8, d: __m256, m: __m256) -> [__m256; 4] {
    // SAFETY (whole body): the caller guarantees the features and the
    // block's bytes; every load below reads inside them. No closures: a
    // closure would not inherit the target features, and its intrinsics
    // would not inline.
    unsafe {
        let mut v = [_mm256_setzero_ps(); 4];
        if q8 {
            for (c, out) in v.iter_mut().enumerate() {
                let q = _mm_loadl_epi64(qs.add(8 * c).cast::<__m128i>());
                *out = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
            }
        } else {
            let raw = _mm_loadu_si128(qs.cast::<__m128i>());
            let mask = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(raw, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
            let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
            for (out, p) in v.iter_mut().zip(parts) {
                let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p));
                *out = _mm256_fmadd_ps(q, d, m);
            }
        }
        v
    }
}

/// `n` f16 scales from `src` widened into `out` (exact, as `half`'s
/// conversion), eight at a time by F16C.
///
/// # Safety
/// AVX2 and F16C; `src` holds `n` values and `out` room for them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn widen_scales(src: *const u16, n: usize, out: *mut f32) {
    // SAFETY (whole body): loads read `src[i..i + 8]` with `i + 8 <= n`,
    // then single values below `n`; stores write the same places of `out`.
    unsafe {
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm_loadu_si128(src.add(i).cast::<__m128i>());
            _mm256_storeu_ps(out.add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
        while i < n {
            let h = _mm_cvtsi32_si128(i32::from(*src.add(i)));
            *out.add(i) = _mm_cvtss_f32(_mm_cvtph_ps(h));
            i += 1;
        }
    }
}

/// One split row (`qs`, `scales`, whole blocks) as f32 into `out`. Returns
/// false, leaving `out` alone, when the slices do not hold `out.len() / 32`
/// blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dequantize_row(q8: bool, qs: &[u8], scales: &[u16], out: &mut [f32]) -> bool {
    let SplitBlock {
        quant_bytes: qb,
        scales: sb,
    } = SplitBlock::of(q8);
    let blocks = out.len() / 32;
    if !out.len().is_multiple_of(32) || qs.len() < blocks * qb || scales.len() < blocks * sb {
        return false;
    }
    // Scales widened a run of blocks at a time, as in `split_rows`.
    let mut s = [0f32; 2 * SCALE_RUN];
    for (r, ys) in out.chunks_mut(32 * SCALE_RUN).enumerate() {
        let b0 = r * SCALE_RUN;
        // SAFETY: AVX2 and F16C are enabled on this function; the run's
        // `ys.len() / 32 <= SCALE_RUN` blocks lie inside `scales` (checked
        // above) and their scales fit `s`.
        unsafe {
            widen_scales(
                scales.as_ptr().add(b0 * sb),
                ys.len() / 32 * sb,
                s.as_mut_ptr(),
            )
        };
        for (bi, y) in ys.chunks_exact_mut(32).enumerate() {
            // SAFETY: AVX2, FMA and F16C are enabled on this function;
            // block `b0 + bi` lies inside `qs` (checked above); each store
            // writes 8 floats at y[8 * c..], inside the 32-float `y`.
            unsafe {
                let d = _mm256_broadcast_ss(&s[bi * sb]);
                let m = _mm256_broadcast_ss(&s[bi * sb + sb - 1]);
                let v = values(q8, qs.as_ptr().add((b0 + bi) * qb), d, m);
                for (c, lanes) in v.iter().enumerate() {
                    _mm256_storeu_ps(y.as_mut_ptr().add(8 * c), *lanes);
                }
            }
        }
    }
    true
}

/// Dot products of `M` (1 to 8) activation rows (`x: [m, k]`) with every
/// split weight row `j` in `cols` (`row(j)`: its quants and scales), `R`
/// weight rows at a time (independent accumulator chains, so the
/// multiply-adds overlap). Each block is dequantized in registers by
/// [`values`] and multiplied into one accumulator per pair in chunk order,
/// then reduced by the lane tree of `x86::tree`: the chain `Avx2::tile`
/// runs over the dequantized rows, so the same bits, without writing the
/// f32 rows out and reading them back.
/// `out[(j - cols.start) * col_stride + i * row_stride]`. Returns false
/// (nothing written) for `k` not a whole number of blocks, or rows that do
/// not hold them.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols_split<'w, const M: usize, const R: usize>(
    q8: bool,
    x: &[f32],
    k: usize,
    row: impl Fn(usize) -> (&'w [u8], &'w [u16]),
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) -> bool {
    let Some(blocks) = split_blocks(
        q8,
        x.len(),
        M,
        k,
        &row,
        &cols,
        out.len(),
        (row_stride, col_stride),
    ) else {
        return false;
    };
    let mut put =
        |j: usize, sums: &[[f32; M]]| put_sums(out, &cols, j, sums, (row_stride, col_stride));
    let mut j = cols.start;
    while j + R <= cols.end {
        let rows: [(&[u8], &[u16]); R] = std::array::from_fn(|r| row(j + r));
        // SAFETY: AVX2, FMA and F16C are enabled on this function; the rows
        // and x were checked above as `split_rows` requires.
        put(j, &unsafe {
            if q8 {
                split_rows::<M, R, true>(blocks, x, k, rows)
            } else {
                split_rows::<M, R, false>(blocks, x, k, rows)
            }
        });
        j += R;
    }
    for j in j..cols.end {
        // SAFETY: as above.
        put(j, &unsafe {
            if q8 {
                split_rows::<M, 1, true>(blocks, x, k, [row(j)])
            } else {
                split_rows::<M, 1, false>(blocks, x, k, [row(j)])
            }
        });
    }
    true
}

/// The blocks per row of a split matmul's arguments (`x` of `x_len`
/// floats for `m` rows of `k`; weight rows `cols` through `row`; `out` of
/// `out_len` floats at `strides = (row, col)`), or `None` when `k` is not
/// a whole number of blocks, `x` or `out` is short, or a row does not hold
/// its blocks: the checks every split kernel's safety rests on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn split_blocks<'w>(
    q8: bool,
    x_len: usize,
    m: usize,
    k: usize,
    row: &impl Fn(usize) -> (&'w [u8], &'w [u16]),
    cols: &std::ops::Range<usize>,
    out_len: usize,
    (row_stride, col_stride): (usize, usize),
) -> Option<usize> {
    let SplitBlock {
        quant_bytes: qb,
        scales: sb,
    } = SplitBlock::of(q8);
    if !k.is_multiple_of(32) || m == 0 || x_len < m * k || cols.is_empty() {
        return None;
    }
    let blocks = k / 32;
    let last = (cols.end - 1 - cols.start) * col_stride + (m - 1) * row_stride;
    let short = |j: usize| {
        let (q, s) = row(j);
        q.len() < blocks * qb || s.len() < blocks * sb
    };
    (out_len > last && !cols.clone().any(short)).then_some(blocks)
}

/// Stores the dot products of weight rows `j..` (`sums[r][i]`: row `j + r`
/// with activation row `i`) at `out[(j + r - cols.start) * col_stride + i
/// * row_stride]`.
pub(crate) fn put_sums<const M: usize>(
    out: &mut [f32],
    cols: &std::ops::Range<usize>,
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

/// The `M x R` dot products of [`matmul_cols_split`] for `R` weight rows.
///
/// # Safety
/// AVX2, FMA and F16C; every row in `w` holds `blocks` blocks (quants and
/// scales, as `q8`); `x` holds `M` rows of `k = 32 * blocks` floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn split_rows<const M: usize, const R: usize, const Q8: bool>(
    blocks: usize,
    x: &[f32],
    k: usize,
    w: [(&[u8], &[u16]); R],
) -> [[f32; M]; R] {
    let SplitBlock {
        quant_bytes: qb,
        scales: sb,
    } = SplitBlock::of(Q8);
    // SAFETY (whole body): the caller guarantees the features and that
    // block `b < blocks` of each row lies inside it (quant loads read
    // inside its `qb` bytes, scale reads inside its `sb` values), and that
    // x holds M rows of k floats (loads read 8 at `i * k + 32 * b + 8 * c`,
    // c < 4).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); M]; R];
        let mut scales = [[0f32; 2 * SCALE_RUN]; R];
        let mut b0 = 0;
        while b0 < blocks {
            let run = SCALE_RUN.min(blocks - b0);
            for (r, (_, s)) in w.iter().enumerate() {
                widen_scales(s.as_ptr().add(b0 * sb), run * sb, scales[r].as_mut_ptr());
            }
            for bi in 0..run {
                let b = b0 + bi;
                for r in 0..R {
                    let d = _mm256_broadcast_ss(&scales[r][bi * sb]);
                    let m = _mm256_broadcast_ss(&scales[r][bi * sb + sb - 1]);
                    let at = w[r].0.as_ptr().add(b * qb);
                    // A hint: never faults, so it may point past the row.
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH).cast::<i8>());
                    let wv = values(Q8, at, d, m);
                    for (c, wc) in wv.iter().enumerate() {
                        for (i, a) in acc[r].iter_mut().enumerate() {
                            let xv = _mm256_loadu_ps(x.as_ptr().add(i * k + 32 * b + 8 * c));
                            *a = _mm256_fmadd_ps(xv, *wc, *a);
                        }
                    }
                }
            }
            b0 += run;
        }
        lane_sums(&acc)
    }
}

/// Each accumulator's lane tree (`x86::tree`): `[weight row][activation
/// row]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn lane_sums<const M: usize, const R: usize>(acc: &[[__m256; M]; R]) -> [[f32; M]; R] {
    // Loops, not `array::map`: the maps measured 0.87x on Q4_0 decode
    // (their closures kept the reduction out of line).
    let mut sums = [[0f32; M]; R];
    for (s, a) in sums.iter_mut().zip(acc) {
        for (v, lanes) in s.iter_mut().zip(a) {
            *v = tree(*lanes);
        }
    }
    sums
}
