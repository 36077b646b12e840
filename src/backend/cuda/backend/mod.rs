//! [`CudaBackend`]: the [`Backend`](crate::backend::Backend) trait on the GPU.
//!
//! KV ownership stays where it is: the host [`crate::KvPool`] keeps page
//! accounting, generations, the audit trail and a full copy of every byte
//! (so the transfer layer and the CPU-side checks keep working unchanged).
//! The backend mirrors page bytes in a [`DeviceKvArena`](super::DeviceKvArena) of the same shape
//! and treats it as a cache keyed by (page, generation, layer, slots):
//!
//! - `kv_append` writes through: host first (`KvSeq::append`, which checks
//!   the reservation and records the writer), then the device, from rows
//!   already on the device.
//! - A page seen at a new generation changed hands: its device copy is
//!   scrubbed per the pool's policy (poison: NaN) before anything else, and
//!   nothing of it counts as synced.
//! - Attention takes the host's validated [`LayerView`](crate::kv::LayerView)s; any written slot
//!   the device has not seen at the page's current generation (KV that
//!   arrived by transfer, for example) is uploaded from the view first. The
//!   page tables uploaded per step come from those views and are validated
//!   against the arena again before launch. The views are checked for
//!   every layer; when they give the same pages and lengths as the last
//!   tables built (the other layers of a step), those tables are used
//!   again, as are the step's RoPE positions and append slots (`memo.rs`).
//!
//! A pool built on [`CudaPages`](super::CudaPages) (device-resident, #15) needs no mirror: its
//! bytes are already here. `kv_append` checks the reservation on the host
//! ([`KvSeq::device_append`](crate::kv::KvSeq::device_append)), writes the rows with the append kernel
//! straight into the pool's pages and then counts them written; attention
//! builds its page tables from the views against the pool's own arena. The
//! pool scrubs (or poisons) a page on the device when it is released.
//!
//! Split by concern: the buffers and weights (`buffers.rs`), the KV mirror
//! and page tables (`kv.rs`), and the `Backend` trait's operations
//! (`compute.rs`).

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;

use crate::backend::cuda::memo::Memo;
use crate::backend::cuda::{
    CudaDevice, CudaError, DecodeKernel, DecodeWorkspace, HalfWeights, PageTables, SlotMap,
};
use crate::backend::{BackendError, Norm, shape_err};

mod buffers;
mod compute;
mod kv;

pub use buffers::{CudaBuf, CudaMat};
use kv::KvMirror;

/// The CUDA backend: activations and weights in device memory, KV mirrored
/// from the host pool (see the module docs).
pub struct CudaBackend {
    dev: CudaDevice,
    kv: Mutex<Option<KvMirror>>,
    workspace: Mutex<DecodeWorkspace>,
    /// Whether [`Backend::new_pool`](crate::backend::Backend::new_pool) gives device-resident pools.
    device_kv: bool,
    bf16_weights: bool,
    /// Whether RMSNorm and SwiGLU ride in the bf16 matmuls' launches
    /// ([`CudaBackend::set_carried_stages`]).
    carry: std::sync::atomic::AtomicBool,
    /// The decode attention kernel ([`CudaBackend::set_decode_kernel`]).
    decode_kernel: parking_lot::Mutex<DecodeKernel>,
    /// The last upload of each per-layer input, reused while the host-side
    /// content is equal (every layer of a step asks for the same).
    positions: Memo<Vec<u32>, CudaSlice<u32>>,
    tables_memo: Memo<TablesKey, PageTables>,
    slots_memo: Memo<(u64, Vec<(u32, u32)>), SlotMap>,
}

/// What a set of page tables is built from: the arena, and per sequence
/// its pages, KV length and query length.
#[derive(PartialEq)]
struct TablesKey {
    arena: u64,
    pages: Vec<u32>,
    seqs: Vec<(usize, usize, usize)>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.dev)
            .finish()
    }
}

impl CudaBackend {
    /// `positions` on the device (the last upload, while they are equal:
    /// every layer of a step rotates by the same positions).
    fn device_positions(&self, positions: &[usize]) -> Result<Arc<CudaSlice<u32>>, BackendError> {
        let pos: Vec<u32> = positions
            .iter()
            .map(|&p| u32::try_from(p).map_err(|_| shape_err("rope", "position below 2^32", 0, p)))
            .collect::<Result<_, _>>()?;
        self.positions
            .get_or_refill(
                pos,
                || self.dev.moment(),
                |pos, reuse| match reuse {
                    // Same length (a steady batch): same address.
                    Some(mut buf) if buf.len() == pos.len() => {
                        self.dev.overwrite(pos, &mut buf).map(|()| buf)
                    }
                    _ => self.dev.upload(pos),
                },
                |old| self.dev.retire(old),
            )
            .map_err(dev_err)
    }

    /// A backend on an opened device.
    pub fn new(dev: CudaDevice) -> Self {
        CudaBackend {
            dev,
            kv: Mutex::new(None),
            workspace: Mutex::new(DecodeWorkspace::default()),
            device_kv: false,
            bf16_weights: true,
            carry: std::sync::atomic::AtomicBool::new(true),
            decode_kernel: parking_lot::Mutex::new(DecodeKernel::Auto),
            positions: Memo::default(),
            tables_memo: Memo::default(),
            slots_memo: Memo::default(),
        }
    }

