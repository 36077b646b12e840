//! The quantized kernels on AVX-512 (F, BW, DQ and VL besides AVX2, FMA
//! and F16C: `Isa::Avx512`): two weight rows share each 16-lane register,
//! row `a`'s eight values of a chunk in lanes 0-7 and row `b`'s in lanes
//! 8-15, each activation chunk broadcast to both halves.
//!
//! Only the intrinsics live here ([`Avx512Lanes`]); the loops, the block
//! types' arithmetic and the tiling are `x86_drive`'s, so every lane runs
//! the chain of the eight-lane kernels: the same bits as `Isa::Avx2Fma`,
//! with half the conversion, scaling and multiply-add instructions per
//! weight row. A row left over from the pairs takes the AVX2 lanes.

use std::arch::x86_64::{
    __m128i, __m512, __m512i, _mm_loadl_epi64, _mm_loadu_si128, _mm_unpacklo_epi64,
    _mm256_and_si256, _mm256_broadcast_ss, _mm256_castsi128_si256, _mm256_inserti128_si256,
    _mm256_loadu_ps, _mm256_loadu_si256, _mm256_permute4x64_epi64, _mm256_set1_epi8,
    _mm256_srli_epi16, _mm512_broadcast_f32x8, _mm512_castps256_ps512, _mm512_castps512_ps256,
    _mm512_castsi256_si512, _mm512_castsi512_si128, _mm512_cvtepi8_epi32, _mm512_cvtepi32_ps,
    _mm512_cvtepu8_epi32, _mm512_extractf32x8_ps, _mm512_extracti32x4_epi32, _mm512_fmadd_ps,
    _mm512_insertf32x8, _mm512_inserti64x4, _mm512_mul_ps, _mm512_permutexvar_epi64,
    _mm512_set_epi64, _mm512_setzero_ps, _mm512_sub_ps,
};

use crate::backend::cpu::x86::tree;
use crate::backend::cpu::x86_avx2::Avx2Lanes;
use crate::backend::cpu::x86_drive::Lanes;

/// AVX-512 registers for `x86_drive`: two weight rows' eight lanes each.
pub(crate) struct Avx512Lanes;

/// The four 128-bit lanes of `v`, in order.
#[inline(always)]
unsafe fn quarters(v: __m512i) -> [__m128i; 4] {
    // SAFETY: the caller runs with AVX-512 F.
    unsafe {
        [
            _mm512_castsi512_si128(v),
            _mm512_extracti32x4_epi32::<1>(v),
            _mm512_extracti32x4_epi32::<2>(v),
            _mm512_extracti32x4_epi32::<3>(v),
        ]
    }
}

impl Lanes<2> for Avx512Lanes {
    type V = __m512;
    type Single = Avx2Lanes;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn splat([x, y]: [&f32; 2]) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F and DQ; both are
        // references.
        unsafe {
            let lo = _mm512_castps256_ps512(_mm256_broadcast_ss(x));
            _mm512_insertf32x8::<1>(lo, _mm256_broadcast_ss(y))
        }
    }

    #[inline(always)]
    unsafe fn bytes8([a, b]: [*const u8; 2], signed: bool) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F and both point at 8 bytes.
        unsafe {
            let qa = _mm_loadl_epi64(a.cast::<__m128i>());
            let qb = _mm_loadl_epi64(b.cast::<__m128i>());
            let q = _mm_unpacklo_epi64(qa, qb);
            _mm512_cvtepi32_ps(if signed {
                _mm512_cvtepi8_epi32(q)
            } else {
                _mm512_cvtepu8_epi32(q)
            })
        }
    }

    #[inline(always)]
    unsafe fn split_quants(q8: bool, [qa, qb]: [*const u8; 2]) -> [__m512; 4] {
        // SAFETY: the caller runs with this set's features and both point
        // at their blocks' 32 (Q8_0) or 16 (Q4_1) quant bytes; every load
        // reads inside them.
        unsafe {
            let mut v = [_mm512_setzero_ps(); 4];
            if q8 {
                // 64 bytes [a | b], then 8-byte groups ordered a0 b0 a1 b1
                // ...: 128-bit lane c is [a's bytes 8c.., b's bytes 8c..].
                let a = _mm256_loadu_si256(qa.cast());
                let b = _mm256_loadu_si256(qb.cast());
                let ab = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
                let order: __m512i = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
                let ab = _mm512_permutexvar_epi64(order, ab);
                for (out, p) in v.iter_mut().zip(quarters(ab)) {
                    *out = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(p));
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
                for (out, p) in v.iter_mut().zip(quarters(both)) {
                    *out = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(p));
                }
            }
            v
        }
    }

    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_mul_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_sub_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }

    #[inline(always)]
    unsafe fn fma_x(x: *const f32, w: __m512, acc: __m512) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F and DQ; `x` points at 8
        // floats.
        unsafe { _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(x)), w, acc) }
    }

    #[inline(always)]
    unsafe fn sums(v: __m512) -> [f32; 2] {
        // SAFETY: the caller runs with AVX-512 F and DQ.
        unsafe {
            [
                tree(_mm512_castps512_ps256(v)),
                tree(_mm512_extractf32x8_ps::<1>(v)),
            ]
        }
    }
}

crate::backend::cpu::x86_drive::entry_points!(
    "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl",
    Avx512Lanes,
    2
);
