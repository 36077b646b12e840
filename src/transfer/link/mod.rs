//! The transport abstraction: one link joins one prefill worker and one
//! decode worker; a worker holds as many links as it has peers. Transports move messages and KV bytes; the protocol (what
//! is sent when, and what is verified) lives in the sides, so a new
//! transport (CUDA device copies, NCCL) adds a `Transfer` implementation and
//! changes no protocol type.

pub mod auth;
pub(crate) mod credits;
pub mod identity;
mod inproc;
pub(crate) mod landing;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod tcp;

pub use credits::InFlightStats;
pub use inproc::{InProcess, InProcessDecode, InProcessPrefill};
pub use landing::LandingZone;

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use crate::kv::{Held, KvSeq};
use crate::transfer::config::TransferConfig;
use crate::transfer::error::LinkError;
use crate::transfer::link::identity::PeerId;
use crate::transfer::protocol::{ToDecode, ToPrefill, WriteBatch};

/// A way to connect a prefill worker with a decode worker.
pub trait Transfer {
    type Prefill: PrefillLink + 'static;
    type Decode: DecodeLink + 'static;
    /// A short name for reports ("in-process", "tcp").
    fn name(&self) -> &'static str;
    /// Connects the two ends (in one process; transports that span two
    /// processes also offer per-end constructors).
    fn connect(&self, cfg: &TransferConfig) -> Result<(Self::Prefill, Self::Decode), LinkError>;
}

/// The prefill worker's end of a link.
pub trait PrefillLink: Send {
    /// The next message from decode, waiting at most `timeout`; `None` when
    /// nothing came in time.
    fn recv(&mut self, timeout: Duration) -> Result<Option<ToPrefill>, LinkError>;
    /// Sends rows `[batch.start, batch.start + batch.tokens)` of
    /// `batch.layer` of `src` to the destination the batch names. Waits
    /// while the cap on KV bytes in flight is reached (backpressure), at
    /// most the configured write timeout. `src` stays held until every write
    /// that reads it has been delivered or discarded.
    fn write_kv(&mut self, batch: WriteBatch, src: &Arc<KvSeq<Held>>) -> Result<(), LinkError>;
    /// Sends a receipt or an abort, after every write sent before it.
    fn send(&mut self, msg: ToDecode) -> Result<(), LinkError>;
    /// The link's in-flight accounting.
    fn in_flight(&self) -> InFlightStats;
    /// The decode worker at the other end: the id it proved in the
    /// handshake, or for a link inside this process a label naming that
    /// end; `None` for a peer that proved nothing.
    fn peer(&self) -> Option<PeerId>;
    /// Closes the link; the peer sees a disconnect. Idempotent.
    fn close(&mut self);
}

/// The decode worker's end of a link. KV writes land in its
/// [`LandingZone`] as they arrive; receipts and aborts come out of
/// [`DecodeLink::recv`] only after every write sent before them has landed.
pub trait DecodeLink: Send {
    /// Where this link lands KV writes.
    fn landing(&self) -> &Arc<LandingZone>;
    /// The prefill worker at the other end: the id it proved in the
    /// handshake (a worker on this end's allowlist), or for a link inside
    /// this process a label naming that end; `None` for a peer that proved
    /// nothing (TCP on loopback without identities). Plans sent on this
    /// link are addressed to it, and only its receipts can complete them
    /// (see [`crate::transfer::DecodeSide`]).
    fn peer(&self) -> Option<PeerId>;
    /// True when every message on this link comes from a peer that proved
    /// who it is, or from this process. Decides what a receipt naming a
    /// live request with a nonce this side never issued does (see
    /// [`crate::transfer::DecodeSide`]).
    fn peer_authenticated(&self) -> bool {
        self.peer().is_some()
    }
    /// Sends a plan or an answer.
    fn send(&mut self, msg: ToPrefill) -> Result<(), LinkError>;
    /// The next receipt or abort, waiting at most `timeout`; `None` when
    /// nothing came in time.
    fn recv(&mut self, timeout: Duration) -> Result<Option<ToDecode>, LinkError>;
    /// Receipts and aborts that have arrived (every write before them
    /// landed) and wait for [`DecodeLink::recv`].
    fn arrived(&self) -> usize;
    /// Closes the link; the peer sees a disconnect. Idempotent.
    fn close(&mut self);
}

/// Copies rows `[start + done, start + done + dst.len() / row)` of K or V of
/// `layer` of `src` into `dst`.
pub(crate) fn copy_rows(
    src: &KvSeq<Held>,
    layer: usize,
    kv: usize,
    first: usize,
    row_bytes: usize,
    dst: &mut [u8],
) {
    let n = dst.len() / row_bytes.max(1);
    // A source that cannot be read leaves the destination as it was; the
    // receipt's checksums then fail verification.
    let _ = src.read_rows(layer, kv, first, n, |done, bytes| {
        let at = done * row_bytes;
        if let Some(d) = dst.get_mut(at..at + bytes.len()) {
            d.copy_from_slice(bytes);
        }
    });
}

/// `rx.recv_timeout(timeout)`, except that a zero timeout only looks.
/// crossbeam's `recv_timeout` spins and then yields the thread before it
/// checks its deadline (about 5 us, and a `sched_yield`), and a decode
/// worker that is generating polls its link with a zero timeout every step.
pub(crate) fn recv_within<T>(rx: &Receiver<T>, timeout: Duration) -> Result<T, RecvTimeoutError> {
    if !timeout.is_zero() {
        return rx.recv_timeout(timeout);
    }
    rx.try_recv().map_err(|e| match e {
        TryRecvError::Empty => RecvTimeoutError::Timeout,
        TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_wait_reads_what_is_there_and_reports_an_empty_or_closed_channel() {
        let (tx, rx) = crossbeam_channel::unbounded();
        assert_eq!(
            recv_within(&rx, Duration::ZERO),
            Err(RecvTimeoutError::Timeout)
        );
        tx.send(7).unwrap();
        assert_eq!(recv_within(&rx, Duration::ZERO), Ok(7));
        tx.send(8).unwrap();
        assert_eq!(recv_within(&rx, Duration::from_millis(5)), Ok(8));
        assert_eq!(
            recv_within(&rx, Duration::from_millis(5)),
            Err(RecvTimeoutError::Timeout)
        );
        drop(tx);
        assert_eq!(
            recv_within(&rx, Duration::ZERO),
            Err(RecvTimeoutError::Disconnected)
        );
    }
}
