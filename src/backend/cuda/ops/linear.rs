//! The f32 matmul and the ggml-block matmul (cuda/linear_f32.cuh): the
//! same block shapes (`plan::LinShape`), so the same bits on the widened
//! weights.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::backend::cuda::params::{LinearParams, LinearQParams};
use crate::backend::cuda::plan::{LinShape, dims, matmul_shape};
use crate::backend::cuda::{CudaDevice, CudaError, QuantWeights};

impl CudaDevice {
    /// `out = x · wᵀ` for `x` `[m, k]` and `w` `[n, k]`; `out` is `[m, n]`.
    pub fn linear(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_into(x, w, n, out, false)
    }

    /// `out += x · wᵀ` (a projection added to the residual stream): the
    /// bits of [`CudaDevice::linear`] into a buffer then
    /// [`CudaDevice::add_assign`], in one launch.
    pub fn linear_add(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_into(x, w, n, out, true)
    }

    fn linear_into(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let Some((m, k)) = matmul_shape(x.len(), w.len(), n, out.len())? else {
            return Ok(());
        };
        let Some((shape, grid)) = LinShape::for_launch(m, n)? else {
            return Ok(());
        };
        let (m, n, k) = dims(m, n, k)?;
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
            accumulate: u32::from(accumulate),
        })
    }

    /// `out = x · wᵀ` with weights `w` `[n, k]` kept in ggml blocks of `q`
    /// (raw bytes, `k` a multiple of a block's values): each weight widened
    /// as the CPU backend widens it, so the bits of [`CudaDevice::linear`]
    /// on the widened weights, reading a quarter of the bytes or less
    /// (Q8_0: about half).
    pub fn linear_quant(
        &self,
        q: QuantWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u8>,
        n: usize,
        k: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_quant_into(q, x, w, n, k, out, false)
    }

    /// `out += x · wᵀ` with ggml-block weights: the bits of
    /// [`CudaDevice::linear_quant`] into a buffer then
    /// [`CudaDevice::add_assign`], in one launch.
    pub fn linear_quant_add(
        &self,
        q: QuantWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u8>,
        n: usize,
        k: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_quant_into(q, x, w, n, k, out, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn linear_quant_into(
        &self,
        q: QuantWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u8>,
        n: usize,
        k: usize,
        out: &mut impl DevicePtrMut<f32>,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        q.check("ggml-block weight bytes", w.len(), n, k)?;
        let Some((m, k)) = matmul_shape(x.len(), n * k, n, out.len())? else {
            return Ok(());
        };
        let Some((shape, grid)) = LinShape::for_launch(m, n)? else {
            return Ok(());
        };
        let (m, n, k) = dims(m, n, k)?;
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
            accumulate: u32::from(accumulate),
            format: q.code(),
            pad0: 0,
        })
    }
}
