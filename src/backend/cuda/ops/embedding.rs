//! The embedding gathers: from an f32, 16-bit or ggml-block table.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use crate::backend::cuda::kernels;
use crate::backend::cuda::params::{EmbeddingParams, EmbeddingQParams};
use crate::backend::cuda::plan::{grid_stride, shape, to_u32};
use crate::backend::cuda::{CudaDevice, CudaError, QuantWeights};
use crate::kv::KvDtype;

/// What the rows of an embedding table hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Elements of this type: f32, or the raw bits of f16 or bf16.
    Elems(KvDtype),
    /// ggml blocks of this format (raw bytes; the row length a multiple of
    /// a block's values), each value widened as
    /// [`CudaDevice::linear_quant`] widens it.
    Blocks(QuantWeights),
}

impl CudaDevice {
    /// Gathers rows of `table` `[vocab, dim]`, each held as `rows` says,
    /// for `tokens` into `out` `[tokens.len(), dim]` (f32). Tokens outside
    /// the vocabulary are refused, as is a table whose element size is not
    /// `T`'s or whose element type has no gather kernel.
    pub fn embedding<T>(
        &self,
        rows: Rows,
        table: &impl DevicePtr<T>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        let elem = match rows {
            Rows::Elems(dtype) => dtype.size_bytes(),
            Rows::Blocks(_) => 1,
        };
        if elem != std::mem::size_of::<T>() {
            return Err(CudaError::Unsupported {
                what: "embedding table element",
                detail: format!(
                    "{rows:?} in a buffer of {}-byte elements",
                    std::mem::size_of::<T>()
                ),
            });
        }
        let vocab = match rows {
            Rows::Elems(_) => {
                if dim == 0 || !table.len().is_multiple_of(dim) {
                    return Err(CudaError::Shape {
                        what: "embedding table (a multiple of dim)",
                        expected: dim,
                        got: table.len(),
                    });
                }
                table.len() / dim
            }
            Rows::Blocks(q) => {
                let row_bytes = (dim / q.block_values()) * q.block_bytes();
                let vocab = table.len().checked_div(row_bytes).unwrap_or(0);
                q.check("embedding table bytes", table.len(), vocab, dim)?;
                vocab
            }
        };
        let Some((n_tokens, dim, vocab)) = gather_dims(tokens, vocab, dim, out.len())? else {
            return Ok(());
        };
        // Launch contract: table holds vocab rows of dim elements of the
        // kernel's type (`Elems`: the table's, checked against T) or of dim
        // / 32 blocks of the format (`Blocks`; checked, and vocab is what
        // they hold); every token is below vocab (checked, and the kernel
        // also bounds it); out holds n_tokens*dim f32 (checked); a
        // grid-stride loop covers them.
        let grid = grid_stride(out.len());
        self.with_token_list(tokens, |list| match rows {
            Rows::Blocks(q) => {
                self.launch_bound(kernels::embedding_q(), grid, move |a| EmbeddingQParams {
                    table: a.read(table),
                    tokens: a.read(list),
                    out: a.write(out),
                    n_tokens,
                    dim,
                    vocab,
                    format: q.code(),
                })
            }
            Rows::Elems(dtype) => {
                let kernel = kernels::embedding(dtype).ok_or_else(|| CudaError::MissingKernel {
                    name: format!("embedding for a {dtype:?} table"),
                })?;
                self.launch_bound(kernel, grid, move |a| EmbeddingParams {
                    table: a.read(table),
                    tokens: a.read(list),
                    out: a.write(out),
                    n_tokens,
                    dim,
                    vocab,
                    pad0: 0,
                })
            }
        })
    }

    /// Uploads `tokens` for `launch` to read, and retires the list after it
    /// whatever it returned: a recorded launch may replay after this
    /// returns, so the list lives until the queue is done with it.
    fn with_token_list(
        &self,
        tokens: &[u32],
        launch: impl FnOnce(&CudaSlice<u32>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let ids = self.upload(tokens)?;
        let launched = launch(&ids);
        self.retire(ids);
        launched
    }
}

/// Checks a gather of `tokens` from a table of `vocab` rows of `dim` values
/// into `out_len` values: every token inside the vocabulary, the output's
/// size. None when there are no tokens; else `(tokens, dim, vocab)` as the
/// kernels take them.
fn gather_dims(
    tokens: &[u32],
    vocab: usize,
    dim: usize,
    out_len: usize,
) -> Result<Option<(u32, u32, u32)>, CudaError> {
    if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(CudaError::TokenOutOfRange { token, vocab });
    }
    if tokens.is_empty() {
        return Ok(None);
    }
    shape("embedding output elements", tokens.len() * dim, out_len)?;
    Ok(Some((
        to_u32("tokens", tokens.len())?,
        to_u32("dim", dim)?,
        to_u32("vocab", vocab)?,
    )))
}
