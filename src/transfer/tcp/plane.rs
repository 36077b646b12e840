//! A data plane beside the frames: a link whose KV bytes travel by another
//! transport (NIXL) into a staging region at the decode end, while the
//! frames (sealed on an authenticated link) carry everything else and say
//! where each write's bytes lie ([`Frame::Staged`](super::frame::Frame)).
//!
//! The staging region is the only memory the other transport can reach.
//! A staged write lands in the pool the same way a framed one does: the
//! decode end's reader copies it from the region into the destination
//! pages under the landing zone's fence, after every check, and only then
//! credits its bytes back. So a write can never land in pages the landing
//! zone has let go of, whatever the data plane does.

use std::time::Duration;

use crate::kv::{Held, KvSeq};
use crate::transfer::error::LinkError;
use crate::transfer::protocol::WriteBatch;
use crate::transfer::tcp::frame::Staged;

/// The prefill end of a data plane. A write is [`PlaneSender::send`],
/// then its [`Frame::Staged`](super::frame::Frame) frame, then
/// [`PlaneSender::settle`]: the peer makes progress on the transfer while
/// it waits for it, which it starts doing when the frame arrives.
pub(crate) trait PlaneSender: Send {
    /// Starts moving rows `[batch.start, batch.start + batch.tokens)` of
    /// `batch.layer` of `src` (K rows, then V rows, `row` bytes each) into
    /// the peer's staging region, with the first byte flipped when
    /// `corrupt` (fault injection). `credited` is how many bytes the peer
    /// has credited back on this link so far: writes are credited in the
    /// order they were sent, which frees the region in order.
    fn send(
        &mut self,
        src: &KvSeq<Held>,
        batch: &WriteBatch,
        row: usize,
        credited: u64,
        corrupt: bool,
    ) -> Result<Staged, LinkError>;
    /// Waits, at most `limit`, until the write sent last has left this end
    /// (its staging memory may be reused).
    fn settle(&mut self, limit: Duration) -> Result<(), LinkError>;
}

/// The decode end of a data plane.
pub(crate) trait PlaneReceiver: Send {
    /// What the peer needs to reach the staging region; sent once, sealed
    /// on an authenticated link, right after the hello.
    fn parameters(&self) -> &[u8];
    /// The bytes of `staged` once they have arrived, waiting at most
    /// `limit`; they stay valid until the next call.
    fn arrived(&mut self, staged: &Staged, limit: Duration) -> Result<&[u8], LinkError>;
}

/// Makes the prefill end's plane from the decode end's parameters.
pub(crate) type SenderFactory<'a> = &'a dyn Fn(&[u8]) -> Result<Box<dyn PlaneSender>, LinkError>;
