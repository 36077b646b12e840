//! Errors of the transfer layer. A transfer that fails for any reason ends
//! its request with one of these; nothing is generated from its KV.

use crate::http::HttpStatus;
use crate::ids::RequestId;
use crate::kv::KvError;
use crate::transfer::link::auth::AuthError;
use crate::transfer::link::identity::{IdentityError, PeerId};
use crate::transfer::protocol::{AbortReason, Nonce, PlannedPage};

/// What a side was waiting for when its timeout expired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Prefill, for the next plan.
    Plan,
    /// Decode, for the receipt of a plan it sent.
    Receipt,
    /// Prefill, for decode's answer to a receipt it sent.
    Ack,
    /// Prefill, for room under the cap on KV bytes in flight.
    WriteCredit,
}

/// A frame on the TCP link that cannot be accepted. The connection is
/// closed at once; no pool is touched by the offending frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    #[error(
        "bad magic {got:02x?}: the peer does not speak the handoff protocol; check the address"
    )]
    BadMagic { got: [u8; 4] },
    #[error(
        "protocol version {got} not supported (this build speaks {supported}): upgrade one side"
    )]
    UnsupportedVersion { got: u16, supported: u16 },
    #[error("unknown frame kind {kind}: the peer is newer or broken")]
    UnknownKind { kind: u8 },
    #[error("reserved header flags {flags:#04x} set: the peer is newer or broken")]
    BadFlags { flags: u8 },
    #[error("frame of {len} bytes exceeds the limit of {max}: raise max_frame_bytes on both sides")]
    Oversized { len: u64, max: u64 },
    #[error("frame payload truncated while reading {what}: the peer is broken or not handoff")]
    Truncated { what: &'static str },
    #[error("{extra} unexpected bytes after a {kind} frame: the peer is newer or broken")]
    TrailingBytes { kind: &'static str, extra: usize },
    #[error("invalid frame: {what}: the peer is newer or broken")]
    Invalid { what: &'static str },
    #[error(
        "frame out of order: sequence {got}, expected {expected}: frames were lost or replayed; reconnect"
    )]
    OutOfOrder { expected: u32, got: u32 },
    /// A frame begun (its first byte read) was not complete within the
    /// frame deadline, the peer's write timeout, counted for the whole
    /// frame: a peer that drips a byte at a time cannot hold the link.
    #[error(
        "a frame begun was not complete within {waited_ms} ms (the deadline for a whole frame): \
         the peer is stuck, gone or dripping bytes; reconnect"
    )]
    Stalled { waited_ms: u128 },
    #[error("a {kind} frame is not valid {context}")]
    Unexpected {
        kind: &'static str,
        context: &'static str,
    },
}

/// A failure of the link between a prefill and a decode worker.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    #[error("the peer disconnected: transfers in flight on this link fail; reconnect")]
    Disconnected,
    #[error("link I/O error ({kind:?}): {message}")]
    Io {
        kind: std::io::ErrorKind,
        message: String,
    },
    #[error("protocol violation by the peer, connection closed: {0}")]
    Wire(#[from] WireError),
    #[error(
        "no room for {bytes} KV bytes within {waited_ms} ms ({in_flight} of {cap} bytes in flight): \
         the receiver is too slow or stuck"
    )]
    BackpressureTimeout {
        bytes: usize,
        in_flight: usize,
        cap: usize,
        waited_ms: u128,
    },
    #[error(
        "{addr} is not a loopback address: without worker identities the TCP transport serves \
         loopback only; configure TransferConfig::with_identity on both ends, or use 127.0.0.1"
    )]
    NotLoopback { addr: String },
    #[error("link authentication: {0}")]
    Auth(#[from] AuthError),
    #[error("worker identity: {0}")]
    Identity(#[from] IdentityError),
    #[error("invalid transfer configuration: {what}")]
    Config { what: &'static str },
    #[error(
        "the worker at this end was killed (fault injection): its transfers are lost; restart it"
    )]
    Killed,
    #[error(
        "no prefill peer connected within {waited_ms} ms: check that the prefill worker started \
         and can reach this address"
    )]
    AcceptTimeout { waited_ms: u128 },
    #[error(
        "NIXL is not available in this process: {reason}; run scripts/install-nixl.sh and set \
         HANDOFF_NIXL_LIB to the libnixl_capi.so it prints, or use the TCP transport"
    )]
    NixlUnavailable { reason: String },
    #[error(
        "the link's data plane failed ({what}): {detail}; transfers in flight on this link fail; \
         reconnect"
    )]
    DataPlane { what: &'static str, detail: String },
}

