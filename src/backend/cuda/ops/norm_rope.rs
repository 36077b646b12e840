//! The pointwise ops: RMSNorm, rotary embedding (alone, of a q/k pair, or
//! with the KV append of the rotated k), SwiGLU and the periodic add.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::kv::append_target;
use crate::backend::cuda::kernels;
use crate::backend::cuda::params::{AddParams, RmsNormParams, RopeParams, SwigluParams};
use crate::backend::cuda::plan::{grid, grid_stride, shape, to_u32};
use crate::backend::cuda::{CudaDevice, CudaError, DeviceKvArena, SlotMap};
use crate::backend::{Rope, RopeScaling, RopeStyle};
use crate::kv::KvDtype;

/// The append a RoPE launch also carries out ([`CudaDevice::rope_pair_append`]).
struct Append<'a, V> {
    arena: &'a mut DeviceKvArena,
    layer: usize,
    slots: &'a SlotMap,
    v: &'a V,
}

impl CudaDevice {
    /// `out = x / sqrt(mean(x^2) + eps) * w` for each row of `dim` elements.
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        eps: f32,
    ) -> Result<(), CudaError> {
        let dim = w.len();
        if dim == 0 || !x.len().is_multiple_of(dim) {
            return Err(CudaError::Shape {
                what: "RMSNorm input (a multiple of the weight's length)",
                expected: dim,
                got: x.len(),
            });
        }
        shape("RMSNorm output elements", x.len(), out.len())?;
        let Some(grid) = grid("RMSNorm rows", x.len() / dim, 1, 1)? else {
            return Ok(());
        };
        let dim = to_u32("RMSNorm dim", dim)?;
        // Launch contract: x and out hold n_rows*dim f32 and w holds dim
        // (checked); one block of 256 threads per row, as the kernel's block
        // reduction expects.
        self.launch_bound(kernels::rms_norm(), grid, move |a| RmsNormParams {
            x: a.read(x),
            w: a.read(w),
            out: a.write(out),
            n_rows: grid.0,
            dim,
            eps,
            pad0: 0,
        })
    }

    /// Rotary embedding in place on `x` `[positions.len(), rope.n_heads,
    /// rope.head_dim]`.
    pub fn rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        positions: &impl DevicePtr<u32>,
        rope: Rope,
    ) -> Result<(), CudaError> {
        self.rope_launch(
            x,
            None::<(&mut CudaSlice<f32>, usize)>,
            positions,
            rope,
            None::<Append<'_, CudaSlice<f32>>>,
        )
    }

    /// [`CudaDevice::rope`] of `q` (`rope.n_heads` heads) and of `k`
    /// (`k_heads` heads) in one launch: each head gets the bits a launch of
    /// its own gives.
    pub fn rope_pair(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &mut impl DevicePtrMut<f32>,
        k_heads: usize,
        positions: &impl DevicePtr<u32>,
        rope: Rope,
    ) -> Result<(), CudaError> {
        self.rope_launch(
            q,
            Some((k, k_heads)),
            positions,
            rope,
            None::<Append<'_, CudaSlice<f32>>>,
        )
    }

    /// [`CudaDevice::rope_pair`], then [`CudaDevice::kv_append`] of the
    /// rotated `k` and of `v` to `slots` of `layer`, in one launch: `q`, `k`
    /// and the pages get the bits of the two launches. `k` must be the
    /// arena's K rows (`k_heads * head_dim == kv_dim`).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_pair_append(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &mut impl DevicePtrMut<f32>,
        k_heads: usize,
        positions: &impl DevicePtr<u32>,
        rope: Rope,
        arena: &mut DeviceKvArena,
        layer: usize,
        slots: &SlotMap,
        v: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        let append = Append {
            arena,
            layer,
            slots,
            v,
        };
        self.rope_launch(q, Some((k, k_heads)), positions, rope, Some(append))
    }

    fn rope_launch<X2: DevicePtrMut<f32>, V: DevicePtr<f32>>(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        x2: Option<(&mut X2, usize)>,
        positions: &impl DevicePtr<u32>,
        rope: Rope,
        append: Option<Append<'_, V>>,
    ) -> Result<(), CudaError> {
        let Rope {
            n_heads,
            head_dim,
            theta,
            style,
            scaling,
        } = rope;
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(CudaError::Unsupported {
                what: "RoPE head_dim",
                detail: format!("{head_dim} (even)"),
            });
        }
        let elements = |heads: usize| {
            positions
                .len()
                .checked_mul(heads)
                .and_then(|n| n.checked_mul(head_dim))
                .unwrap_or(usize::MAX)
        };
        shape("RoPE elements", elements(n_heads), x.len())?;
        let k_heads = x2.as_ref().map_or(0, |(_, h)| *h);
        if let Some((x2, heads)) = &x2 {
            shape(
                "RoPE elements of the second buffer",
                elements(*heads),
                x2.len(),
            )?;
        }
        let total = elements(n_heads).saturating_add(elements(k_heads));
        // Every field but the buffers' addresses (bound at the launch).
        let mut p = RopeParams {
            theta: f64::from(theta),
            n_tokens: to_u32("RoPE tokens", positions.len())?,
            n_heads: to_u32("RoPE heads", n_heads)?,
            head_dim: to_u32("RoPE head_dim", head_dim)?,
            style: match style {
                RopeStyle::Interleaved => 0,
                RopeStyle::Half => 1,
            },
            n_heads2: to_u32("RoPE heads of the second buffer", k_heads)?,
            ..RopeParams::default()
        };
        match scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                p.scaling = 1;
                p.factor = f64::from(factor);
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                p.scaling = 2;
                p.factor = f64::from(factor);
                p.low_freq_factor = f64::from(low_freq_factor);
                p.high_freq_factor = f64::from(high_freq_factor);
                p.original_max_position = f64::from(original_max_position);
            }
        }
        // RoPE alone runs the f32 instantiation (it stores nothing in an
        // arena); the append, the one of the arena's dtype, with one more
        // item per V element.
        let (dtype, extra) = match &append {
            None => (KvDtype::F32, 0),
            Some(Append {
                arena,
                layer,
                slots,
                v,
            }) => {
                let (layer, slots) = (*layer, *slots);
                let g = append_target(arena, layer, slots)?;
                shape(
                    "appended tokens (one per rotated row)",
                    positions.len(),
                    slots.n_tokens,
                )?;
                shape(
                    "appended K row (k_heads * head_dim)",
                    g.kv_dim(),
                    k_heads * head_dim,
                )?;
                shape("appended V elements", elements(k_heads), v.len())?;
                p.page_stride = arena.page_elems() as u64;
                p.kv_dim = to_u32("kv_dim", g.kv_dim())?;
                p.layer = to_u32("layer", layer)?;
                p.page_size_log2 = arena.page_size().trailing_zeros();
                (g.dtype, elements(k_heads))
            }
        };
        let kernel = kernels::rope(dtype).ok_or_else(|| CudaError::MissingKernel {
            name: format!("rope for {dtype:?}"),
        })?;
        // Launch contract: x holds n_tokens*n_heads*head_dim f32, x2 (when
        // n_heads2 > 0) n_tokens*n_heads2*head_dim, and positions n_tokens
        // u32 (checked); head_dim is even; the kernel grid-strides over the
        // pairs of both. With kv set: the slot map was built for this arena
        // (id checked) with every page inside it and every slot below
        // page_size, one slot per token; layer < n_layers; x2's rows and v's
        // are kv_dim wide (checked); the kernel matches the dtype and
        // grid-strides over the v elements after the pairs.
        let grid = grid_stride((total / 2).saturating_add(extra));
        self.launch_bound(kernel, grid, move |a| {
            p.x = a.write(x);
            p.positions = a.read(positions);
            if let Some((x2, _)) = x2 {
                p.x2 = a.write(x2);
            }
            if let Some(Append {
                arena, slots, v, ..
            }) = append
            {
                p.v = a.read(v);
                [p.dst_page, p.dst_slot] = a.read_arrays(&slots.arrays);
                p.kv = a.write(&mut arena.data);
            }
            p
        })
    }

    /// `gate = silu(gate) * up`, elementwise, in place.
    pub fn swiglu(
        &self,
        gate: &mut impl DevicePtrMut<f32>,
        up: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        shape("SwiGLU up elements", gate.len(), up.len())?;
        let n = gate.len();
        // Launch contract: gate and up hold n f32 each (checked); out is
        // gate, which the kernel reads and writes at the same index only.
        self.launch_bound(kernels::swiglu(), grid_stride(n), move |a| {
            let up = a.read(up);
            let gate = a.write(gate);
            SwigluParams {
                gate,
                up,
                out: gate,
                n: n as u64,
            }
        })
    }

    /// `x[i] += y[i % y.len()]`: a residual add when the lengths match, a
    /// per-row bias when `y` is one row.
    pub fn add_assign(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        if y.is_empty() || !x.len().is_multiple_of(y.len()) {
            return Err(CudaError::Shape {
                what: "addend (a divisor of the destination's length)",
                expected: x.len(),
                got: y.len(),
            });
        }
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        // Launch contract: x holds n f32 and y holds period f32, period > 0
        // (checked).
        let period = y.len() as u64;
        self.launch_bound(kernels::add_periodic(), grid_stride(n), move |a| {
            AddParams {
                y: a.read(y),
                x: a.write(x),
                n: n as u64,
                period,
            }
        })
    }
}
