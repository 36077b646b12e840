//! Matmul over weights kept in a ggml block format (a GGUF checkpoint's
//! Q4_1, Q8_0, Q4_K, ...). A tile of weight rows is dequantized into a
//! small cache-resident f32 buffer, exactly as a full dequantization would
//! (same f32 values, [`crate::backend::quant`]), and the f32 tiles run over
//! it: every output element is the same fused multiply-add chain and lane
//! tree as with the matrix dequantized up front, so results equal that
//! reference bit for bit and stay independent of the batch. Activations
//! stay f32.
//!
//! With AVX2, Q8_0 and Q4_1 matrices are kept [`SplitQuant`]: the same
//! bytes, with each row's f16 scales moved out of the blocks into one run
//! of their own, so that a kernel widens a row's scales eight at a time
//! instead of one block at a time. For up to eight activation rows
//! (decode), their blocks are dequantized in registers and multiplied at
//! once (`x86_drive`), by the same operations in the
//! same order: the same bits again. The other types a GGUF holds (Q4_K,
//! Q5_K, Q6_K, Q4_0, Q5_0, Q5_1) stay in their blocks; with AVX2 each 256
//! values of a row are decoded onto the stack and multiplied from there for
//! up to eight activation rows, or fill the tiles for more
//! (`x86_blocks`): the same bits once more.

use std::cell::RefCell;

use crate::backend::cpu::Isa;
use crate::backend::cpu::kernel::{SplitBlock, WeightRows};
use crate::backend::cpu::matmul::matmul_cols;
use crate::backend::quant::{f16_to_f32, q4_1_values, q8_0_values};
use crate::backend::{GgmlType, QuantMatrix};

/// Weight rows dequantized per tile: 16 rows of up to a few thousand
/// elements stay within L2 while every activation row reads them.
const ROWS_PER_TILE: usize = 16;

/// Up to this many activation rows (decode steps of small batches), split
/// Q8_0 and Q4_1 blocks are dequantized in registers and used at once: the
/// same bits as the tiles, without writing the f32 rows out. More rows
/// share each dequantized tile instead.
const FUSED_ROWS: usize = 8;

