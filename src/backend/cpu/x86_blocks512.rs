//! AVX-512 kernels over the block rows `x86_blocks` decodes (Q4_K, Q5_K,
//! Q6_K, Q4_0, Q5_0, Q5_1), entered only when the CPU has AVX-512 F, BW,
//! DQ and VL besides AVX2, FMA and F16C (`Isa::Avx512`).
//!
//! As in `x86_quant512`, two weight rows share each 16-lane register:
//! lanes 0-7 hold row `a`'s eight values of a chunk, lanes 8-15 row `b`'s,
//! and each activation chunk is broadcast to both halves. Each row's group
//! is decoded by `x86_blocks::decode`, and each lane makes its value by the
//! operations of `x86_blocks::chunk` and runs the chain of
//! `x86_blocks::rows_as`: the same bits as `Isa::Avx2Fma`, with half the
//! conversion, scaling and multiply-add instructions per weight row. Taken
//! for five to eight activation rows, where it beats the AVX2 kernel; at
//! one to four rows the pairing's extra shuffles cost more than it saves.

use std::arch::x86_64::*;

use crate::backend::cpu::x86_blocks::{
    Decoded, Q4K, Q5_1, Q5K, Q6K, QK, decode, fits, group, has_offset, rows_as, scale_at, signed,
    with_type,
};
use crate::backend::cpu::x86_quant::{PREFETCH, put_sums};
use crate::backend::cpu::x86_quant512::pair_sums;

/// `[x | y]`: `x` in lanes 0-7, `y` in lanes 8-15.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
fn halves(x: &f32, y: &f32) -> __m512 {
    let lo = _mm512_castps256_ps512(_mm256_broadcast_ss(x));
    _mm512_insertf32x8::<1>(lo, _mm256_broadcast_ss(y))
}

/// Chunk `c`'s quants of both rows (`8 * c..8 * c + 8` of each decoded
/// group) as f32 lanes: row `a`'s in lanes 0-7, row `b`'s in 8-15.
///
/// # Safety
/// The features of this function; `c < 32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
unsafe fn pair_quants<const T: u8>(a: &Decoded, b: &Decoded, c: usize) -> __m512 {
    // SAFETY (whole body): both 8-byte loads lie inside the groups' `q`.
    unsafe {
        let qa = _mm_loadl_epi64(a.q.as_ptr().add(8 * c).cast::<__m128i>());
        let qb = _mm_loadl_epi64(b.q.as_ptr().add(8 * c).cast::<__m128i>());
        let q = _mm_unpacklo_epi64(qa, qb);
        _mm512_cvtepi32_ps(if signed(T) {
            _mm512_cvtepi8_epi32(q)
        } else {
            _mm512_cvtepu8_epi32(q)
        })
    }
}

/// Dot products of `M` (1 to 8) activation rows with every weight row in
/// `cols` (same arguments as `x86_blocks::matmul_cols`, same results bit
/// for bit), `P` pairs of weight rows at a time; an odd row left at the end
/// takes the AVX2 kernel.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols<'w, const M: usize, const P: usize>(
    code: u8,
    x: &[f32],
    k: usize,
    row: impl Fn(usize) -> &'w [u8],
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) -> bool {
    with_type!(code, T => matmul_cols_as::<M, P, T>(x, k, row, cols, out, row_stride, col_stride))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
#[allow(clippy::too_many_arguments)]
fn matmul_cols_as<'w, const M: usize, const P: usize, const T: u8>(
    x: &[f32],
    k: usize,
    row: impl Fn(usize) -> &'w [u8],
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) -> bool {
    let strides = (row_stride, col_stride);
    if !fits::<T>(x.len(), M, k, &row, &cols, out.len(), strides) {
        return false;
    }
    let mut j = cols.start;
    while j + 2 * P <= cols.end {
        let rows: [[&[u8]; 2]; P] = std::array::from_fn(|p| [row(j + 2 * p), row(j + 2 * p + 1)]);
        // SAFETY: the features are enabled on this function; the rows and
        // x were checked above as `pair_rows` requires.
        let sums = unsafe { pair_rows::<M, P, T>(x, k, rows) };
        put_sums(out, &cols, j, sums.as_flattened(), strides);
        j += 2 * P;
    }
    while j + 2 <= cols.end {
        // SAFETY: as above.
        let sums = unsafe { pair_rows::<M, 1, T>(x, k, [[row(j), row(j + 1)]]) };
        put_sums(out, &cols, j, sums.as_flattened(), strides);
        j += 2;
    }
    if j < cols.end {
        // SAFETY: AVX2, FMA and F16C come with this function's features;
        // the row and x were checked above.
        put_sums(
            out,
            &cols,
            j,
            &unsafe { rows_as::<M, 1, T>(x, k, [row(j)]) },
            strides,
        );
    }
    true
}

