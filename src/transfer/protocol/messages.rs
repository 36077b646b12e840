//! The messages of the handoff protocol.
//!
//! Every message that crosses the link is a *claim* by the peer and is
//! checked by the receiver: fields are plain data on purpose, since a peer
//! (or a fault) can put anything in them. The invariants live in the sides
//! that act on them ([`crate::transfer::DecodeSide`] verifies every receipt
//! against the plan it made; [`crate::transfer::PrefillSide`] checks every
//! plan against its own limits before computing anything).
//!
//! Flow, one request:
//!
//! ```text
//! decode                                  prefill
//!   admit, reserve destination pages
//!   Plan{request, nonce, pages@gen} ───▶  check limits (Abort{reason} if not)
//!                                         compute KV, hold source pages
//!                              ◀─────── Write{layer, start, tokens} + bytes (bounded in flight)
//!                              ◀─────── Receipt{per-layer counts, pages, checksums, writers}
//!   verify against plan and landed bytes
//!   Ack / Fail ─────────────────────────▶ release held source pages
//! ```

use std::fmt;

use crate::fingerprint::ModelFingerprint;
use crate::ids::{RequestId, TenantId};
use crate::kv::KvGeometry;
use crate::kv::PageId;
use crate::sampling::SamplingParams;
use crate::sampling::TokenLogprobs;
use crate::transfer::link::identity::PeerId;

/// A fresh random value per plan: a receipt is matched to the plan that
/// asked for it, not just to a request id that could be reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Nonce(pub u64);

impl Nonce {
    /// A fresh, unpredictable nonce (process-random keys over a counter).
    pub fn fresh() -> Self {
        use std::hash::{BuildHasher, Hasher};
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        Nonce(h.finish())
    }
}

impl fmt::Display for Nonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "nonce {:016x}", self.0)
    }
}

/// A destination page at the generation the plan reserved it at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlannedPage {
    pub index: u32,
    pub generation: u64,
}

impl From<PageId> for PlannedPage {
    fn from(p: PageId) -> Self {
        PlannedPage {
            index: p.index(),
            generation: p.generation(),
        }
    }
}

/// Decode's request for a prompt's KV: what to compute and where it lands.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub request: RequestId,
    pub tenant: TenantId,
    pub nonce: Nonce,
    /// The prompt to compute. Its length is the expected token count.
    pub prompt: Vec<u32>,
    /// Tokens every layer must receive (`prompt.len()`).
    pub tokens: u32,
    /// KV shape and element type the destination stores.
    pub geometry: KvGeometry,
    /// Token slots per destination page (checksums are per destination page).
    pub page_size: u32,
    /// Destination pages, in position order, with their generations.
    pub pages: Vec<PlannedPage>,
    /// How to choose the first token from the prompt's last logits (prefill
    /// samples it, decode continues the same stream).
    pub sampling: SamplingParams,
    /// The model decode serves ([`TransferConfig::with_model`]); prefill
    /// computes the KV only with the same model.
    ///
    /// [`TransferConfig::with_model`]: crate::transfer::TransferConfig::with_model
    pub model: Option<ModelFingerprint>,
    /// The prefill worker the plan is addressed to: the authenticated peer
    /// of the link it is sent on (`None` on a link whose peer proved
    /// nothing). Only a receipt from that peer, on that link, can complete
    /// it; a prefill worker refuses a plan addressed to another.
    pub peer: Option<PeerId>,
    /// Whether prefill may start from (and add to) its prefix cache for
    /// this request ([`crate::Request::with_prefix_cache`]).
    pub prefix_cache: bool,
}

/// One batch of KV rows: `tokens` positions from `start` of one layer, K
/// rows then V rows, in the destination's storage dtype. The bytes travel
/// as the transport sees fit (memory copy, socket, device copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteBatch {
    pub request: RequestId,
    pub nonce: Nonce,
    pub layer: u32,
    pub start: u32,
    pub tokens: u32,
}

/// Who wrote a run of positions of one layer (the audit trail, carried
/// across the transfer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriterRun {
    pub layer: u32,
    pub start: u32,
    pub len: u32,
    pub writer: RequestId,
}

/// Prefill's claim that a plan's KV has been written.
#[derive(Clone, Debug, PartialEq)]
pub struct Receipt {
    pub request: RequestId,
    pub nonce: Nonce,
    /// Tokens written, per layer.
    pub layer_tokens: Vec<u32>,
    /// The destination pages written, echoed from the plan.
    pub pages: Vec<PlannedPage>,
    /// Per destination page: the checksum of the bytes written to it
    /// (see [`crate::transfer::protocol::checksum`]).
    pub page_checksums: Vec<u64>,
    /// Who wrote every written position (from prefill's audit trail).
    pub writers: Vec<WriterRun>,
    /// The token sampled from the prompt's last-position logits, when the
    /// prefill worker runs a model.
    pub first_token: Option<u32>,
    /// That token's log-probabilities, when the request asked for them
    /// (decode checks they name `first_token` and the alternatives asked).
    pub first_logprobs: Option<TokenLogprobs>,
}

