//! The ggml block rows that are not split (`quant::SplitQuant` takes Q8_0
//! and Q4_1), decoded for the quantized kernels with AVX2, FMA and F16C:
//! the K-quants Q4_K, Q5_K and Q6_K (the blocks of llama.cpp's Q4_K_M and
//! Q5_K_M files) and the 32-value Q4_0, Q5_0 and Q5_1 (which those files
//! use where a row is not whole super-blocks).
//!
//! A leaf, as `x86_quant`: rows come in as byte slices of whole blocks,
//! never as the matrix type. A row is taken 256 values at a time (one
//! super-block, or eight 32-value blocks; fewer at a row's end). Each such
//! group is first [`decode`]d onto the stack: its quants as one byte each,
//! in value order, and its scales widened ([`params`]: `d * sc` and
//! `dmin * m` per 32 values for Q4_K/Q5_K, `d * sc` per 16 for Q6_K, each the
//! scalar definition's f32 product; `d` and `m` per block for the others).
//! Then `x86_drive` turns each 8 of them into f32 lanes by the definition's
//! operations in its order (`q * d1 - m1` as a multiply then a subtract;
//! `(d * sc) * q`; `q * d`; `q * d + m` fused for Q5_1), each rounded once.
//! So the dequantized rows and the fused matmul use the same bits as a
//! matrix dequantized up front (`backend::quant`), and the fused matmul's
//! chain is the f32 tile's.

use std::arch::x86_64::*;

use crate::backend::GgmlType;

/// Values per group: a K-quant super-block, or eight 32-value blocks.
pub(crate) const QK: usize = 256;

/// The types these kernels decode, as a const parameter.
pub(crate) const Q4K: u8 = 0;
pub(crate) const Q5K: u8 = 1;
pub(crate) const Q6K: u8 = 2;
pub(crate) const Q4_0: u8 = 3;
pub(crate) const Q5_0: u8 = 4;
pub(crate) const Q5_1: u8 = 5;

/// `ty`'s code for these kernels, when they decode it.
pub(crate) fn code(ty: GgmlType) -> Option<u8> {
    match ty {
        GgmlType::Q4K => Some(Q4K),
        GgmlType::Q5K => Some(Q5K),
        GgmlType::Q6K => Some(Q6K),
        GgmlType::Q4_0 => Some(Q4_0),
        GgmlType::Q5_0 => Some(Q5_0),
        GgmlType::Q5_1 => Some(Q5_1),
        _ => None,
    }
}

/// `$body` with `$t` a const item holding the const parameter of type code
/// `$code` (from [`code`]): the one dispatch from a matrix's type to the
/// kernels' instantiations, for every instruction set (`x86_drive::entry_points`).
macro_rules! with_type {
    ($code:expr, $t:ident => $body:expr) => {{
        use $crate::backend::cpu::x86_blocks as blocks;
        match $code {
            blocks::Q4K => {
                const $t: u8 = blocks::Q4K;
                $body
            }
            blocks::Q5K => {
                const $t: u8 = blocks::Q5K;
                $body
            }
            blocks::Q6K => {
                const $t: u8 = blocks::Q6K;
                $body
            }
            blocks::Q4_0 => {
                const $t: u8 = blocks::Q4_0;
                $body
            }
            blocks::Q5_0 => {
                const $t: u8 = blocks::Q5_0;
                $body
            }
            _ => {
                const $t: u8 = blocks::Q5_1;
                $body
            }
        }
    }};
}
pub(crate) use with_type;

/// Whether type `t` is a K-quant (one 256-value block a group).
const fn k_quant(t: u8) -> bool {
    t <= Q6K
}

/// Bytes of one block of type `t`.
pub(crate) const fn block_bytes(t: u8) -> usize {
    match t {
        Q4K => 144,
        Q5K => 176,
        Q6K => 210,
        Q4_0 => 18,
        Q5_0 => 22,
        _ => 24,
    }
}

/// Values of one block of type `t`.
pub(crate) const fn block_values(t: u8) -> usize {
    if k_quant(t) { QK } else { 32 }
}

/// Whether type `t`'s decoded quants are signed bytes (`q` less the type's
/// offset) rather than unsigned ones.
pub(crate) const fn signed(t: u8) -> bool {
    matches!(t, Q6K | Q4_0 | Q5_0)
}

/// Whether type `t`'s values have an offset besides their scale (in
/// [`Decoded::p`] at `8 +` the scale's index).
pub(crate) const fn has_offset(t: u8) -> bool {
    matches!(t, Q4K | Q5K | Q5_1)
}

/// The index in [`Decoded::p`] of chunk `c`'s scale (its offset, where
/// the type has one, is 8 further): Q6_K's scales change every 16 values,
/// the others' every 32.
pub(crate) const fn scale_at(t: u8, c: usize) -> usize {
    if t == Q6K { c / 2 } else { c / 4 }
}

