//! The split Q8_0 and Q4_1 rows (`quant::SplitQuant`: quant bytes in one
//! run, f16 scales in another) as the quantized kernels read them: their
//! scales widened by F16C, and the checks every split kernel's safety
//! rests on. The kernels themselves are `x86_drive`'s.

use std::arch::x86_64::{
    __m128i, _mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32, _mm_loadu_si128, _mm256_cvtph_ps,
    _mm256_storeu_ps,
};

use crate::backend::cpu::kernel::SplitBlock;

/// Bytes ahead of the block being decoded that its row's quants are
/// prefetched: a weight matrix streams from memory once per decode step,
/// and the hardware prefetcher alone leaves the loads waiting (measured:
/// 5.1 -> 3.8 ns per Q4_1 block on a 54 MB matrix, one thread).
pub(crate) const PREFETCH: usize = 2048;

/// Blocks whose scales are widened at once, into a buffer on the stack.
pub(crate) const SCALE_RUN: usize = 32;

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
