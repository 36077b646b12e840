//! The embedding gathers: from an f32, 16-bit or ggml-block table.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::backend::cuda::kernels;
use crate::backend::cuda::params::{EmbeddingParams, EmbeddingQParams};
use crate::backend::cuda::plan::{grid_stride, shape, to_u32};
use crate::backend::cuda::{CudaDevice, CudaError, HalfWeights, QuantWeights};
use crate::kv::KvDtype;

impl CudaDevice {
    /// Gathers rows of `table` `[vocab, dim]` for `tokens` into `out`
    /// `[tokens.len(), dim]`. Tokens outside the vocabulary are refused.
    pub fn embedding(
        &self,
        table: &impl DevicePtr<f32>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.embedding_of(KvDtype::F32, table, dim, tokens, out)
    }

    /// [`CudaDevice::embedding`] from a bf16 table (raw bits).
    pub fn embedding_bf16(
        &self,
        table: &impl DevicePtr<u16>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.embedding_half(HalfWeights::Bf16, table, dim, tokens, out)
    }

    /// [`CudaDevice::embedding`] from a 16-bit table (raw bits of `h`).
    pub fn embedding_half(
        &self,
        h: HalfWeights,
        table: &impl DevicePtr<u16>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.embedding_of(h.dtype(), table, dim, tokens, out)
    }

    /// [`CudaDevice::embedding`] from a table `[vocab, dim]` kept in ggml
    /// blocks of `q` (raw bytes, `dim` a multiple of a block's values): each value widened
    /// as [`CudaDevice::linear_quant`] widens it.
    pub fn embedding_quant(
        &self,
        q: QuantWeights,
        table: &impl DevicePtr<u8>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        let row_bytes = (dim / q.block_values()) * q.block_bytes();
        let vocab = table.len().checked_div(row_bytes).unwrap_or(0);
        q.check("embedding table bytes", table.len(), vocab, dim)?;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(CudaError::TokenOutOfRange { token, vocab });
        }
        if tokens.is_empty() {
            return Ok(());
        }
        shape("embedding output elements", tokens.len() * dim, out.len())?;
        let (n_tokens, dim) = (to_u32("tokens", tokens.len())?, to_u32("dim", dim)?);
        let vocab = to_u32("vocab", vocab)?;
        let ids = self.upload(tokens)?;
        let list = &ids;
        // Launch contract: table holds vocab rows of dim / 32 blocks of the
        // format (checked, and vocab is what they hold), every token is
        // below vocab (checked, and the kernel also bounds it), out holds
        // n_tokens*dim f32; a grid-stride loop covers them.
        let grid = grid_stride(out.len());
        self.launch_bound(kernels::embedding_q(), grid, move |a| EmbeddingQParams {
            table: a.read(table),
            tokens: a.read(list),
            out: a.write(out),
            n_tokens,
            dim,
            vocab,
            format: q.code(),
        })?;
        // As in `embedding_of`: a recorded launch may replay after this
        // returns, so the token list lives until the queue is done with it.
        self.retire(ids);
        Ok(())
    }

    fn embedding_of<T>(
        &self,
        dtype: KvDtype,
        table: &impl DevicePtr<T>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        if dim == 0 || !table.len().is_multiple_of(dim) {
            return Err(CudaError::Shape {
                what: "embedding table (a multiple of dim)",
                expected: dim,
                got: table.len(),
            });
        }
        let vocab = table.len() / dim;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(CudaError::TokenOutOfRange { token, vocab });
        }
        if tokens.is_empty() {
            return Ok(());
        }
        shape("embedding output elements", tokens.len() * dim, out.len())?;
        let kernel = kernels::embedding(dtype).ok_or_else(|| CudaError::MissingKernel {
            name: format!("embedding for a {dtype:?} table"),
        })?;
        let (n_tokens, dim) = (to_u32("tokens", tokens.len())?, to_u32("dim", dim)?);
        let vocab = to_u32("vocab", vocab)?;
        let ids = self.upload(tokens)?;
        let list = &ids;
        // Launch contract: table holds vocab*dim elements of the kernel's
        // type (the table's, `dtype`), every token is below vocab (checked,
        // and the kernel also bounds it), out holds n_tokens*dim f32
        // (checked).
        let grid = grid_stride(out.len());
        self.launch_bound(kernel, grid, move |a| EmbeddingParams {
            table: a.read(table),
            tokens: a.read(list),
            out: a.write(out),
            n_tokens,
            dim,
            vocab,
            pad0: 0,
        })?;
        self.retire(ids);
        Ok(())
    }
}
