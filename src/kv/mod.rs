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
    DeviceAppend, Filling, Held, KvSeq, Readable, Ready, Received, SealError, SeqState, Writable,
};
pub use storage::{KvElem, KvSlice};
pub use view::{KvReader, LayerView, SeqView};