    /// Whether a weight matrix whose every element is exactly a bf16 value
    /// (a bf16 checkpoint's), or else exactly an f16 value (an f16
    /// checkpoint's), stays 16-bit on the device and runs on tensor cores
    /// (default: on), or is widened to f32 (the f32 kernels, closest to the
    /// CPU backend's numbers).
    #[must_use]
    pub fn bf16_weights(mut self, on: bool) -> Self {
        self.bf16_weights = on;
        self
    }

    /// Whether engines and workers built with `new` over this backend get
    /// KV pools whose pages live in this device's memory ([`CudaPages`](super::CudaPages):
    /// the append kernel writes them and attention reads them in place, no
    /// row crosses to the host) instead of host pools mirrored to the
    /// device (default: off, until the device-resident path has run on a
    /// GPU in CI). Out of device memory for the pool is a typed
    /// `PoolError::Device` (503) at construction.
    #[must_use]
    pub fn device_kv(mut self, on: bool) -> Self {
        self.device_kv = on;
        self
    }

    /// Whether, with bf16 weights, the feed-forward's SwiGLU rides in the
    /// launch of gate and up (below 128 rows), and the attention and
    /// feed-forward RMSNorms in the launch of the matmul that reads their
    /// output (up to `NORM_CARRY_ROWS` rows). Default: on; a decode layer
    /// at batch 1 then makes 6 launches instead of 9. The bits are those
    /// of the separate kernels either way (a GPU test requires it); off is
    /// for side-by-side timings.
    pub fn set_carried_stages(&self, on: bool) {
        self.carry.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the stages ride in the matmuls' launches
    /// ([`CudaBackend::set_carried_stages`]).
    pub fn carries_stages(&self) -> bool {
        self.carry.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Which decode attention kernel runs (default [`DecodeKernel::Auto`]):
    /// [`DecodeKernel::TensorCoreWide`] for long contexts at small batches,
    /// where it halves each block's walk (see the bench's
    /// `decode_wide_*` lines). The choice holds for every sequence and
    /// step until changed, so outputs stay batch-invariant; a kernel not
    /// compiled for the model's KV (or without its shared memory on this
    /// device) fails the attention with a typed error, never silently
    /// another kernel.
    pub fn set_decode_kernel(&self, kernel: DecodeKernel) {
        *self.decode_kernel.lock() = kernel;
    }

    /// The decode attention kernel asked for
    /// ([`CudaBackend::set_decode_kernel`]).
    pub fn decode_kernel(&self) -> DecodeKernel {
        *self.decode_kernel.lock()
    }

    /// Opens device `ordinal` (see [`CudaDevice::open`]).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        CudaDevice::open(ordinal).map(Self::new)
    }

    /// The bytes a device-resident KV pool may take now: free device memory
    /// (after the weights already placed) less `reserve` for activations
    /// and workspaces, 0 when less is free. Plan the pool from it with
    /// [`crate::EngineConfigBuilder::pool_memory`], whose build refuses a
    /// budget that cannot hold the context window; a pool that then does
    /// not fit the device is a typed `PoolError::Device` (503) at
    /// construction, never a panic.
    pub fn kv_budget(&self, reserve: u64) -> Result<u64, CudaError> {
        let (free, _) = self.dev.memory_info()?;
        Ok((free as u64).saturating_sub(reserve))
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }
}

impl CudaBackend {
    /// The products `ws` (their 16-bit elements `bits`, all of type `h`)
    /// of the `m` rows of `x`, or of their RMSNorm, in one group launch.
    fn half_group<const N: usize>(
        &self,
        x: &CudaBuf,
        m: usize,
        norm: Option<Norm<'_, CudaMat>>,
        (h, bits): (HalfWeights, [&CudaSlice<u16>; N]),
        ws: [&CudaMat; N],
        mut outs: [&mut CudaBuf; N],
    ) -> Result<(), BackendError> {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            out.ensure(&self.dev, m * w.rows)?;
        }
        let ns = ws.map(|w| w.rows);
        let mut views = outs
            .iter_mut()
            .map(|o| o.view_mut())
            .collect::<Result<Vec<_>, _>>()?;
        let x = x.view()?;
        match norm {
            None => self.dev.linear_half_many(h, &x, &bits, &ns, &mut views),
            Some(n) => {
                let weight = n.weight.f32s("the RMSNorm a matmul carries")?;
                self.dev
                    .linear_half_many_normed(h, &x, weight, n.eps, &bits, &ns, &mut views)
            }
        }
        .map_err(dev_err)
    }
}

fn dev_err(e: CudaError) -> BackendError {
    match e {
        CudaError::TokenOutOfRange { token, vocab } => {
            BackendError::TokenOutOfRange { token, vocab }
        }
        CudaError::Unsupported { what, detail } => BackendError::Unsupported { what, detail },
        other => BackendError::Device(other.to_string()),
    }
}