/// The `M x 2P` dot products of [`matmul_cols`] for `P` pairs of weight
/// rows: `[pair][row of the pair][activation row]`.
///
/// # Safety
/// The features of this function; `k` is whole blocks of type `T` and
/// every row in `w` holds them; `x` holds `M` rows of `k` floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")]
unsafe fn pair_rows<const M: usize, const P: usize, const T: u8>(
    x: &[f32],
    k: usize,
    w: [[&[u8]; 2]; P],
) -> [[[f32; M]; 2]; P] {
    // SAFETY (whole body): the caller guarantees the features, that each
    // group's blocks lie inside each row, and that x holds M rows of k
    // floats (loads read 8 at `i * k + at + 8 * c`, `8 * c` below the
    // group's values); scale reads index `p` below 16 (`scale_at` below
    // 8, offsets 8 further).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); M]; P];
        let mut dec = [const { [const { Decoded::new() }; 2] }; P];
        for at in (0..k).step_by(QK) {
            let (byte, blocks, values) = group(T, k, at);
            for (pair, d) in w.iter().zip(dec.iter_mut()) {
                for (r, dr) in pair.iter().zip(d.iter_mut()) {
                    let b = r.as_ptr().add(byte);
                    // A hint: never faults, so it may point past the row.
                    for line in 0..3 {
                        let ahead = b.wrapping_add(PREFETCH + 64 * line);
                        _mm_prefetch::<_MM_HINT_T0>(ahead.cast::<i8>());
                    }
                    decode::<T>(b, blocks, dr);
                }
            }
            // Runs of 32 values, their scales (and offsets) paired once a
            // run: at most two scales a run (Q6_K's change every 16).
            for run in 0..values / 32 {
                for (a, [da, db]) in acc.iter_mut().zip(&dec) {
                    let pair = |i: usize| halves(&da.p[i], &db.p[i]);
                    let (i0, i1) = (scale_at(T, 4 * run), scale_at(T, 4 * run + 3));
                    let s0 = pair(i0);
                    let s = [s0, if i1 == i0 { s0 } else { pair(i1) }];
                    let m = if has_offset(T) {
                        pair(8 + i0)
                    } else {
                        _mm512_setzero_ps()
                    };
                    for c4 in 0..4 {
                        let c = 4 * run + c4;
                        let q = pair_quants::<T>(da, db, c);
                        let sc = s[scale_at(T, c) - i0];
                        let wc = match T {
                            Q6K => _mm512_mul_ps(sc, q),
                            Q4K | Q5K => _mm512_sub_ps(_mm512_mul_ps(sc, q), m),
                            Q5_1 => _mm512_fmadd_ps(q, sc, m),
                            _ => _mm512_mul_ps(q, sc),
                        };
                        for (i, ai) in a.iter_mut().enumerate() {
                            let xc = _mm256_loadu_ps(x.as_ptr().add(i * k + at + 8 * c));
                            *ai = _mm512_fmadd_ps(_mm512_broadcast_f32x8(xc), wc, *ai);
                        }
                    }
                }
            }
        }
        pair_sums(&acc)
    }
}