thread_local! {
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `$f::<M, R>($args)` for `m` activation rows (1 to 8), `R` (weight rows,
/// or pairs of them, per pass) taken from the table by `M`: the one
/// dispatch of every fused kernel's instantiations.
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($m:expr, [$r1:literal, $r2:literal, $r3:literal, $r4:literal, $r5:literal, $r6:literal, $r7:literal, $r8:literal], $f:ident($($a:expr),* $(,)?)) => {
        match $m {
            1 => $f::<1, $r1>($($a),*),
            2 => $f::<2, $r2>($($a),*),
            3 => $f::<3, $r3>($($a),*),
            4 => $f::<4, $r4>($($a),*),
            5 => $f::<5, $r5>($($a),*),
            6 => $f::<6, $r6>($($a),*),
            7 => $f::<7, $r7>($($a),*),
            _ => $f::<8, $r8>($($a),*),
        }
    };
}

/// A Q8_0 or Q4_1 matrix with its scales split from its quants: the
/// blocks' quant bytes in one array (32 bytes a block for Q8_0, 16 for
/// Q4_1, rows one after another) and their f16 scales in another (`d`, or
/// `d, m`, per block). The same bytes as the GGUF blocks, the same values.
#[derive(Clone, Debug)]
pub(crate) struct SplitQuant {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    qs: Vec<u8>,
    scales: Vec<u16>,
}

impl SplitQuant {
    /// `q` split, when it is Q8_0 or Q4_1 (`q` back for the other types).
    /// The quants are moved down inside `q`'s own buffer, which is then
    /// trimmed: no second copy of the matrix is ever held.
    pub(crate) fn split(q: QuantMatrix) -> Result<Self, QuantMatrix> {
        let q8 = match q.ggml_type() {
            GgmlType::Q8_0 => true,
            GgmlType::Q4_1 => false,
            _ => return Err(q),
        };
        let SplitBlock {
            quant_bytes: qb,
            scales: sb,
        } = SplitBlock::of(q8);
        let (ty, rows, cols) = (q.ggml_type(), q.rows(), q.cols());
        let bb = ty.block_bytes() as usize;
        let mut data = q.into_bytes();
        let blocks = data.len() / bb;
        let mut scales = Vec::with_capacity(blocks * sb);
        for i in 0..blocks {
            let at = i * bb;
            for s in data[at..at + 2 * sb].chunks_exact(2) {
                scales.push(u16::from_le_bytes([s[0], s[1]]));
            }
            // Block i's quants land at i * qb, below its own start and
            // above every block already moved: nothing unread is
            // overwritten.
            data.copy_within(at + 2 * sb..at + bb, i * qb);
        }
        data.truncate(blocks * qb);
        data.shrink_to_fit();
        Ok(SplitQuant {
            ty,
            rows,
            cols,
            qs: data,
            scales,
        })
    }

    pub(crate) fn ggml_type(&self) -> GgmlType {
        self.ty
    }

    /// Bytes the two allocations hold (quants and scales), spare capacity
    /// included, as `Backend::mat_bytes` counts.
    pub(crate) fn bytes(&self) -> usize {
        self.qs.capacity() + 2 * self.scales.capacity()
    }

    fn q8(&self) -> bool {
        self.ty == GgmlType::Q8_0
    }

    /// Row `r`'s quant bytes and scales.
    pub(crate) fn row(&self, r: usize) -> (&[u8], &[u16]) {
        let b = SplitBlock::of(self.q8());
        let blocks = self.cols / 32;
        let (qr, sr) = (blocks * b.quant_bytes, blocks * b.scales);
        (
            &self.qs[r * qr..(r + 1) * qr],
            &self.scales[r * sr..(r + 1) * sr],
        )
    }

    /// Row `r` as f32 into `out` (`cols` long): the values of
    /// [`QuantMatrix::dequantize_row`].
    pub(crate) fn dequantize_row(&self, isa: Isa, r: usize, out: &mut [f32]) {
        let (qs, sc) = self.row(r);
        #[cfg(target_arch = "x86_64")]
        if isa.avx2() {
            // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the CPU
            // reported AVX2, FMA and F16C (`Isa::detect`).
            if unsafe {
                crate::backend::cpu::x86_avx2::dequantize_split_row(self.q8(), qs, sc, out)
            } {
                return;
            }
        }
        let _ = isa;
        if self.q8() {
            for ((q, &d), y) in qs.chunks_exact(32).zip(sc).zip(out.chunks_exact_mut(32)) {
                q8_0_values(f16_to_f32(d), q, y);
            }
        } else {
            for ((q, s), y) in qs
                .chunks_exact(16)
                .zip(sc.chunks_exact(2))
                .zip(out.chunks_exact_mut(32))
            {
                q4_1_values(f16_to_f32(s[0]), f16_to_f32(s[1]), q, y);
            }
        }
    }

    /// Every element as f32, row-major.
    pub(crate) fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(Isa::Portable, r, o);
        }
        out
    }
}

/// `matmul_cols` (see there) for a split `w` (`[n, k]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols_split(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &SplitQuant,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && (1..=FUSED_ROWS).contains(&m) {
        use crate::backend::cpu::x86_avx512::matmul_cols_split as fused;
        let (q8, row) = (w.q8(), |r: usize| w.row(r));
        let c = cols.clone();
        // SAFETY: a CpuBackend holds `Isa::Avx512` only after the CPU
        // reported AVX2, FMA, F16C and AVX-512 F, BW, DQ and VL.
        let done = unsafe {
            // Pairs of weight rows per pass: enough independent chains to
            // hide the multiply-add latency, few enough for 32 registers.
            by_rows!(
                m,
                [2, 2, 2, 2, 1, 1, 1, 1],
                fused(q8, x, k, row, c, out, row_stride, col_stride)
            )
        };
        if done {
            return;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() && (1..=FUSED_ROWS).contains(&m) {
        use crate::backend::cpu::x86_avx2::matmul_cols_split as fused;
        let (q8, row) = (w.q8(), |r: usize| w.row(r));
        let c = cols.clone();
        // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the CPU
        // reported AVX2, FMA and F16C (`Isa::detect`).
        let done = unsafe {
            // Weight rows per pass: enough independent chains to hide the
            // multiply-add latency, few enough for the 16 registers.
            by_rows!(
                m,
                [4, 4, 2, 1, 1, 1, 1, 1],
                fused(q8, x, k, row, c, out, row_stride, col_stride)
            )
        };
        if done {
            return;
        }
    }
    tiles(
        isa,
        x,
        m,
        k,
        |r, o| w.dequantize_row(isa, r, o),
        cols,
        out,
        row_stride,
        col_stride,
    );
}

