//! The servers that run a model: the colocated [`Engine`] and the two
//! halves of a disaggregated deployment, [`PrefillWorker`] and
//! [`DecodeWorker`], over one generation core.
//!
//! - `generate` (the core): each request's client record (sampler, token
//!   stream, canceller), the running sequences, the batched decode pass,
//!   streaming, and ending every request exactly once with its count
//!   ([`Tally`]). Both servers that generate are built on it.
//! - [`Engine`]: the core plus admission, batched prefill and preemption.
//!   Each [`Engine::step`] applies cancellations, asks the scheduler for a
//!   plan (preempt the newest sequences if the running ones cannot all grow,
//!   else admit what fits), prefills the admitted requests in one pass and
//!   decodes every other running sequence in another.
//! - [`DecodeWorker`]: the core plus landing verified KV from a
//!   [`crate::transfer::DecodeSide`]; [`PrefillWorker`] computes KV for a
//!   [`crate::transfer::PrefillSide`]. The transfer layer below moves and
//!   verifies KV and knows nothing of models.
//!
//! Tokens stream to each request's [`RequestHandle`], ending in one
//! [`Outcome`]. A failure inside a batched pass fails the request at fault;
//! on the colocated engine the others in that pass are preempted and
//! recomputed, never served from KV the failed pass half-wrote.
//!
//! # Reading a request's tokens
//!
//! [`RequestHandle::wait`] blocks for the whole answer. To stream, read
//! [`RequestHandle::events`] ([`Events`]: `try_recv`, `recv`,
//! `recv_timeout`, `try_iter`, with a channel receiver's names and errors)
//! for each [`Event::Token`] and the one [`Event::Done`] that ends it.
//! [`Events`] is not `Clone` and does not take part in a channel `select!`.
//! An async host awaits [`Events::recv_async`] instead: the engine wakes
//! the waiting task, with no runtime of its own and no thread per stream.
//!
//! # Prefix cache and chunked prefill
//!
//! Both are on by default in [`Engine`] ([`EngineOptions`]`{ prefix_cache,
//! chunked_prefill, .. }`), and the prefix cache in [`PrefillWorker`]; a
//! request opts out with [`crate::Request::with_prefix_cache`]. The cache's
//! keys chain a salt derived from a server secret and the
//! [`crate::TenantId`] ([`crate::kv::PrefixKeys`]), so one tenant never
//! reuses another's pages.
//!
//! # Disaggregated serving
//!
//! [`PrefillWorker`] and [`DecodeWorker`] are built from
//! [`crate::EngineConfig::prefill`] and [`crate::EngineConfig::decode`]
//! over a [`crate::transfer::Transfer`] (in-process, TCP, or NIXL). Decode
//! admits the request and reserves destination pages, prefill computes and
//! sends the KV with a receipt, and decode starts only from a
//! `KvSeq<Ready>` that its verifier produced after checking the receipt
//! against the plan and the bytes that landed. Both generate on the core
//! above: [`DecodeWorker::step`] and [`DecodeWorker::run_until_idle`] are
//! the engine's. A host whose clients arrive on many threads puts either
//! server behind `handoff::service::Service`.

mod colocated;
mod decode_worker;
mod error;
pub(crate) mod events;
mod filling;
mod generate;
mod prefill_worker;
pub(crate) mod setup;
mod stream;
mod tally;
pub mod verify;

pub use colocated::{Engine, EngineOptions};
pub use decode_worker::DecodeWorker;
pub use error::EngineError;
pub use events::{Event, Events, Recv, RecvError, RecvTimeoutError, TryRecvError};
pub use prefill_worker::PrefillWorker;
pub use stream::{Canceller, FinishReason, Outcome, RequestHandle};
pub use tally::Tally;
