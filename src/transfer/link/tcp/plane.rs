//! A data plane beside the frames: a link whose KV bytes travel by another
//! transport (NIXL), while the frames (sealed on an authenticated link)
//! carry everything else and say where each write's bytes lie at the
//! prefill end ([`Frame::Staged`](super::frame::Frame)).
//!
//! The decode end fetches each write itself (a one-sided READ) straight
//! into its destination pages, and only from inside the landing zone's
//! fence, after the same checks as a framed write: a READ starts only once
//! the write's destination is known to be live, and it has ended (landed,
//! failed, or been torn down with the data plane) before the fence opens.
//! So no byte can land in pages the landing zone has let go of, whatever
//! the peer does, and no address of the decode end's memory ever leaves it.
//! Only then does the decode end credit the bytes back.

use std::time::Duration;

use crate::kv::{Held, KvSeq};
use crate::transfer::error::LinkError;
use crate::transfer::link::credits::Credits;
use crate::transfer::link::landing::LandingZone;
use crate::transfer::link::tcp::frame::Staged;
use crate::transfer::protocol::WriteBatch;

/// Where a write stands in its link's credit: the peer has credited it
/// back once `credits` reaches `until` bytes in all (writes are credited in
/// the order they were sent); a wait for credit lasts at most `limit`.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
pub(crate) struct CreditMark<'a> {
    pub(crate) credits: &'a Credits,
    pub(crate) until: u64,
    pub(crate) limit: Duration,
}

/// The prefill end of a data plane. A write is [`PlaneSender::send`], then
/// the metadata it needs ([`PlaneSender::metadata`]) and its
/// [`Frame::Staged`](super::frame::Frame) frame.
pub(crate) trait PlaneSender: Send {
    /// Makes rows `[batch.start, batch.start + batch.tokens)` of
    /// `batch.layer` of `src` (K rows, then V rows, `row` bytes each)
    /// readable by the peer and says where they lie, with the first byte
    /// flipped when `corrupt` (fault injection: the rows are copied first,
    /// never altered in the pool). Rows read in place from held pages need
    /// nothing more (they stay held until decode answers the transfer);
    /// rows copied to a buffer keep their part of it until `mark` says the
    /// peer credited the write back, waiting for earlier writes' parts
    /// when the buffer is full.
    fn send(
        &mut self,
        src: &KvSeq<Held>,
        batch: &WriteBatch,
        row: usize,
        corrupt: bool,
        mark: CreditMark<'_>,
    ) -> Result<Staged, LinkError>;
    /// This end's data-plane metadata when the peer has not seen it as it
    /// is now (first use, or memory registered since); sent before the
    /// staged write that needs it.
    fn metadata(&mut self) -> Result<Option<Vec<u8>>, LinkError>;
}

/// The decode end of a data plane.
pub(crate) trait PlaneReceiver: Send {
    /// What the peer needs to set up its end; sent once, sealed on an
    /// authenticated link, right after the hello.
    fn parameters(&self) -> &[u8];
    /// Takes the peer's metadata (a [`PlaneSender::metadata`]).
    fn peer_metadata(&mut self, md: &[u8]) -> Result<(), LinkError>;
    /// Lands `staged`'s bytes as `batch` in `landing` (fetching them,
    /// waiting at most `limit`). An error ends the link, and by then no
    /// fetch of this end's is in flight.
    fn land(
        &mut self,
        landing: &LandingZone,
        batch: &WriteBatch,
        staged: &Staged,
        limit: Duration,
    ) -> Result<(), LinkError>;
}

/// Makes the prefill end's plane from the decode end's parameters.
pub(crate) type SenderFactory<'a> = &'a dyn Fn(&[u8]) -> Result<Box<dyn PlaneSender>, LinkError>;
