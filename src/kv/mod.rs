//! Paged KV storage whose handles cannot go stale.
//!
//! - [`KvPool`]: fixed capacity, O(1) page allocation and release, page
//!   generations, accounting `free + in_use + held + cached == capacity`.
//! - [`KvSeq`]: the owning handle of one sequence's pages, with its protocol
//!   state as a type parameter ([`Filling`], [`Received`], [`Ready`], [`Held`]).
//! - [`KvReader`] / [`SeqView`] / [`LayerView`]: validated reads of written
//!   positions only, checked against the audit trail when it is on.
//! - [`PrefixCache`]: full pages shared read-only between sequences of one
//!   tenant, keyed by a salted hash chain ([`PrefixKeys`]), evicted LRU.
//!
//! # Where the page bytes live
//!
//! A pool's page bytes live in host memory ([`KvPool::new`]) or in a
//! backend's device memory ([`KvPool::with_device_pages`], given a
//! [`DevicePages`]; on a GPU, `backend::cuda::CudaPages::for_pool`). Either
//! way the host keeps every page's owner, generation and written counts,
//! and the audit trail. Engines and workers built with `new` ask their
//! backend for the pool (`Backend::new_pool`): host memory
//! by default, device memory from `CudaBackend::new(dev).device_kv(true)`.
//! `EngineConfigBuilder::pool_memory` sizes a pool from a memory
//! budget instead of a token count.
//!
//! Views of a device-resident pool lend no rows in place
//! ([`LayerView::key`] is `None`): read them with
//! [`LayerView::copy_key_f32`] and [`LayerView::copy_value_f32`]. A
//! backend's kernel writes rows into such a pool through
//! [`KvSeq::device_append`], which hands out the slots it may write, then
//! [`DeviceAppend::commit`], which counts them. On the host a backend
//! appends a whole batch's rows with [`KvSeq::append_each`], which checks
//! every sequence before writing any.
//!
//! # Element types
//!
//! [`KvDtype`] sets the pages' element type: f32 (the default), bf16, f16,
//! or [`KvDtype::F8E4M3`], FP8 E4M3 bytes, half of bf16's, so a
//! `pool_memory` budget holds twice the context. FP8 values are stored
//! unscaled, rounded to nearest even and saturated at ±448 ([`F8E4M3`]; the
//! CUDA kernels store the same bytes with the device's `cvt`), and
//! attention still accumulates in f32. On the test model the logits move
//! by 3.0-4.3% of their RMS against f32 KV (`tests/model/fp8_kv_cache.rs`
//! bounds it at 6%), against 0.2-0.4% for bf16 KV. On a GPU, bf16, f16 and
//! FP8 KV run the tensor-core attention kernels for the head sizes they are
//! built for (FP8 tiles widened to f16 in shared memory).

mod cache_index;
pub(crate) mod device;
mod error;
mod fp8;
mod geometry;
mod page;
mod pool;
mod prefix;
mod prefix_key;
mod seq;
pub(crate) use seq::Tamper;
mod storage;
mod view;

pub use cache_index::CacheCounters;
pub use device::{DeviceError, DevicePages, Residence, StagedHostPages};
pub use error::{KvError, PoolError};
pub use fp8::F8E4M3;
pub use geometry::{KvDtype, KvGeometry};
pub use page::{PageId, PoolId, pages_for};
pub use pool::{KvPool, PoolConfig, PoolStats, ScrubPolicy};
pub use prefix::PrefixCache;
pub(crate) use prefix::reserve_prompt;
pub use prefix_key::{CacheSecret, PageKey, PrefixKeys};
pub use seq::{
    DeviceAppend, Filling, Held, KvSeq, Readable, Ready, Received, SealError, SeqState, Settled,
    Writable,
};
pub use storage::{KvElem, KvSlice};
pub use view::{KvReader, LayerView, SeqView};