/// Why prefill refused a plan. No receipt follows an abort, ever.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AbortReason {
    /// The prompt is empty.
    EmptyPrompt,
    /// The prompt exceeds prefill's context window.
    PromptTooLong { prompt: u64, max_context: u64 },
    /// The prompt can never fit prefill's KV pool.
    ExceedsPool { tokens: u64, pool_tokens: u64 },
    /// A prompt token is outside the model's vocabulary.
    InvalidToken { index: u64, token: u32, vocab: u64 },
    /// The plan is inconsistent (token count, pages, page size) or asks for
    /// a KV geometry this worker does not produce.
    MalformedPlan,
    /// Prefill's audit trail found a source slot not written by the
    /// request: nothing is sent.
    IsolationViolation,
    /// Computing the KV failed.
    ComputeFailed,
    /// The prefill worker is shutting down.
    ShuttingDown,
    /// Prefill already has `pending` plans waiting for pages (its queue
    /// limit): retry later.
    Busy { pending: u64 },
    /// The plan is for another model than prefill serves (`None`: not
    /// named): the two workers run different weights, a deployment error.
    ModelMismatch {
        planned: Option<ModelFingerprint>,
        served: Option<ModelFingerprint>,
    },
}

impl AbortReason {
    /// The admission rejection this reason corresponds to, if it is one.
    pub fn to_rejection(&self, id: RequestId) -> Option<crate::sched::Rejection> {
        use crate::sched::Rejection;
        let sat = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
        Some(match *self {
            AbortReason::EmptyPrompt => Rejection::EmptyPrompt { id },
            AbortReason::PromptTooLong {
                prompt,
                max_context,
            } => Rejection::PromptTooLong {
                id,
                prompt: sat(prompt),
                max_context: sat(max_context),
            },
            AbortReason::ExceedsPool {
                tokens,
                pool_tokens,
            } => Rejection::ExceedsPool {
                id,
                tokens: sat(tokens),
                pool_tokens: sat(pool_tokens),
            },
            AbortReason::InvalidToken {
                index,
                token,
                vocab,
            } => Rejection::InvalidToken {
                id,
                index: sat(index),
                token,
                vocab: sat(vocab),
            },
            AbortReason::ShuttingDown => Rejection::ShuttingDown { id },
            AbortReason::Busy { pending } => Rejection::QueueFull {
                id,
                limit: sat(pending),
            },
            _ => return None,
        })
    }
}

impl fmt::Display for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbortReason::EmptyPrompt => write!(f, "empty prompt"),
            AbortReason::PromptTooLong {
                prompt,
                max_context,
            } => write!(
                f,
                "prompt of {prompt} tokens exceeds the prefill window of {max_context}"
            ),
            AbortReason::ExceedsPool {
                tokens,
                pool_tokens,
            } => write!(
                f,
                "{tokens} tokens can never fit the prefill pool of {pool_tokens}"
            ),
            AbortReason::InvalidToken {
                index,
                token,
                vocab,
            } => write!(
                f,
                "token {token} at index {index} is outside the vocabulary of {vocab}"
            ),
            AbortReason::MalformedPlan => write!(f, "malformed plan"),
            AbortReason::IsolationViolation => write!(f, "isolation violation in source KV"),
            AbortReason::ComputeFailed => write!(f, "KV computation failed"),
            AbortReason::ShuttingDown => write!(f, "prefill worker shutting down"),
            AbortReason::Busy { pending } => {
                write!(f, "prefill has {pending} plans waiting (its queue limit)")
            }
            AbortReason::ModelMismatch { planned, served } => {
                let name = |m: &Option<ModelFingerprint>| {
                    m.map_or_else(|| "an unnamed model".to_string(), |m| format!("model {m}"))
                };
                write!(
                    f,
                    "decode planned for {} but prefill serves {}: deploy the same weights and \
                     configuration on both workers",
                    name(planned),
                    name(served)
                )
            }
        }
    }
}

/// Prefill's refusal of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abort {
    pub request: RequestId,
    pub nonce: Nonce,
    pub reason: AbortReason,
}

/// Why decode gave up on a transfer (prefill releases its held pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailReason {
    /// The receipt did not verify.
    Integrity,
    /// No receipt came in time.
    Timeout,
    /// The client cancelled or disconnected.
    Cancelled,
}

/// Decode's answer to a receipt, or its notice that a transfer is over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Verified: the source pages may be released.
    Ack,
    /// Failed: the source pages may be released; nothing was used.
    Fail(FailReason),
}

/// Decode's answer for one transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    pub request: RequestId,
    pub nonce: Nonce,
    pub verdict: Verdict,
}

/// Control messages from decode to prefill.
#[derive(Clone, Debug, PartialEq)]
pub enum ToPrefill {
    Plan(Plan),
    Answer(Answer),
}

/// Control messages from prefill to decode. They travel in order with the
/// KV writes: a receipt is delivered after every write sent before it has
/// landed.
#[derive(Clone, Debug, PartialEq)]
pub enum ToDecode {
    Receipt(Receipt),
    Abort(Abort),
}

impl ToPrefill {
    /// The request the message is about.
    pub fn request(&self) -> RequestId {
        match self {
            ToPrefill::Plan(p) => p.request,
            ToPrefill::Answer(a) => a.request,
        }
    }
}

impl ToDecode {
    /// The request the message is about.
    pub fn request(&self) -> RequestId {
        match self {
            ToDecode::Receipt(r) => r.request,
            ToDecode::Abort(a) => a.request,
        }
    }
}