impl From<std::io::Error> for LinkError {
    fn from(e: std::io::Error) -> Self {
        use std::io::ErrorKind::*;
        match e.kind() {
            UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected => {
                LinkError::Disconnected
            }
            kind => LinkError::Io {
                kind,
                message: e.to_string(),
            },
        }
    }
}

/// A receipt, or the writes before it, disagree with the plan or with the
/// bytes that landed. The request fails, its destination pages are scrubbed
/// and released, and nothing is generated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IntegrityError {
    #[error(
        "{request}: receipt for its transfer ({nonce}) came from {got}, the plan was addressed to \
         {planned}: refused; another worker holds this transfer's nonce (check the workers and \
         the router)",
        planned = peer_name(planned),
        got = peer_name(got)
    )]
    WrongPeer {
        request: RequestId,
        nonce: Nonce,
        planned: Option<PeerId>,
        got: Option<PeerId>,
    },
    #[error("{request}: receipt carries {got}, the plan was {planned}; {fix}", fix = INTEGRITY_FIX)]
    NonceMismatch {
        request: RequestId,
        planned: Nonce,
        got: Nonce,
    },
    #[error("receipt for {planned}'s transfer ({nonce}) names {got}; {fix}", fix = INTEGRITY_FIX)]
    RequestMismatch {
        planned: RequestId,
        got: RequestId,
        nonce: Nonce,
    },
    #[error("{request}: receipt counts {got} layers, the model has {planned}; {fix}", fix = INTEGRITY_FIX)]
    LayerCountLen {
        request: RequestId,
        planned: usize,
        got: usize,
    },
    #[error("{request}: receipt says layer {layer} holds {claimed} tokens, the plan is {planned}; {fix}", fix = INTEGRITY_FIX)]
    LayerTokens {
        request: RequestId,
        layer: usize,
        claimed: u32,
        planned: u32,
    },
    #[error("{request}: receipt page {position} is {got:?}, the plan reserved {planned:?}; {fix}", fix = INTEGRITY_FIX)]
    PageMismatch {
        request: RequestId,
        position: usize,
        planned: Option<PlannedPage>,
        got: Option<PlannedPage>,
    },
    #[error("{request}: layer {layer} received {landed} tokens, the plan is {planned}; {fix}", fix = INTEGRITY_FIX)]
    Incomplete {
        request: RequestId,
        layer: usize,
        landed: usize,
        planned: usize,
    },
    #[error("{request}: a KV write was refused: {reason}; {fix}", fix = INTEGRITY_FIX)]
    WriteRefused {
        request: RequestId,
        reason: WriteRefusal,
    },
    #[error("{request}: receipt carries {got} page checksums for {planned} pages; {fix}", fix = INTEGRITY_FIX)]
    ChecksumCount {
        request: RequestId,
        planned: usize,
        got: usize,
    },
    #[error("{request}: checksum of page {position} is {actual:016x} over the landed bytes, \
         the receipt claims {claimed:016x}; {fix}", fix = INTEGRITY_FIX)]
    ChecksumMismatch {
        request: RequestId,
        position: usize,
        claimed: u64,
        actual: u64,
    },
    #[error("{request}: the receipt's audit trail does not show every position written by it; {fix}", fix = INTEGRITY_FIX)]
    WriterMismatch { request: RequestId },
    #[error("{request}: the receipt's first token {token:?} is missing or outside the vocabulary of {vocab}; {fix}", fix = INTEGRITY_FIX)]
    FirstToken {
        request: RequestId,
        token: Option<u32>,
        vocab: usize,
    },
    #[error("{request}: the receipt's log-probabilities for the first token are wrong: {what}; {fix}", fix = INTEGRITY_FIX)]
    FirstLogprobs {
        request: RequestId,
        what: &'static str,
    },
    #[error("{request}: a destination page is no longer owned at its planned generation: {error}; {fix}", fix = INTEGRITY_FIX)]
    Destination { request: RequestId, error: KvError },
}

/// What to do about any integrity failure.
/// A link's peer as an error message names it.
fn peer_name(p: &Option<PeerId>) -> String {
    match p {
        Some(id) => format!("peer {id}"),
        None => "an unauthenticated peer".into(),
    }
}

