//! Matmul over weights kept in a ggml block format (a GGUF checkpoint's
//! Q4_1, Q8_0, Q4_K, ...). A tile of weight rows is dequantized into a
//! small cache-resident f32 buffer, exactly as a full dequantization would
//! (same f32 values), and the f32 tiles run over it: every output element
//! is the same fused multiply-add chain and lane tree as with the matrix
//! dequantized up front, so results equal that reference bit for bit and
//! stay independent of the batch. Activations stay f32. For up to eight
//! activation rows (decode), Q8_0 and Q4_1 blocks are dequantized in
//! registers and multiplied at once, by the same operations in the same
//! order: the same bits again.

use std::cell::RefCell;

use crate::backend::QuantMatrix;
use crate::backend::cpu::Isa;
use crate::backend::cpu::kernel::WeightRows;
use crate::backend::cpu::matmul::matmul_cols;

/// Weight rows dequantized per tile: 16 rows of up to a few thousand
/// elements stay within L2 while every activation row reads them.
const ROWS_PER_TILE: usize = 16;

/// Up to this many activation rows (decode steps of small batches), Q8_0
/// and Q4_1 blocks are dequantized in registers and used at once
/// (`x86::matmul_cols_q`): the same bits as the tiles, without writing the
/// f32 rows out. More rows share each dequantized tile instead.
const FUSED_ROWS: usize = 8;

thread_local! {
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `matmul_cols` (see there) for a quantized `w` (`[n, k]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols_quant(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &QuantMatrix,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2Fma && (1..=FUSED_ROWS).contains(&m) {
        use crate::backend::cpu::x86::matmul_cols_q;
        let (ty, row) = (w.ggml_type(), |r: usize| w.row(r));
        let c = cols.clone();
        // SAFETY: a CpuBackend holds `Isa::Avx2Fma` only after the CPU
        // reported AVX2, FMA and F16C (`Isa::detect`).
        let done = unsafe {
            // Weight rows per pass: enough independent chains to hide the
            // multiply-add latency, few enough for the 16 registers.
            match m {
                1 => matmul_cols_q::<1, 8>(ty, x, k, row, c, out, row_stride, col_stride),
                2 => matmul_cols_q::<2, 4>(ty, x, k, row, c, out, row_stride, col_stride),
                3 => matmul_cols_q::<3, 2>(ty, x, k, row, c, out, row_stride, col_stride),
                4 => matmul_cols_q::<4, 2>(ty, x, k, row, c, out, row_stride, col_stride),
                5 => matmul_cols_q::<5, 1>(ty, x, k, row, c, out, row_stride, col_stride),
                6 => matmul_cols_q::<6, 1>(ty, x, k, row, c, out, row_stride, col_stride),
                7 => matmul_cols_q::<7, 1>(ty, x, k, row, c, out, row_stride, col_stride),
                _ => matmul_cols_q::<8, 1>(ty, x, k, row, c, out, row_stride, col_stride),
            }
        };
        if done {
            return;
        }
    }
    TILE.with(|tile| {
        let mut tile = tile.borrow_mut();
        if tile.len() < ROWS_PER_TILE * k {
            tile.resize(ROWS_PER_TILE * k, 0.0);
        }
        let mut j = cols.start;
        while j < cols.end {
            let nr = ROWS_PER_TILE.min(cols.end - j);
            for r in 0..nr {
                dequantize_row(isa, w, j + r, &mut tile[r * k..(r + 1) * k]);
            }
            let o = &mut out[(j - cols.start) * col_stride..];
            let rows = WeightRows::F32(&tile[..nr * k]);
            matmul_cols(isa, x, m, k, rows, 0..nr, o, row_stride, col_stride);
            j += nr;
        }
    });
}

/// Row `r` of `w` as f32, the same values as [`QuantMatrix::dequantize`].
#[inline]
pub(crate) fn dequantize_row(isa: Isa, w: &QuantMatrix, r: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2Fma {
        // SAFETY: a CpuBackend holds `Isa::Avx2Fma` only after the CPU
        // reported AVX2, FMA and F16C (`Isa::detect`).
        if unsafe { crate::backend::cpu::x86::dequantize_row(w.ggml_type(), w.row(r), out) } {
            return;
        }
    }
    let _ = isa;
    w.dequantize_row(r, out);
}
