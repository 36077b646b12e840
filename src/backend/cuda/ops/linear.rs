//! The f32 matmul and the ggml-block matmul (cuda/linear_f32.cuh): the
//! same block shapes (`plan::LinShape`), so the same bits on the widened
//! weights.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::Write;
use crate::backend::cuda::params::{LinearParams, LinearQParams};
use crate::backend::cuda::plan::{Grid, LinShape, dims, matmul_shape};
use crate::backend::cuda::{CudaDevice, CudaError, QuantWeights};

/// A matmul's block shape, grid and `(m, n, k)`.
type LinLaunch = (LinShape, Grid, (u32, u32, u32));

/// The block shape, grid and `(m, n, k)` of a matmul of `x` (`x_len`
/// values) by `n` weight rows (`w_len` values in all) into `out_len`
/// values, or None when there is nothing to compute.
fn plan(
    x_len: usize,
    w_len: usize,
    n: usize,
    out_len: usize,
) -> Result<Option<LinLaunch>, CudaError> {
    let Some((m, k)) = matmul_shape(x_len, w_len, n, out_len)? else {
        return Ok(None);
    };
    let Some((shape, grid)) = LinShape::for_launch(m, n)? else {
        return Ok(None);
    };
    Ok(Some((shape, grid, dims(m, n, k)?)))
}

impl CudaDevice {
    /// `out = x · wᵀ` (or `out += x · wᵀ`, as `write` says) for `x`
    /// `[m, k]` and `w` `[n, k]`; `out` is `[m, n]`.
    pub fn linear(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
        write: Write,
    ) -> Result<(), CudaError> {
        let Some((shape, grid, (m, n, k))) = plan(x.len(), w.len(), n, out.len())? else {
            return Ok(());
        };
        // Launch contract: x holds m*k, w n*k and out m*n f32 (checked); the
        // 1-D grid covers every (row tile of the shape's rows, block of
        // LIN_COLS columns) pair, as the kernel decodes its block index, and
        // the kernel bounds every access by m, n, k.
        self.launch_bound(shape.f32_kernel(), grid, move |a| LinearParams {
            x: a.read(x),
            w: a.read(w),
            out: a.write(out),
            m,
            n,
            k,
            accumulate: write.accumulate(),
        })
    }

    /// `out = x · wᵀ` (or `+=`, as `write` says) with weights `w` `[n, k]`
    /// kept in ggml blocks of `q` (raw bytes, `k` a multiple of a block's
    /// values): each weight widened as the CPU backend widens it, so the
    /// bits of [`CudaDevice::linear`] on the widened weights, reading a
    /// quarter of the bytes or less (Q8_0: about half).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_quant(
        &self,
        q: QuantWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u8>,
        n: usize,
        k: usize,
        out: &mut impl DevicePtrMut<f32>,
        write: Write,
    ) -> Result<(), CudaError> {
        q.check("ggml-block weight bytes", w.len(), n, k)?;
        let Some((shape, grid, (m, n, k))) = plan(x.len(), n * k, n, out.len())? else {
            return Ok(());
        };
        // Launch contract: x holds m*k f32, out m*n f32, w n rows of whole
        // blocks of the format (checked; k a multiple of a block's values,
        // so no block is cut); the 1-D grid covers every (row tile, column
        // block) pair as the kernel decodes it, and the kernel bounds every
        // access by m, n, k.
        self.launch_bound(shape.quant_kernel(), grid, move |a| LinearQParams {
            x: a.read(x),
            w: a.read(w),
            out: a.write(out),
            m,
            n,
            k,
            accumulate: write.accumulate(),
            format: q.code(),
            pad0: 0,
        })
    }
}