const INTEGRITY_FIX: &str =
    "retry the request; if it recurs, check the prefill worker and the link";

/// Why a KV write batch was refused at the destination (recorded, then
/// reported when the receipt is verified).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WriteRefusal {
    #[error("batch names {got}, the plan is for {planned}")]
    WrongRequest { planned: RequestId, got: RequestId },
    #[error("layer {layer} out of range ({n_layers} layers)")]
    LayerOutOfRange { layer: u32, n_layers: usize },
    #[error(
        "layer {layer} batch starts at {start}, {expected} tokens have landed (reordered, duplicated or lost write)"
    )]
    OutOfOrder {
        layer: u32,
        start: u32,
        expected: usize,
    },
    #[error("layer {layer} batch ends at {end}, past the planned {planned} tokens")]
    PastPlan {
        layer: u32,
        end: u64,
        planned: usize,
    },
    #[error("batch of {tokens} tokens carries {got} bytes per K/V, {expected} expected")]
    BadLength {
        tokens: u32,
        expected: usize,
        got: usize,
    },
    #[error("the write could not be stored: {0}")]
    Kv(KvError),
}

/// Why a transfer (and so its request) failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    #[error("transfer integrity failure, request failed and nothing generated: {0}")]
    Integrity(#[from] IntegrityError),
    #[error("{request}: prefill refused the request: {reason}")]
    Aborted {
        request: RequestId,
        reason: AbortReason,
    },
    #[error("timed out waiting for {waiting_for:?}{}: the peer is slow or dead; retry", request.map(|r| format!(" ({r})")).unwrap_or_default())]
    Timeout {
        request: Option<RequestId>,
        waiting_for: Wait,
    },
    #[error("{request}: cancelled by the client")]
    Cancelled { request: RequestId },
    #[error("link failure: {0}")]
    Link(#[from] LinkError),
    #[error("KV pool: {0}")]
    Kv(#[from] KvError),
    #[error("{request}: the decode worker turned the request away: {reason}")]
    Refused {
        request: RequestId,
        reason: AbortReason,
    },
}

impl HttpStatus for TransferError {
    fn http_status(&self) -> u16 {
        match self {
            TransferError::Integrity(_) => 500,
            TransferError::Aborted { request, reason }
            | TransferError::Refused { request, reason } => match reason.to_rejection(*request) {
                Some(r) => r.http_status(),
                None => 500,
            },
            TransferError::Timeout { .. } => 504,
            // Client closed request (nginx convention).
            TransferError::Cancelled { .. } => 499,
            TransferError::Link(e) => e.http_status(),
            TransferError::Kv(e) => e.http_status(),
        }
    }
}

impl HttpStatus for IntegrityError {
    fn http_status(&self) -> u16 {
        500
    }
}

impl HttpStatus for LinkError {
    fn http_status(&self) -> u16 {
        match self {
            LinkError::BackpressureTimeout { .. } => 503,
            // This host's own settings, not the peer: a server fault.
            LinkError::Config { .. }
            | LinkError::Identity(_)
            | LinkError::NotLoopback { .. }
            | LinkError::NixlUnavailable { .. } => 500,
            LinkError::Disconnected
            | LinkError::Io { .. }
            | LinkError::Wire(_)
            | LinkError::DataPlane { .. }
            | LinkError::Killed => 502,
            LinkError::AcceptTimeout { .. } => 504,
            LinkError::Auth(e) => e.http_status(),
        }
    }
}

impl HttpStatus for WriteRefusal {
    fn http_status(&self) -> u16 {
        // A refused write fails its transfer's verification: an integrity
        // failure of that request.
        500
    }
}

impl HttpStatus for WireError {
    fn http_status(&self) -> u16 {
        502
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transfer_failed_by_its_link_reports_the_links_status() {
        let busy = LinkError::BackpressureTimeout {
            bytes: 1,
            in_flight: 2,
            cap: 2,
            waited_ms: 10,
        };
        assert_eq!(TransferError::Link(busy).http_status(), 503);
        assert_eq!(
            TransferError::Link(LinkError::Disconnected).http_status(),
            502
        );
        let refused = WriteRefusal::PastPlan {
            layer: 0,
            end: 9,
            planned: 8,
        };
        assert_eq!(refused.http_status(), 500);
    }
}
