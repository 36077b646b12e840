//! The matmuls' launch policy: the shape of `x · wᵀ` from buffer lengths,
//! and the block shape (f32 and ggml-block weights) or tile (16-bit
//! weights, tensor cores) its rows pick.

use super::{Grid, grid, shape, to_u32};
use crate::backend::cuda::CudaError;
use crate::backend::cuda::kernels::{self, Kernel};
use crate::backend::cuda::params::{
    LinearMmaGroupParams, LinearMmaParams, LinearParams, LinearQParams,
};
use crate::backend::cuda::table::{
    LGEMM_BM, LGEMM_BN, LIN_COLS, LIN_ROWS_FEW, LIN_ROWS_MANY, LIN_ROWS_ONE, LMMA_BM, LMMA_BN,
    LMMA_WIDE_BM, LMMA_WIDE_BN,
};
use crate::backend::cuda::weights::HalfWeights;

/// `(m, k)` of `x · wᵀ` for `x_len` inputs, `w_len` weights of `n` rows and
/// `out_len` outputs, or `None` for an empty batch; a typed error for any
/// inconsistency.
pub(crate) fn matmul_shape(
    x_len: usize,
    w_len: usize,
    n: usize,
    out_len: usize,
) -> Result<Option<(usize, usize)>, CudaError> {
    if n == 0 || !w_len.is_multiple_of(n) || w_len == 0 {
        return Err(CudaError::Shape {
            what: "weight (a non-empty multiple of its output rows)",
            expected: n,
            got: w_len,
        });
    }
    let k = w_len / n;
    if !x_len.is_multiple_of(k) {
        return Err(CudaError::Shape {
            what: "matmul input (a multiple of the weight's columns)",
            expected: k,
            got: x_len,
        });
    }
    let m = x_len / k;
    shape("matmul output elements", m * n, out_len)?;
    Ok((m > 0).then_some((m, k)))
}

/// The block shapes of the f32 and ggml-block matmuls (cuda/linear_f32.cuh):
/// one row of x, a few or many per block, by m. Every output gets the same
/// bits from each; the small ones waste fewer loads and products.
#[derive(Clone, Copy, Debug)]
pub(crate) enum LinShape {
    One,
    Few,
    Many,
}

impl LinShape {
    /// The shape for `m` rows and the 1-D grid of its (row tile, block of
    /// `LIN_COLS` columns) pairs for `n` columns; `None` when there is
    /// nothing to launch.
    pub(crate) fn for_launch(m: usize, n: usize) -> Result<Option<(Self, Grid)>, CudaError> {
        let (shape, rows) = match m {
            1 => (LinShape::One, LIN_ROWS_ONE),
            2..=LIN_ROWS_FEW => (LinShape::Few, LIN_ROWS_FEW),
            _ => (LinShape::Many, LIN_ROWS_MANY),
        };
        let blocks = m.div_ceil(rows).saturating_mul(n.div_ceil(LIN_COLS));
        Ok(grid("matmul blocks (row tiles x column blocks)", blocks, 1, 1)?.map(|g| (shape, g)))
    }

    /// The f32 matmul of this shape.
    pub(crate) fn f32_kernel(self) -> Kernel<LinearParams> {
        match self {
            LinShape::One => kernels::linear(),
            LinShape::Few => kernels::linear_few(),
            LinShape::Many => kernels::linear_many(),
        }
    }

    /// The ggml-block matmul of this shape.
    pub(crate) fn quant_kernel(self) -> Kernel<LinearQParams> {
        match self {
            LinShape::One => kernels::linear_q(),
            LinShape::Few => kernels::linear_q_few(),
            LinShape::Many => kernels::linear_q_many(),
        }
    }
}

/// The tensor-core matmul's tiles (cuda/linear_mma.cuh), chosen by the
/// rows of x; each gives the others' bits.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Bf16Tile {
    /// 16 x 16, below 32 rows.
    Decode,
    /// 32 x 32, from 32 rows.
    Wide,
    /// 128 x 64 with a cp.async pipeline, from 128 rows.
    Prefill,
}

impl Bf16Tile {
    pub(crate) fn for_rows(m: usize) -> Self {
        if m >= LGEMM_BM {
            Bf16Tile::Prefill
        } else if m >= LMMA_WIDE_BM {
            Bf16Tile::Wide
        } else {
            Bf16Tile::Decode
        }
    }

    /// Rows of x per block.
    pub(crate) fn rows(self) -> usize {
        match self {
            Bf16Tile::Decode => LMMA_BM,
            Bf16Tile::Wide => LMMA_WIDE_BM,
            Bf16Tile::Prefill => LGEMM_BM,
        }
    }

    /// Output columns per block.
    pub(crate) fn cols(self) -> usize {
        match self {
            Bf16Tile::Decode => LMMA_BN,
            Bf16Tile::Wide => LMMA_WIDE_BN,
            Bf16Tile::Prefill => LGEMM_BN,
        }
    }

    /// Ok when `tile` carries `stage` in its loads or stores: the tiles up
    /// to `widest` do (decode, then wide), the prefill tile none.
    pub(crate) fn carries(stage: &'static str, tile: Self, widest: Self) -> Result<(), CudaError> {
        if tile.rows() <= widest.rows() {
            return Ok(());
        }
        Err(CudaError::Unsupported {
            what: "a stage carried into the tensor-core matmul",
            detail: format!("{stage} on the {tile:?} tile (it rides up to the {widest:?} tile)"),
        })
    }

    /// This tile's kernel of a single product for `h` weights.
    pub(crate) fn single(self, h: HalfWeights) -> Result<Kernel<LinearMmaParams>, CudaError> {
        self.kernel(
            h,
            match self {
                Bf16Tile::Decode => kernels::linear_mma(h.dtype()),
                Bf16Tile::Wide => kernels::linear_mma_wide(h.dtype()),
                Bf16Tile::Prefill => kernels::linear_mma_gemm(h.dtype()),
            },
        )
    }

    /// This tile's kernel of grouped products for `h` weights.
    pub(crate) fn group(self, h: HalfWeights) -> Result<Kernel<LinearMmaGroupParams>, CudaError> {
        self.kernel(
            h,
            match self {
                Bf16Tile::Decode => kernels::linear_mma_group(h.dtype()),
                Bf16Tile::Wide => kernels::linear_mma_wide_group(h.dtype()),
                Bf16Tile::Prefill => kernels::linear_mma_gemm_group(h.dtype()),
            },
        )
    }

    /// This tile's kernel as the lookup found it, or which is missing.
    fn kernel<P>(self, h: HalfWeights, found: Option<Kernel<P>>) -> Result<Kernel<P>, CudaError> {
        found.ok_or_else(|| CudaError::MissingKernel {
            name: format!("the {self:?} tile of the tensor-core matmul for {h:?} weights"),
        })
    }
}

/// `m`, `n` and `k` as the matmuls' params structs hold them.
pub(crate) fn dims(m: usize, n: usize, k: usize) -> Result<(u32, u32, u32), CudaError> {
    Ok((
        to_u32("matmul rows", m)?,
        to_u32("matmul columns", n)?,
        to_u32("matmul depth", k)?,
    ))
}