/// A super-block's widened scales: Q4_K/Q5_K `[d * sc_j; 8]` then
/// `[dmin * m_j; 8]` for its eight runs of 32; Q6_K `d * sc_i` for its
/// sixteen runs of 16. Eight at a time: the 6-bit scales and mins unpacked
/// from their 12 bytes as ggml's `get_scale_min_k4` reads them, each
/// product the scalar definition's f32 multiply.
///
/// # Safety
/// AVX2, FMA and F16C; `b` points at a whole super-block of type `T`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn params<const T: u8>(b: *const u8) -> [f32; 16] {
    // SAFETY (whole body): every read lies inside the block's bytes (the
    // f16 fields at 0..4 or 208..210, the scales at 4..16 or 192..208);
    // stores write inside `p`.
    unsafe {
        let mut p = [0f32; 16];
        if T == Q6K {
            let bits = i32::from(b.add(208).cast::<u16>().read_unaligned());
            let d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
            let sc = _mm_loadu_si128(b.add(192).cast::<__m128i>());
            let lo = _mm256_cvtepi8_epi32(sc);
            let hi = _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc));
            _mm256_storeu_ps(p.as_mut_ptr(), _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
            _mm256_storeu_ps(
                p.as_mut_ptr().add(8),
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)),
            );
        } else {
            let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(b.cast::<i32>().read_unaligned()));
            let d = _mm256_broadcastss_ps(dd);
            let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
            let w = b.add(4).cast::<u32>();
            let (w0, w1, w2) = (
                w.read_unaligned(),
                w.add(1).read_unaligned(),
                w.add(2).read_unaligned(),
            );
            let sc = (w0 & 0x3f3f_3f3f) as u64
                | (((w2 & 0x0f0f_0f0f) | ((w0 >> 2) & 0x3030_3030)) as u64) << 32;
            let m = (w1 & 0x3f3f_3f3f) as u64
                | ((((w2 >> 4) & 0x0f0f_0f0f) | ((w1 >> 2) & 0x3030_3030)) as u64) << 32;
            let sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64));
            let m = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m as i64));
            _mm256_storeu_ps(p.as_mut_ptr(), _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
            _mm256_storeu_ps(
                p.as_mut_ptr().add(8),
                _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)),
            );
        }
        p
    }
}

/// A group decoded for the multiply: its quants as bytes in value order
/// (Q4_K `0..16`, Q5_K and Q5_1 `0..32`; as `i8`, Q6_K `q - 32`, Q4_0
/// `q - 8`, Q5_0 `q - 16`) and its scales (see [`scale_at`]; offsets 8
/// further). On the stack, so that each 8 quants widen straight from memory
/// and each scale broadcasts from it.
#[repr(C, align(32))]
pub(crate) struct Decoded {
    pub(crate) q: [u8; QK],
    pub(crate) p: [f32; 16],
}

impl Decoded {
    pub(crate) const fn new() -> Self {
        Decoded {
            q: [0; QK],
            p: [0.0; 16],
        }
    }
}

/// Decodes the group at `b` of type `T` into `out`: one super-block, or
/// `blocks` (1 to 8) 32-value blocks.
///
/// # Safety
/// AVX2, FMA and F16C; `b` points at a whole super-block of type `T`, or
/// at `blocks` whole blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn decode<const T: u8>(b: *const u8, blocks: usize, out: &mut Decoded) {
    // SAFETY (whole body): each load lies inside the group's blocks (Q4_K:
    // quants at 16..144; Q5_K: high bits at 16..48, quants at 48..176;
    // Q6_K: low bits at 0..128, high bits at 128..192; a 32-value block
    // `i < blocks`: its f16 fields, high bits and 16 quant bytes); each
    // store lies inside `out`.
    unsafe {
        if !k_quant(T) {
            decode_small::<T>(b, blocks, out);
            return;
        }
        out.p = params::<T>(b);
        let low4 = _mm256_set1_epi8(0x0f);
        let load = |at: usize| b.add(at).cast::<__m256i>();
        let q = out.q.as_mut_ptr().cast::<__m256i>();
        if T == Q6K {
            let (two, one) = (_mm256_set1_epi8(3), _mm256_set1_epi8(32));
            for n in 0..2 {
                let ql0 = _mm256_loadu_si256(load(64 * n));
                let ql1 = _mm256_loadu_si256(load(64 * n + 32));
                let qh = _mm256_loadu_si256(load(128 + 32 * n));
                let parts = [
                    (_mm256_and_si256(ql0, low4), qh),
                    (_mm256_and_si256(ql1, low4), _mm256_srli_epi16::<2>(qh)),
                    (
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
                        _mm256_srli_epi16::<4>(qh),
                    ),
                    (
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
                        _mm256_srli_epi16::<6>(qh),
                    ),
                ];
                for (quarter, (lo, hi)) in parts.into_iter().enumerate() {
                    let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(hi, two));
                    let v = _mm256_sub_epi8(_mm256_or_si256(lo, hi), one);
                    _mm256_store_si256(q.add(4 * n + quarter), v);
                }
            }
        } else {
            let base = if T == Q4K { 16 } else { 48 };
            let qh = _mm256_loadu_si256(load(16));
            for g in 0..4 {
                let raw = _mm256_loadu_si256(load(base + 32 * g));
                let mut lo = _mm256_and_si256(raw, low4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low4);
                if T == Q5K {
                    let bit = _mm256_set1_epi8(1);
                    let shift = _mm_cvtsi32_si128(2 * g as i32);
                    let h = _mm256_srl_epi16(qh, shift);
                    let h0 = _mm256_and_si256(h, bit);
                    let h1 = _mm256_and_si256(_mm256_srli_epi16::<1>(h), bit);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(h0));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(h1));
                }
                _mm256_store_si256(q.add(2 * g), lo);
                _mm256_store_si256(q.add(2 * g + 1), hi);
            }
        }
    }
}

