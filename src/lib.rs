//! # handoff
//!
//! An embeddable LLM inference engine with paged KV caches, continuous
//! batching and disaggregated prefill/decode, built so that a request can
//! never read another request's KV.
//!
//! The life cycle of a request, as the types enforce it:
//!
//! ```
//! use handoff::{
//!     EngineConfig, KvDtype, KvGeometry, KvPool, Request, RequestId, Role, Scheduler,
//!     AdmissionLimits, TenantId, HttpStatus,
//! };
//!
//! let geometry = KvGeometry { n_layers: 2, n_kv_heads: 2, head_dim: 4, dtype: KvDtype::F32 };
//!
//! // 1. Fail closed: a pool that cannot hold the window (2x for prefill) is refused.
//! assert!(EngineConfig::builder(Role::Prefill, geometry)
//!     .max_context(1_048_576).pool_tokens(681_280).build().is_err());
//! let cfg = EngineConfig::builder(Role::Colocated, geometry)
//!     .max_context(64).page_size(16).pool_tokens(128).build()?;
//!
//! // 2. Admission answers at once, before anything is allocated.
//! let mut sched = Scheduler::new(AdmissionLimits::from_config(&cfg));
//! let too_long = Request::new(RequestId(1), TenantId(7), vec![1; 65], 1);
//! assert_eq!(sched.submit(too_long).unwrap_err().http_status(), 413);
//! let ticket = sched.submit(Request::new(RequestId(2), TenantId(7), vec![1, 2, 3], 4))?;
//!
//! // 3. Pages come inside an owning handle; writes are bounded by the reservation.
//! let pool = KvPool::new(cfg.pool_config())?;
//! let req = sched.pop_if(|r| pool.stats().free >= pool.pages_for(r.max_total_tokens())).unwrap();
//! let mut seq = pool.reserve(ticket.id(), req.max_total_tokens())?;
//! let row = vec![0.5f32; geometry.kv_dim() * req.prompt.len()];
//! for layer in 0..geometry.n_layers {
//!     seq.append(layer, &row, &row)?;
//! }
//!
//! // 4. Only complete KV becomes `Ready` for decode; reads cover written positions only.
//! let seq = seq.seal(req.prompt.len()).map_err(|e| e.error)?;
//! {
//!     let reader = pool.reader();
//!     let view = reader.seq(&seq)?.layer(0)?;
//!     assert_eq!(view.len(), 3);
//!     assert!(view.key(3).is_none());
//! }
//!
//! // 5. Dropping the handle scrubs and frees its pages; accounting returns to full.
//! seq.release();
//! sched.finish(ticket.id());
//! assert!(pool.stats().is_full());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_op_in_unsafe_fn)]

pub mod backend;
pub mod config;
pub mod engine;
pub mod http;
pub mod ids;
pub mod kv;
pub mod model;
pub mod request;
mod rng;
pub mod sampling;
pub mod sched;
mod sync;
pub mod transfer;

pub use config::{
    ConfigError, EngineConfig, EngineConfigBuilder, Headroom, KvDtype, KvGeometry, Role,
};
pub use engine::{
    Canceller, Engine, EngineError, EngineOptions, Event, FinishReason, Outcome, RequestHandle,
    StepReport,
};
pub use http::HttpStatus;
pub use ids::{RequestId, TenantId};
pub use kv::{KvError, KvPool, KvSeq, PoolConfig, PoolStats, ScrubPolicy};
pub use request::{Priority, Request, SamplingParams};
pub use sched::{AdmissionLimits, BatchLimits, Rejection, Scheduler, Ticket};
