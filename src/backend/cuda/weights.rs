//! How a weight matrix is kept on the device when it is not f32: the
//! 16-bit types of the tensor-core matmuls ([`HalfWeights`]) and the ggml
//! block formats of the ggml-block matmul ([`QuantWeights`]).

use super::CudaError;
use super::params::*;
use super::plan::shape;
use crate::kv::KvDtype;

/// How a weight matrix kept in 16 bits (as its checkpoint stored it) is
/// stored on the device: the tensor-core matmuls (cuda/linear_mma.cuh)
/// and the embedding gather are compiled for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfWeights {
    /// bf16 (raw bits): meets x's bf16 parts in two mma a k-step.
    Bf16,
    /// f16 (raw bits): split into exact bf16 parts in registers, four mma
    /// a k-step.
    F16,
}

impl HalfWeights {
    /// The element type the kernel table lists it under.
    pub fn dtype(self) -> KvDtype {
        match self {
            HalfWeights::Bf16 => KvDtype::BF16,
            HalfWeights::F16 => KvDtype::F16,
        }
    }
}

/// A weight matrix kept in the ggml block format its GGUF checkpoint stored
/// it in: the f32 matmul's shapes read it as stored (cuda/linear_f32.cuh),
/// widening each value as the CPU backend does, so a product has the bits
/// of the f32 matmul on the widened weights at 0.56 to 1.06 bytes a weight
/// instead of 4. Rows are whole blocks of 32 values (256 for the K types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantWeights {
    /// `[f16 d][32 x i8]`, 34 bytes a block: `d * q`.
    Q8_0,
    /// `[f16 d][16 bytes of nibbles]`, 18 bytes: `d * (q - 8)`.
    Q4_0,
    /// `[f16 d][f16 m][16 bytes of nibbles]`, 20 bytes: `q * d + m` fused.
    Q4_1,
    /// `[f16 d][u32 fifth bits][16 bytes of nibbles]`, 22 bytes:
    /// `d * (q - 16)`.
    Q5_0,
    /// `[f16 d][f16 m][u32 fifth bits][16 bytes of nibbles]`, 24 bytes:
    /// `q * d + m` fused.
    Q5_1,
    /// 256 values in 144 bytes: 8 sub-blocks with 6-bit scales and mins.
    Q4K,
    /// Q4_K with a fifth bit a value: 176 bytes.
    Q5K,
    /// 256 values in 210 bytes: 6 bits a value, 16 signed 8-bit scales.
    Q6K,
}

impl QuantWeights {
    /// The format of a GGUF quantized tensor type (every one this crate
    /// computes with; `None` for the float types).
    pub fn of(ty: crate::backend::GgmlType) -> Option<Self> {
        use crate::backend::GgmlType;
        match ty {
            GgmlType::Q8_0 => Some(QuantWeights::Q8_0),
            GgmlType::Q4_0 => Some(QuantWeights::Q4_0),
            GgmlType::Q4_1 => Some(QuantWeights::Q4_1),
            GgmlType::Q5_0 => Some(QuantWeights::Q5_0),
            GgmlType::Q5_1 => Some(QuantWeights::Q5_1),
            GgmlType::Q4K => Some(QuantWeights::Q4K),
            GgmlType::Q5K => Some(QuantWeights::Q5K),
            GgmlType::Q6K => Some(QuantWeights::Q6K),
            _ => None,
        }
    }

    /// The GGUF tensor type it is ([`QuantWeights::of`]'s inverse).
    pub fn ggml(self) -> crate::backend::GgmlType {
        use crate::backend::GgmlType;
        match self {
            QuantWeights::Q8_0 => GgmlType::Q8_0,
            QuantWeights::Q4_0 => GgmlType::Q4_0,
            QuantWeights::Q4_1 => GgmlType::Q4_1,
            QuantWeights::Q5_0 => GgmlType::Q5_0,
            QuantWeights::Q5_1 => GgmlType::Q5_1,
            QuantWeights::Q4K => GgmlType::Q4K,
            QuantWeights::Q5K => GgmlType::Q5K,
            QuantWeights::Q6K => GgmlType::Q6K,
        }
    }

    /// Bytes of one block (ggml's table, [`GgmlType::block_bytes`]).
    ///
    /// [`GgmlType::block_bytes`]: crate::backend::GgmlType::block_bytes
    pub fn block_bytes(self) -> usize {
        self.ggml().block_bytes() as usize
    }

    /// Values in one block (ggml's table).
    pub fn block_values(self) -> usize {
        self.ggml().block_elems() as usize
    }

    /// `QFMT_*` in params.cuh.
    pub(super) fn code(self) -> u32 {
        match self {
            QuantWeights::Q8_0 => QFMT_Q8_0,
            QuantWeights::Q4_0 => QFMT_Q4_0,
            QuantWeights::Q4_1 => QFMT_Q4_1,
            QuantWeights::Q5_0 => QFMT_Q5_0,
            QuantWeights::Q5_1 => QFMT_Q5_1,
            QuantWeights::Q4K => QFMT_Q4_K,
            QuantWeights::Q5K => QFMT_Q5_K,
            QuantWeights::Q6K => QFMT_Q6_K,
        }
    }

    /// Checks that `len` bytes are `rows` rows of `cols` values in this
    /// format (`cols` a multiple of a block's values).
    pub(super) fn check(
        self,
        what: &'static str,
        len: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        let per = self.block_values();
        if cols == 0 || !cols.is_multiple_of(per) {
            return Err(CudaError::Shape {
                what: "ggml-block columns (a non-zero multiple of a block's values)",
                expected: cols.next_multiple_of(per).max(per),
                got: cols,
            });
        }
        let want = rows
            .checked_mul(cols / per)
            .and_then(|b| b.checked_mul(self.block_bytes()))
            .unwrap_or(usize::MAX);
        shape(what, want, len)
    }
}