/// `matmul_cols` (see there) for a quantized `w` (`[n, k]`) kept in its
/// GGUF blocks. With AVX2, the types `x86_blocks` decodes (Q4_K, Q5_K,
/// Q6_K, Q4_0, Q5_0, Q5_1) are multiplied from their decoded blocks for up
/// to eight activation rows, and dequantized eight lanes at a time into the
/// tiles for more: the same bits as the tiles over the scalar definition.
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
    if let Some(code) = crate::backend::cpu::x86_blocks::code(w.ggml_type())
        && isa.avx2()
    {
        // Paired rows on AVX-512 from five activation rows, where they
        // beat the AVX2 kernel (1.2-1.35x at eight); below that they lose
        // to it (0.85-0.9x at one and four rows, a matrix in L2/L3).
        if isa == Isa::Avx512 && (5..=FUSED_ROWS).contains(&m) {
            use crate::backend::cpu::x86_avx512::matmul_cols as fused;
            let (row, c) = (|r: usize| w.row(r), cols.clone());
            // SAFETY: a CpuBackend holds `Isa::Avx512` only after the CPU
            // reported AVX2, FMA, F16C and AVX-512 F, BW, DQ and VL.
            let done = unsafe {
                by_rows!(
                    m,
                    [1, 1, 1, 1, 1, 1, 1, 1],
                    fused(code, x, k, row, c, out, row_stride, col_stride)
                )
            };
            if done {
                return;
            }
        }
        if (1..=FUSED_ROWS).contains(&m) {
            use crate::backend::cpu::x86_avx2::matmul_cols as fused;
            let (row, c) = (|r: usize| w.row(r), cols.clone());
            // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the CPU
            // reported AVX2, FMA and F16C (`Isa::detect`).
            let done = unsafe {
                // Weight rows per pass: independent chains to hide the
                // multiply-add latency, within the 16 registers (two at
                // four rows measured 1.5x one on Q6_K; two spill at five).
                by_rows!(
                    m,
                    [4, 4, 2, 2, 1, 1, 1, 1],
                    fused(code, x, k, row, c, out, row_stride, col_stride)
                )
            };
            if done {
                return;
            }
        }
        let row = |r: usize, o: &mut [f32]| {
            // SAFETY: as above.
            let done = unsafe { crate::backend::cpu::x86_avx2::dequantize_row(code, w.row(r), o) };
            if !done {
                w.dequantize_row(r, o);
            }
        };
        tiles(isa, x, m, k, row, cols, out, row_stride, col_stride);
        return;
    }
    let row = |r: usize, o: &mut [f32]| w.dequantize_row(r, o);
    tiles(isa, x, m, k, row, cols, out, row_stride, col_stride);
}

/// The f32 tiles over rows `cols` dequantized by `dequantize(r, out)`.
#[allow(clippy::too_many_arguments)]
fn tiles(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    dequantize: impl Fn(usize, &mut [f32]),
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    TILE.with(|tile| {
        let mut tile = tile.borrow_mut();
        if tile.len() < ROWS_PER_TILE * k {
            tile.resize(ROWS_PER_TILE * k, 0.0);
        }
        let mut j = cols.start;
        while j < cols.end {
            let nr = ROWS_PER_TILE.min(cols.end - j);
            for r in 0..nr {
                dequantize(j + r, &mut tile[r * k..(r + 1) * k]);
            }
            let o = &mut out[(j - cols.start) * col_stride..];
            let rows = WeightRows::F32(&tile[..nr * k]);
            matmul_cols(isa, x, m, k, rows, 0..nr, o, row_stride, col_stride);
            j += nr;
        }
    });
}
