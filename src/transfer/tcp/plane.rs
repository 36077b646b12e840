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
use crate::transfer::credits::Credits;
use crate::transfer::error::LinkError;
use crate::transfer::landing::LandingZone;
use crate::transfer::protocol::WriteBatch;
use crate::transfer::tcp::frame::Staged;

/// The prefill end of a data plane. A write is [`PlaneSender::send`],
/// then the metadata it needs ([`PlaneSender::metadata`]) and its
/// [`Frame::Staged`](super::frame::Frame) frame, then
/// [`PlaneSender::settle`].
pub(crate) trait PlaneSender: Send {
    /// Makes rows `[batch.start, batch.start + batch.tokens)` of
    /// `batch.layer` of `src` (K rows, then V rows, `row` bytes each)
    /// readable by the peer and says where they lie, with the first byte
    /// flipped when `corrupt` (fault injection: the rows are copied first,
    /// never altered in the pool).
    fn send(
        &mut self,
        src: &KvSeq<Held>,
        batch: &WriteBatch,
        row: usize,
        corrupt: bool,
    ) -> Result<Staged, LinkError>;
    /// This end's data-plane metadata when the peer has not seen it as it
    /// is now (first use, or memory registered since); sent before the
    /// staged write that needs it.
    fn metadata(&mut self) -> Result<Option<Vec<u8>>, LinkError>;
    /// Waits, at most `limit`, until this end may reuse what the write sent
    /// last was read from: at once for rows read in place from held pages
    /// (held until decode answers the transfer), else until the peer has
    /// credited the write back (`credits` reaches `until` bytes in all).
    fn settle(&mut self, credits: &Credits, until: u64, limit: Duration) -> Result<(), LinkError>;
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
