//! AVX-512 kernels over split Q8_0 and Q4_1 rows (`quant::SplitQuant`),
//! entered only when the CPU has AVX-512 F, BW, DQ and VL besides AVX2,
//! FMA and F16C (`Isa::Avx512`).
//!
//! Two weight rows share each 16-lane register: lanes 0-7 hold row `a`'s
//! eight values of a chunk, lanes 8-15 row `b`'s, and each activation
//! chunk is broadcast to both halves. Every lane therefore runs exactly the
//! chain of `x86_quant::split_rows` (the same dequantization, one fused
//! multiply-add per chunk in chunk order, the same lane tree at the end):
//! the same bits as `Isa::Avx2Fma`, with half the dequantization and
//! multiply-add instructions per weight row.

use std::arch::x86_64::{
    __m128i, __m512, __m512i, _MM_HINT_T0, _mm_loadu_si128, _mm_prefetch, _mm256_and_si256,
    _mm256_broadcast_ss, _mm256_castsi128_si256, _mm256_inserti128_si256, _mm256_loadu_ps,
    _mm256_loadu_si256, _mm256_permute4x64_epi64, _mm256_set1_epi8, _mm256_srli_epi16,
    _mm512_broadcast_f32x8, _mm512_castps256_ps512, _mm512_castps512_ps256, _mm512_castsi256_si512,
    _mm512_castsi512_si128, _mm512_cvtepi8_epi32, _mm512_cvtepi32_ps, _mm512_cvtepu8_epi32,
    _mm512_extractf32x8_ps, _mm512_extracti32x4_epi32, _mm512_fmadd_ps, _mm512_insertf32x8,
    _mm512_inserti64x4, _mm512_mul_ps, _mm512_permutexvar_epi64, _mm512_set_epi64,
    _mm512_setzero_ps,
};

use crate::backend::cpu::kernel::SplitBlock;
use crate::backend::cpu::x86::tree;
use crate::backend::cpu::x86_quant::{
    PREFETCH, SCALE_RUN, put_sums, split_blocks, split_rows, widen_scales,
};

/// One weight row's quants and scales, as `matmul_cols_split` takes them.
type Row<'w> = (&'w [u8], &'w [u16]);

/// `[x | y]`: `x` in lanes 0-7, `y` in lanes 8-15.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
fn halves(x: f32, y: f32) -> __m512 {
    let lo = _mm512_castps256_ps512(_mm256_broadcast_ss(&x));
    _mm512_insertf32x8::<1>(lo, _mm256_broadcast_ss(&y))
}

/// The 32 values of one block of row `a` and of row `b`, as four 16-lane
/// registers: register `c` holds row `a`'s values `8c..8c + 8` in lanes
/// 0-7 and row `b`'s in lanes 8-15. Q8_0 (`q8`): `q * d`; Q4_1: `q * d + m`
/// fused, as `x86_quant::values` computes each lane.
///
/// # Safety
/// The features of this function; `qa` and `qb` point at their blocks' 32
/// (Q8_0) or 16 (Q4_1) quant bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
unsafe fn pair_values(q8: bool, qa: *const u8, qb: *const u8, d: __m512, m: __m512) -> [__m512; 4] {
    // SAFETY (whole body): the caller guarantees the features and the
    // blocks' bytes; every load below reads inside them.
    unsafe {
        let mut v = [_mm512_setzero_ps(); 4];
        if q8 {
            // 64 bytes [a | b], then 8-byte groups ordered a0 b0 a1 b1 ...:
            // 128-bit lane c is [a's bytes 8c.., b's bytes 8c..].
            let a = _mm256_loadu_si256(qa.cast());
            let b = _mm256_loadu_si256(qb.cast());
            let ab = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
            let order: __m512i = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
            let ab = _mm512_permutexvar_epi64(order, ab);
            let parts: [__m128i; 4] = [
                _mm512_castsi512_si128(ab),
                _mm512_extracti32x4_epi32::<1>(ab),
                _mm512_extracti32x4_epi32::<2>(ab),
                _mm512_extracti32x4_epi32::<3>(ab),
            ];
            for (out, p) in v.iter_mut().zip(parts) {
                *out = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(p)), d);
            }
        } else {
            // [a's 16 bytes | b's 16 bytes], 8-byte groups reordered to
            // a0 b0 a1 b1, then low and high nibbles.
            let a = _mm_loadu_si128(qa.cast());
            let b = _mm_loadu_si128(qb.cast());
            let ab = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b);
            let ab = _mm256_permute4x64_epi64::<0b11_01_10_00>(ab);
            let mask = _mm256_set1_epi8(0x0f);
            let lo = _mm256_and_si256(ab, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(ab), mask);
            let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            let parts: [__m128i; 4] = [
                _mm512_castsi512_si128(both),
                _mm512_extracti32x4_epi32::<1>(both),
                _mm512_extracti32x4_epi32::<2>(both),
                _mm512_extracti32x4_epi32::<3>(both),
            ];
            for (out, p) in v.iter_mut().zip(parts) {
                let q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(p));
                *out = _mm512_fmadd_ps(q, d, m);
            }
        }
        v
    }
}

