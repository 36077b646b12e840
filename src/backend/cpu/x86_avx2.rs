//! The quantized kernels on AVX2 + FMA (and F16C): eight lanes a register,
//! one weight row in each, entered only when the CPU has all three
//! (`Isa::Avx2Fma`, and `Isa::Avx512` for what its pairs do not take).
//!
//! Only the intrinsics live here ([`Avx2Lanes`]); the loops, the block
//! types' arithmetic and the tiling are `x86_drive`'s. Widening from memory,
//! not from registers, keeps the shuffle port free: at one activation row a
//! Q4_K matrix in L2 runs at Q4_1's speed (BENCHMARKS.md, CPU round 12).

use std::arch::x86_64::{
    __m128i, __m256, _mm_and_si128, _mm_loadl_epi64, _mm_loadu_si128, _mm_set1_epi8,
    _mm_srli_epi16, _mm_srli_si128, _mm256_broadcast_ss, _mm256_cvtepi8_epi32, _mm256_cvtepi32_ps,
    _mm256_cvtepu8_epi32, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps,
    _mm256_storeu_ps, _mm256_sub_ps,
};

use crate::backend::cpu::x86::tree;
use crate::backend::cpu::x86_blocks::with_type;
use crate::backend::cpu::x86_drive::{Lanes, Store, dequantize_blocks, dequantize_split};

/// AVX2 registers for `x86_drive`: one weight row's eight lanes each.
pub(crate) struct Avx2Lanes;

impl Lanes<1> for Avx2Lanes {
    type V = __m256;
    type Single = Self;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: the caller runs with AVX.
        unsafe { _mm256_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn splat([s]: [&f32; 1]) -> __m256 {
        // SAFETY: the caller runs with AVX; `s` is a reference.
        unsafe { _mm256_broadcast_ss(s) }
    }

    #[inline(always)]
    unsafe fn bytes8([q]: [*const u8; 1], signed: bool) -> __m256 {
        // SAFETY: the caller runs with AVX2 and `q` points at 8 bytes.
        unsafe {
            let bytes = _mm_loadl_epi64(q.cast::<__m128i>());
            _mm256_cvtepi32_ps(if signed {
                _mm256_cvtepi8_epi32(bytes)
            } else {
                _mm256_cvtepu8_epi32(bytes)
            })
        }
    }

    #[inline(always)]
    unsafe fn split_quants(q8: bool, [q]: [*const u8; 1]) -> [__m256; 4] {
        // SAFETY: the caller runs with AVX2 and `q` points at the block's
        // 32 (Q8_0) or 16 (Q4_1) quant bytes; every load reads inside them.
        unsafe {
            let mut v = [_mm256_setzero_ps(); 4];
            if q8 {
                for (c, out) in v.iter_mut().enumerate() {
                    let b = _mm_loadl_epi64(q.add(8 * c).cast::<__m128i>());
                    *out = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                }
            } else {
                let raw = _mm_loadu_si128(q.cast::<__m128i>());
                let mask = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(raw, mask);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
                let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                for (out, p) in v.iter_mut().zip(parts) {
                    *out = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p));
                }
            }
            v
        }
    }

    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller runs with AVX.
        unsafe { _mm256_mul_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller runs with AVX.
        unsafe { _mm256_sub_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: the caller runs with FMA.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }

    #[inline(always)]
    unsafe fn fma_x(x: *const f32, w: __m256, acc: __m256) -> __m256 {
        // SAFETY: the caller runs with AVX and FMA; `x` points at 8 floats.
        unsafe { _mm256_fmadd_ps(_mm256_loadu_ps(x), w, acc) }
    }

    #[inline(always)]
    unsafe fn sums(v: __m256) -> [f32; 1] {
        [tree(v)]
    }
}

impl Store for Avx2Lanes {
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: the caller runs with AVX and `p` has room for 8 floats.
        unsafe { _mm256_storeu_ps(p, v) }
    }
}

crate::backend::cpu::x86_drive::entry_points!("avx2,fma,f16c", Avx2Lanes, 1);

/// One row of whole blocks of type `code` (`x86_blocks::code`) as f32 into
/// `out`. Returns false, leaving `out` alone, when `out` is not whole blocks
/// or `row` does not hold them.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dequantize_row(code: u8, row: &[u8], out: &mut [f32]) -> bool {
    // SAFETY: AVX2, FMA and F16C are enabled on this function.
    with_type!(code, T => unsafe { dequantize_blocks::<Avx2Lanes, T>(row, out) })
}

/// One split row (`qs`, `scales`, whole blocks) as f32 into `out`. Returns
/// false, leaving `out` alone, when the slices do not hold `out.len() / 32`
/// blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dequantize_split_row(q8: bool, qs: &[u8], scales: &[u16], out: &mut [f32]) -> bool {
    // SAFETY: AVX2, FMA and F16C are enabled on this function.
    unsafe { dequantize_split::<Avx2Lanes>(q8, qs, scales, out) }
}
