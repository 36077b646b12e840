//! Disaggregated prefill/decode: the handoff of a prompt's KV from the
//! worker that computed it to the worker that decodes from it, which is the
//! security boundary this crate exists for.
//!
//! Three folders, one concern each:
//!
//! - [`protocol`]: what is said and what is checked, independent of how the
//!   bytes move. The messages (plan, write batch, receipt, abort, answer);
//!   the two sides' state machines, [`DecodeSide`] (admits, reserves
//!   destination pages, plans, and verifies every receipt against its plan
//!   and the bytes that landed: only the verifier produces [`VerifiedKv`],
//!   the only source of a `KvSeq<Ready>` from a transfer) and
//!   [`PrefillSide`] (refuses plans beyond its limits with a typed abort, no
//!   receipt, no placeholder; computes, sends, and holds the source pages
//!   until decode answers or the transfer is abandoned and drained); the
//!   pure verifier (`protocol::verify`) and the checksums it compares.
//! - [`link`]: how the bytes move. The [`Transfer`] transports —
//!   [`InProcess`] (threads, one memory copy), [`Tcp`] (framed, bounded;
//!   loopback without worker identities, any address with them: each
//!   worker has its own key ([`identity`]: `WorkerKey`, `PeerId`, the
//!   operator's `Allowlist`), [`auth`] authenticates both ends against
//!   their allowlists and seals every frame, and a plan's receipt counts
//!   only from the peer it was addressed to), and with the `nixl`
//!   feature `Nixl` (the decode end READs the KV bytes by NIXL straight
//!   from the prefill end's held pages into its own, from inside the landing
//!   zone's fence; everything else on authenticated TCP; see `nixl`), each
//!   with a cap on KV bytes in flight — and the decode end's
//!   [`LandingZone`].
//! - [`testing`]: the seams tests reach through. With the `fault-injection`
//!   feature (always on in this crate's tests) `fault`'s `FaultPlan` drops,
//!   delays, duplicates, reorders, truncates or corrupts messages and KV
//!   bytes, or disconnects the peer, and kills a worker, cancels a client,
//!   exhausts a pool or makes admission reject, at any protocol step (see
//!   RELIABILITY.md); without it the links' gates pass every message
//!   through. [`synthetic`] KV exercises transfers without a model.
//!
//! The workers that run a model on each side, `engine::PrefillWorker` and
//! `engine::DecodeWorker`, live in the engine layer above this one: nothing
//! here knows a model, a sampler or a request handle.
//!
//! # KV in device memory
//!
//! Between two device-resident pools in one process a transfer copies
//! device to device, and the receipt's checksums are hashed on the device
//! ([`crate::kv::DevicePages::copy_from`],
//! [`crate::kv::DevicePages::xxh3_ranges`]), so no KV row crosses to the
//! host. Across processes (TCP, or NIXL into device pages) the rows cross
//! through the host: each batch is read on the prefill end and landed on
//! the decode end in one staged pass per layer through page-locked memory
//! ([`crate::kv::DevicePages::read_runs`],
//! [`crate::kv::DevicePages::write_runs`]), one wait for the device instead
//! of one per page run.
//!
//! ```
//! use std::time::Duration;
//! use handoff::transfer::{synthetic, DecodeSide, InProcess, PrefillSide, Transfer, TransferConfig};
//! use handoff::{AdmissionLimits, KvDtype, KvGeometry, KvPool, PoolConfig, Request, RequestId, TenantId};
//!
//! let g = KvGeometry { n_layers: 2, n_kv_heads: 2, head_dim: 4, dtype: KvDtype::BF16 };
//! let prefill_pool = KvPool::new(PoolConfig::new(g, 16, 8))?;
//! let decode_pool = KvPool::new(PoolConfig::new(g, 16, 8))?;
//! let cfg = TransferConfig::default();
//! let (p_link, d_link) = InProcess.connect(&cfg)?;
//! let mut prefill = PrefillSide::new(p_link, prefill_pool, AdmissionLimits::new(64, 8, 16), cfg.clone());
//! let mut decode = DecodeSide::new(d_link, decode_pool.clone(), AdmissionLimits::new(64, 8, 16), cfg);
//!
//! let id = RequestId(1);
//! let _ticket = decode.submit(Request::new(id, TenantId(7), vec![1; 20], 4))?;
//! let mut job = prefill.next_job()?;
//! synthetic::fill(job.seq_mut(), id, 20)?;
//! prefill.complete(job, None)?;
//!
//! let outcome = decode.poll(Duration::from_secs(5)).pop().unwrap();
//! let verified = outcome.result?;
//! assert_eq!(verified.seq().complete_len(), Some(20));
//! assert_eq!(synthetic::check(&decode_pool, verified.seq(), id)?, Ok(()));
//! drop(verified);
//! prefill.poll(Duration::from_millis(100))?; // the ack releases the source pages
//! assert!(decode_pool.stats().is_full() && prefill.pool().stats().is_full());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod config;
mod error;
pub mod link;
#[cfg(handoff_loom)]
#[doc(hidden)]
pub mod loom_api;
pub mod protocol;
pub mod testing;

pub use link::auth;
pub use link::identity;
#[cfg(feature = "nixl")]
pub use link::nixl;
pub use link::tcp;
pub use protocol::checksum;
#[cfg(any(test, feature = "fault-injection"))]
pub use testing::fault;
pub use testing::synthetic;

pub use auth::AuthError;
pub use config::TransferConfig;
pub use error::{IntegrityError, LinkError, TransferError, Wait, WireError, WriteRefusal};
#[cfg(any(test, feature = "fault-injection"))]
pub use fault::{Fault, FaultPlan, FaultRule};
pub use link::identity::{Allowlist, Identity, IdentityError, PeerId, WorkerKey};
pub use link::{
    DecodeLink, InFlightStats, InProcess, InProcessDecode, InProcessPrefill, LandingZone,
    PrefillLink, Transfer,
};
#[cfg(feature = "nixl")]
pub use nixl::{Nixl, NixlConfig};
pub use protocol::{
    Abort, AbortReason, Answer, CancelOutcome, DecodeOutcome, DecodeSide, DecodeStats, FailReason,
    Nonce, POLL_BURST, Plan, PlannedPage, PrefillJob, PrefillSide, PrefillStats, Receipt, ToDecode,
    ToPrefill, Verdict, VerifiedKv, WriteBatch, WriterRun,
};
pub use tcp::{Refusal, Tcp, TcpAuth, TcpDecode, TcpDecodeListener, TcpPrefill};
pub use testing::Step;