/// `x86_quant::matmul_cols_split` (same arguments, same results bit for
/// bit), `P` pairs of weight rows at a time; an odd row left at the end
/// takes the AVX2 kernel.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols_split<'w, const M: usize, const P: usize>(
    q8: bool,
    x: &[f32],
    k: usize,
    row: impl Fn(usize) -> Row<'w>,
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
    while j + 2 * P <= cols.end {
        let rows: [[Row<'w>; 2]; P] = std::array::from_fn(|p| [row(j + 2 * p), row(j + 2 * p + 1)]);
        // SAFETY: the features are enabled on this function; the rows and
        // x were checked above as `pair_rows` requires.
        let sums = unsafe {
            if q8 {
                pair_rows::<M, P, true>(blocks, x, k, rows)
            } else {
                pair_rows::<M, P, false>(blocks, x, k, rows)
            }
        };
        put(j, sums.as_flattened());
        j += 2 * P;
    }
    while j + 2 <= cols.end {
        // SAFETY: as above.
        let sums = unsafe {
            if q8 {
                pair_rows::<M, 1, true>(blocks, x, k, [[row(j), row(j + 1)]])
            } else {
                pair_rows::<M, 1, false>(blocks, x, k, [[row(j), row(j + 1)]])
            }
        };
        put(j, sums.as_flattened());
        j += 2;
    }
    if j < cols.end {
        // SAFETY: AVX2, FMA and F16C come with this function's features;
        // the row and x were checked above.
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

/// The `M x 2P` dot products of [`matmul_cols_split`] for `P` pairs of
/// weight rows: `[pair][row of the pair][activation row]`.
///
/// # Safety
/// The features of this function; every row in `w` holds `blocks` blocks
/// (quants and scales, as `Q8`); `x` holds `M` rows of `k = 32 * blocks`
/// floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
unsafe fn pair_rows<const M: usize, const P: usize, const Q8: bool>(
    blocks: usize,
    x: &[f32],
    k: usize,
    w: [[Row<'_>; 2]; P],
) -> [[[f32; M]; 2]; P] {
    let SplitBlock {
        quant_bytes: qb,
        scales: sb,
    } = SplitBlock::of(Q8);
    // SAFETY (whole body): the caller guarantees the features, that block
    // `b < blocks` of each row lies inside it (quant loads read inside its
    // `qb` bytes, scale reads inside its `sb` values), and that x holds M
    // rows of k floats (loads read 8 at `i * k + 32 * b + 8 * c`, c < 4).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); M]; P];
        let mut scales = [[[0f32; 2 * SCALE_RUN]; 2]; P];
        let mut b0 = 0;
        while b0 < blocks {
            let run = SCALE_RUN.min(blocks - b0);
            for (p, pair) in w.iter().enumerate() {
                for (h, (_, s)) in pair.iter().enumerate() {
                    widen_scales(s.as_ptr().add(b0 * sb), run * sb, scales[p][h].as_mut_ptr());
                }
            }
            for bi in 0..run {
                let b = b0 + bi;
                for p in 0..P {
                    let [sa, sbb] = &scales[p];
                    let d = halves(sa[bi * sb], sbb[bi * sb]);
                    let m = halves(sa[bi * sb + sb - 1], sbb[bi * sb + sb - 1]);
                    let at_a = w[p][0].0.as_ptr().add(b * qb);
                    let at_b = w[p][1].0.as_ptr().add(b * qb);
                    // Hints: never fault, so they may point past the rows.
                    _mm_prefetch::<_MM_HINT_T0>(at_a.wrapping_add(PREFETCH).cast::<i8>());
                    _mm_prefetch::<_MM_HINT_T0>(at_b.wrapping_add(PREFETCH).cast::<i8>());
                    let wv = pair_values(Q8, at_a, at_b, d, m);
                    for (c, wc) in wv.iter().enumerate() {
                        for (i, a) in acc[p].iter_mut().enumerate() {
                            let xc = _mm256_loadu_ps(x.as_ptr().add(i * k + 32 * b + 8 * c));
                            *a = _mm512_fmadd_ps(_mm512_broadcast_f32x8(xc), *wc, *a);
                        }
                    }
                }
            }
            b0 += run;
        }
        pair_sums(&acc)
    }
}

/// Each paired accumulator's two lane trees (`x86::tree` per half):
/// `[pair][row of the pair][activation row]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
pub(crate) fn pair_sums<const M: usize, const P: usize>(
    acc: &[[__m512; M]; P],
) -> [[[f32; M]; 2]; P] {
    // Loops, not `array::map`: the maps measured 0.87x on Q4_0 decode
    // (their closures kept the reduction out of line).
    let mut sums = [[[0f32; M]; 2]; P];
    for (s, a) in sums.iter_mut().zip(acc) {
        for (i, v) in a.iter().enumerate() {
            s[0][i] = tree(_mm512_castps512_ps256(*v));
            s[1][i] = tree(_mm512_extractf32x8_ps::<1>(*v));
        }
    }
    sums
}