/// [`decode`] for the 32-value types: `blocks` (1 to 8) blocks, each's
/// quants as bytes in value order (low nibbles, then high; the fifth bit
/// `j` of its 32-bit field for value `j`), less the type's offset (Q4_0 8,
/// Q5_0 16, as `i8`), its `d` (and Q5_1's `m`) widened.
///
/// # Safety
/// AVX2, FMA and F16C; `b` points at `blocks` whole blocks of type `T`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_small<const T: u8>(b: *const u8, blocks: usize, out: &mut Decoded) {
    // SAFETY (whole body): block `i < blocks` spans `bb` bytes from
    // `b + i * bb`: its f16 fields at 0..4, high bits at 2..6 (Q5_0) or
    // 4..8 (Q5_1) and 16 quant bytes end at its end; stores write
    // `out.q[32 * i..32 * i + 32]` and `out.p` inside their arrays.
    unsafe {
        let bb = block_bytes(T);
        let qs_at = bb - 16;
        let low4 = _mm_set1_epi8(0x0f);
        // Byte `j` of the 32 takes byte `j / 8` of the high bits, then
        // keeps bit `j % 8` of it.
        let spread = _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let (mut d, mut m) = ([0u16; 8], [0u16; 8]);
        for i in 0..blocks {
            let blk = b.add(i * bb);
            d[i] = blk.cast::<u16>().read_unaligned();
            if T == Q5_1 {
                m[i] = blk.add(2).cast::<u16>().read_unaligned();
            }
            let raw = _mm_loadu_si128(blk.add(qs_at).cast::<__m128i>());
            let lo = _mm_and_si128(raw, low4);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), low4);
            let mut v = _mm256_set_m128i(hi, lo);
            if T != Q4_0 {
                let at = if T == Q5_0 { 2 } else { 4 };
                let h = blk.add(at).cast::<i32>().read_unaligned();
                let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(h), spread);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
                v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
            }
            let offset = match T {
                Q4_0 => 8,
                Q5_0 => 16,
                _ => 0,
            };
            v = _mm256_sub_epi8(v, _mm256_set1_epi8(offset));
            _mm256_store_si256(out.q.as_mut_ptr().cast::<__m256i>().add(i), v);
        }
        let widen = |h: &[u16; 8]| _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast::<__m128i>()));
        _mm256_storeu_ps(out.p.as_mut_ptr(), widen(&d));
        if T == Q5_1 {
            _mm256_storeu_ps(out.p.as_mut_ptr().add(8), widen(&m));
        }
    }
}

/// The group of `k`-value rows at value `at` (a multiple of 256): its
/// byte offset in a row, its blocks (1 for a K-quant; up to 8) and its
/// values.
#[inline(always)]
pub(crate) fn group(t: u8, k: usize, at: usize) -> (usize, usize, usize) {
    let values = QK.min(k - at);
    let blocks = values / block_values(t);
    (at / block_values(t) * block_bytes(t), blocks, values)
}

