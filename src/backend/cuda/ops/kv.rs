//! KV pages on the device: the append of K/V rows into page slots, and
//! the scrub of whole pages.

use cudarc::driver::DevicePtr;

use crate::backend::cuda::kernels;
use crate::backend::cuda::params::{KvAppendParams, ScrubParams};
use crate::backend::cuda::plan::{grid_stride, shape, to_u32};
use crate::backend::cuda::{CudaDevice, CudaError, DeviceKvArena, SlotMap};
use crate::kv::KvDtype;

/// The geometry of `arena` when `slots` were built for it and it has a
/// layer `layer`: what every append checks before it writes.
pub(super) fn append_target(
    arena: &DeviceKvArena,
    layer: usize,
    slots: &SlotMap,
) -> Result<crate::kv::KvGeometry, CudaError> {
    if slots.arena_id != arena.id {
        return Err(CudaError::ForeignArena);
    }
    let g = arena.geometry();
    if layer >= g.n_layers {
        return Err(CudaError::Shape {
            what: "layer (below n_layers)",
            expected: g.n_layers,
            got: layer,
        });
    }
    Ok(g)
}

impl CudaDevice {
    /// Writes K/V rows `[slots.len(), kv_dim]` (f32, converted to the arena's
    /// dtype with round-to-nearest-even) into `slots` of layer `layer`.
    pub fn kv_append(
        &self,
        arena: &mut DeviceKvArena,
        layer: usize,
        slots: &SlotMap,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        let g = append_target(arena, layer, slots)?;
        let total = slots.n_tokens * g.kv_dim();
        shape("appended K elements", total, k.len())?;
        shape("appended V elements", total, v.len())?;
        let kernel = kernels::kv_append(g.dtype).ok_or_else(|| CudaError::MissingKernel {
            name: format!("kv_append for {:?}", g.dtype),
        })?;
        let page_stride = arena.page_elems() as u64;
        let page_size_log2 = arena.page_size().trailing_zeros();
        let n_tokens = to_u32("append rows", slots.n_tokens)?;
        let kv_dim = to_u32("kv_dim", g.kv_dim())?;
        let layer = to_u32("layer", layer)?;
        // Launch contract: k and v hold n_tokens*kv_dim f32 (checked); the
        // slot map was built for this arena (id checked) with every page
        // inside it and every slot below page_size; layer < n_layers; the
        // kernel matches the dtype.
        self.launch_bound(kernel, grid_stride(total), |a| {
            let [dst_page, dst_slot] = a.read_arrays(&slots.arrays);
            KvAppendParams {
                k: a.read(k),
                v: a.read(v),
                dst_page,
                dst_slot,
                kv: a.write(&mut arena.data),
                page_stride,
                n_tokens,
                kv_dim,
                layer,
                page_size_log2,
            }
        })
    }

    /// Fills whole pages with zeros, or with the dtype's NaN when `poison`
    /// (bit-identical to the host pool's scrub).
    pub fn scrub_pages(
        &self,
        arena: &mut DeviceKvArena,
        pages: &[u32],
        poison: bool,
    ) -> Result<(), CudaError> {
        if pages.is_empty() {
            return Ok(());
        }
        for &p in pages {
            if p as usize >= arena.pages() {
                return Err(CudaError::PageOutOfRange {
                    page: p,
                    pages: arena.pages(),
                });
            }
        }
        let fill = match (poison, arena.geometry().dtype) {
            (false, _) => 0,
            (true, KvDtype::F32) => f32::NAN.to_bits(),
            (true, KvDtype::F16) => u32::from(half::f16::NAN.to_bits()) * 0x1_0001,
            (true, KvDtype::BF16) => u32::from(half::bf16::NAN.to_bits()) * 0x1_0001,
            (true, KvDtype::F8E4M3) => u32::from(crate::kv::F8E4M3::NAN.0) * 0x0101_0101,
        };
        let n_pages = to_u32("pages to scrub", pages.len())?;
        let list = self.upload(pages)?;
        let page_vec16 = (arena.page_bytes() / 16) as u64;
        // Launch contract: every listed page is inside the arena (checked);
        // page bytes are a multiple of 16 (checked when the arena was
        // built), so the kernel's 16-byte stores stay inside each page; one
        // block per listed page.
        self.launch_bound(kernels::scrub_pages(), (n_pages, 1, 1), |a| ScrubParams {
            kv: a.write(&mut arena.data),
            pages: a.read(&list),
            page_vec16,
            n_pages,
            fill,
        })?;
        self.retire(list);
        Ok(())
    }
}
