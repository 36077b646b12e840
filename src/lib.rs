//! # handoff
//!
//! An embeddable LLM inference engine with paged KV caches, continuous
//! batching and disaggregated prefill/decode, built so that a request can
//! never read another request's KV.
//!
//! The whole handoff, as the types enforce it: a prefill worker computes a
//! prompt's KV and sends it with a receipt; the decode worker admits the
//! request, reserves destination pages, verifies the receipt against its
//! plan and the bytes that landed, and only then decodes.
//!
//! ```
//! use std::sync::atomic::{AtomicBool, Ordering};
//! use std::sync::Arc;
//! use handoff::model::{Model, ModelConfig, random_weights};
//! use handoff::transfer::{InProcess, Transfer, TransferConfig};
//! use handoff::{
//!     DecodeWorker, EngineConfig, HttpStatus, KvDtype, Outcome, PrefillWorker, Request, RequestId,
//!     TenantId,
//! };
//!
//! let model_cfg = ModelConfig::tiny_gqa();
//! let geometry = model_cfg.kv_geometry(KvDtype::BF16);
//!
//! // 1. Fail closed: a pool that cannot hold the window does not build
//! //    (2x the window for prefill, as the incident's remediation asks).
//! assert!(EngineConfig::prefill(geometry)
//!     .max_context(1_048_576).pool_tokens(681_280).build().is_err());
//! let prefill_cfg = EngineConfig::prefill(geometry)
//!     .max_context(128).pool_tokens(256).build()?;
//! let decode_cfg = EngineConfig::decode(geometry)
//!     .max_context(128).pool_tokens(256).build()?;
//!
//! // 2. Two workers joined by a transport (InProcess here; Tcp for two processes).
//! let transfer = TransferConfig::default();
//! let (to_decode, to_prefill) = InProcess.connect(&transfer)?;
//! let mut prefill = PrefillWorker::new(
//!     to_decode, Model::cpu(random_weights(&model_cfg, 1))?, prefill_cfg, transfer.clone())?;
//! let mut decode = DecodeWorker::new(
//!     to_prefill, Model::cpu(random_weights(&model_cfg, 1))?, decode_cfg, transfer)?;
//! let stop = Arc::new(AtomicBool::new(false));
//! let prefill_thread = {
//!     let stop = stop.clone();
//!     std::thread::spawn(move || { let _ = prefill.run(&stop); prefill.shutdown(); prefill })
//! };
//!
//! // 3. Admission answers at once: an oversized prompt is refused with a typed
//! //    error before a page is allocated; nothing is truncated or replaced.
//! let refused = decode.submit(Request::new(RequestId(1), TenantId(7), vec![1; 300], 4));
//! assert_eq!(refused.unwrap_err().http_status(), 413);
//! let handle = decode.submit(Request::new(RequestId(2), TenantId(7), vec![1, 5, 9, 2], 6))?;
//!
//! // 4. Decode plans, prefill computes and sends, decode verifies the receipt
//! //    (request, nonce, per-layer counts, pages, checksums of the landed bytes)
//! //    and only then generates.
//! decode.run_until_idle();
//! let (tokens, outcome) = handle.try_collect();
//! assert_eq!(tokens.len(), 6);
//! assert!(matches!(outcome, Some(Outcome::Finished(_))));
//!
//! // 5. Every page is back on both sides; the audit trail saw no cross read.
//! stop.store(true, Ordering::Release);
//! let prefill = prefill_thread.join().unwrap();
//! assert!(decode.pool().stats().is_full() && prefill.pool().stats().is_full());
//! assert_eq!(decode.pool().stats().isolation_violations, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Underneath, [`KvPool`] hands out pages only inside a [`KvSeq`] whose type
//! carries its protocol state: `Filling` (written locally), `Received`
//! (written by a peer: unreadable), `Ready` (complete or verified: decode
//! reads it), `Held` (out of use until no write can land). See
//! [`kv`] for the handle rules and ARCHITECTURE.md for the map.
//!
//! A host serving clients from many threads puts its [`Engine`] or decode
//! worker behind a [`service::Service`]; [`model::Model::load`] reads and
//! places a checkpoint one layer at a time.

#![forbid(unsafe_op_in_unsafe_fn)]

pub mod backend;
pub mod config;
pub mod engine;
pub mod fingerprint;
pub mod format;
pub mod http;
pub mod ids;
pub mod kv;
pub mod model;
pub mod request;
mod rng;
pub mod sampling;
pub mod sched;
pub mod service;
mod sync;
pub mod text;
pub mod transfer;

pub use config::{
    Colocated, ColocatedConfig, ConfigError, DEFAULT_MAX_QUEUE, Decode, DecodeConfig, EngineConfig,
    EngineConfigBuilder, Headroom, Prefill, PrefillConfig, Role, RoleKind,
};
pub use engine::{
    Canceller, DecodeWorker, Engine, EngineError, EngineOptions, Event, Events, FinishReason,
    Outcome, PrefillWorker, RequestHandle, Tally,
};
pub use http::HttpStatus;
pub use ids::{RequestId, TenantId};
pub use kv::{
    KvDtype, KvError, KvGeometry, KvPool, KvSeq, PoolConfig, PoolError, PoolStats, ScrubPolicy,
};
pub use request::{Priority, Request};
pub use sampling::SamplingParams;
pub use sched::{AdmissionLimits, BatchLimits, Rejection, Scheduler, Ticket};

/// The README's examples, compiled and run as doctests so they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
