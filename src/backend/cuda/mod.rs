//! CUDA backend (feature `cuda`): hand-written kernels in `cuda/`, compiled
//! by build.rs into an embedded fatbin and launched through cudarc.
//!
//! - [`CudaBackend`]: the [`crate::backend::Backend`] trait on the GPU, with
//!   KV pages mirrored from the host pool (see `backend.rs`).
//! - [`CudaDevice`]: context, stream and loaded kernels; the kernel
//!   operations are its methods, one file per op family under `ops/` (the
//!   one module with `unsafe` launches, all through one `launch` in
//!   `ops/queue.rs`).
//! - The kernel table (`table/`): every instantiation and params layout,
//!   from which build.rs generates the C++ entry points, the Rust params
//!   structs (`params.rs`), the layout checks of both sides and the typed
//!   `KernelId` lookups (`kernels.rs`).
//! - Launch policy (`plan/`): kernel choice, split-KV chunking, workspace,
//!   matmul tiles and grid sizes, planned from sizes alone before a launch.
//! - [`HalfWeights`] / [`QuantWeights`]: weights kept in 16 bits or in ggml
//!   blocks (`weights.rs`).
//! - CUDA graphs (`graph.rs`, [`CudaDevice::set_graphs`]): a pass's launches
//!   recorded and replayed as one graph when an equal list was captured.
//! - [`DeviceKvArena`]: KV pages in device memory, the host arena's layout.
//! - [`CudaPages`]: a device-resident pool's page bytes
//!   ([`crate::kv::DevicePages`]), scrubbed and copied on the stream; a
//!   transfer batch's runs staged through page-locked memory in one pass.
//! - [`PageTables`] / [`SlotMap`]: page tables and append slots, validated
//!   against the arena before they can reach a kernel.
//!
//! # Choosing kernels and launches
//!
//! [`CudaBackend::new`]`(dev).device_kv(true)` keeps a pool's pages in
//! device memory ([`CudaPages::for_pool`]; see [`crate::kv`] for what that
//! changes for views and appends). [`CudaBackend::set_decode_kernel`] picks
//! the decode attention kernel for every sequence and step:
//! [`DecodeKernel::TensorCoreWide`] runs eight warps a block, for long
//! contexts at small batches (not yet timed on a GPU, so
//! [`DecodeKernel::Auto`] keeps the four-warp kernel); a kernel with no
//! build for the pool's KV dtype fails the step with a typed error.
//! [`CudaDevice::set_graphs`]`(true)` (off by default until it has run on a
//! GPU) replays each decode step's launches as one CUDA graph once the same
//! launches have been seen twice: the same kernels with the same parameter
//! bytes, so the same bits as launching them one by one.

mod arena;
mod backend;
mod device;
mod error;
mod graph;
mod kernels;
mod memo;
mod ops;
mod pages;
mod params;
mod plan;
// Shared with build.rs, which reads the instantiation list and the params
// layouts; the crate uses the axes and tile sizes.
#[allow(dead_code, unused_imports)]
mod table;
mod weights;

pub use arena::{DeviceKvArena, PageTables, SeqPages, SlotMap};
pub use backend::{CudaBackend, CudaBuf, CudaMat};
pub use cudarc::driver::CudaSlice;
pub use device::CudaDevice;
pub use error::CudaError;
pub use ops::{AttnKv, DecodeWorkspace, PageChecksums, Rows, Write};
pub use pages::CudaPages;
pub use plan::{DecodeKernel, PREFILL_MAX_GROUP, PrefillKernel, Split};
pub use table::{
    DECODE_GROUPS, DECODE_MMA_GROUPS, DECODE_MMA_HEAD_DIMS, HEAD_DIMS, LGEMM_BM, LIN_ROWS_FEW,
    LIN_ROWS_MANY, LIN_ROWS_ONE, LMMA_WIDE_BM, PREFILL_MMA_HEAD_DIMS,
};
pub use weights::{HalfWeights, QuantWeights};

/// Opens device 0 for a test or benchmark, or says why not.
///
/// Returns `None` after writing `SKIP <name>: <reason>` to stderr when no
/// GPU is usable, unless `HANDOFF_REQUIRE_GPU=1`, in which case it panics
/// (a GPU run must not pass by skipping).
#[doc(hidden)]
pub fn device_for_test(name: &str) -> Option<CudaDevice> {
    use std::io::Write;
    match CudaDevice::open(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            if std::env::var("HANDOFF_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("{name}: HANDOFF_REQUIRE_GPU=1 but the GPU is unusable: {e}");
            }
            let _ = writeln!(std::io::stderr(), "SKIP {name}: {e}");
            None
        }
    }
}