/// Whether a matmul's arguments hold what its kernels read (`x` of `x_len`
/// floats for `m` rows of `k`, `k` whole blocks of type `T`; weight rows
/// `cols` through `row`, each holding them; `out` of `out_len` floats at
/// `strides = (row, col)`): the checks every block kernel's safety rests on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fits<'w, const T: u8>(
    x_len: usize,
    m: usize,
    k: usize,
    row: &impl Fn(usize) -> &'w [u8],
    cols: &std::ops::Range<usize>,
    out_len: usize,
    (row_stride, col_stride): (usize, usize),
) -> bool {
    let bv = block_values(T);
    if !k.is_multiple_of(bv) || m == 0 || x_len < m * k || cols.is_empty() {
        return false;
    }
    let row_bytes = k / bv * block_bytes(T);
    let last = (cols.end - 1 - cols.start) * col_stride + (m - 1) * row_stride;
    out_len > last && !cols.clone().any(|j| row(j).len() < row_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::QuantMatrix;
    use crate::backend::cpu::x86_avx2::{self, dequantize_row};
    use crate::backend::cpu::x86_avx512;
    use crate::backend::quant::scale_fields;

    #[test]
    fn every_block_type_but_the_split_ones_has_a_kernel_with_ggmls_sizes() {
        for ty in GgmlType::every().filter(|t| t.computable()) {
            let split = matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_1);
            let float = scale_fields(ty).is_none();
            match code(ty) {
                Some(t) => {
                    assert!(!split && !float, "{ty} has two fused paths");
                    assert_eq!(block_bytes(t) as u64, ty.block_bytes(), "{ty}");
                    assert_eq!(block_values(t) as u64, ty.block_elems(), "{ty}");
                }
                None => assert!(split || float, "{ty} has no fused CPU kernel"),
            }
        }
    }

    /// `n` rows of `k` values of `ty`: deterministic quants, finite scales.
    fn matrix(ty: GgmlType, n: usize, k: usize) -> QuantMatrix {
        let (bb, be) = (ty.block_bytes() as usize, ty.block_elems() as usize);
        let mut bytes: Vec<u8> = (0..n * k / be * bb)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3])
            .collect();
        for (i, b) in bytes.chunks_exact_mut(bb).enumerate() {
            for &at in scale_fields(ty).unwrap_or(&[]) {
                let v = half::f16::from_f32(0.01 + 0.001 * (i % 7) as f32);
                b[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        QuantMatrix::new("w", ty, n, k, bytes).unwrap()
    }

    #[test]
    fn the_kernels_run_on_whole_blocks_and_refuse_anything_short() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("SKIP: no AVX2, FMA and F16C on this CPU");
            return;
        }
        for ty in GgmlType::every() {
            let Some(t) = code(ty) else { continue };
            // A row ending inside a group where the type allows one.
            let k = if k_quant(t) { 512 } else { 288 };
            let (n, m) = (5, 3);
            let q = matrix(ty, n, k);
            let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
            for r in 0..n {
                let (mut want, mut got) = (vec![0f32; k], vec![0f32; k]);
                q.dequantize_row(r, &mut want);
                // SAFETY: the features were detected above.
                assert!(unsafe { dequantize_row(t, q.row(r), &mut got) }, "{ty}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{ty} row {r}");
            }
            let whole = |j: usize| q.row(j);
            let short = |j: usize| &q.row(j)[..q.row_bytes() - 1];
            let avx512 = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512vl");
            let mut first: Option<Vec<f32>> = None;
            for wide in [false, true].into_iter().filter(|&w| !w || avx512) {
                // Five rows: two pairs of AVX-512 lanes and a row left over.
                fn matmul<'w>(
                    (t, wide, n): (u8, bool, usize),
                    x: &[f32],
                    out: &mut [f32],
                    k: usize,
                    row: &dyn Fn(usize) -> &'w [u8],
                ) -> bool {
                    // SAFETY: the callers detected the features.
                    unsafe {
                        if wide {
                            x86_avx512::matmul_cols::<3, 2>(t, x, k, row, 0..n, out, n, 1)
                        } else {
                            x86_avx2::matmul_cols::<3, 2>(t, x, k, row, 0..n, out, n, 1)
                        }
                    }
                }
                let at = (t, wide, n);
                let mut out = vec![0f32; m * n];
                assert!(matmul(at, &x, &mut out, k, &whole), "{ty}: whole blocks");
                assert!(out.iter().all(|v| v.is_finite() && *v != 0.0), "{ty}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                match &first {
                    Some(narrow) => assert_eq!(bits(&out), bits(narrow), "{ty}: AVX-512 bits"),
                    None => first = Some(out.clone()),
                }
                assert!(
                    !matmul(at, &x, &mut out, k, &short),
                    "{ty}: a row one byte short"
                );
                assert!(
                    !matmul(at, &x, &mut out, k - 1, &whole),
                    "{ty}: k not whole blocks"
                );
                let mut small = vec![0f32; m * n - 1];
                assert!(
                    !matmul(at, &x, &mut small, k, &whole),
                    "{ty}: out too short"
                );
            }
            // SAFETY: as above.
            let dq =
                unsafe { dequantize_row(t, &q.row(0)[..q.row_bytes() - 1], &mut vec![0.0; k]) };
            assert!(!dq, "{ty}: dequantizing a short row");
        }
    }
}
