//! A prefill link that stages two of the incident's conditions for the
//! examples, through the public [`PrefillLink`] trait alone (no test-only
//! crate feature): a slow KV write, so a client's cancel lands while that
//! request's writes are still in flight, and a lying peer whose receipt for
//! one request claims a checksum the landed bytes do not have. Decode must
//! fence the first and fail the second with a typed error, generating
//! nothing from it.

use std::sync::Arc;
use std::time::Duration;

use handoff::RequestId;
use handoff::kv::{Held, KvSeq};
use handoff::transfer::{InFlightStats, LinkError, PrefillLink, ToDecode, WriteBatch};

/// What the link stages; nothing by default.
#[derive(Clone, Copy, Debug, Default)]
pub struct Staging {
    /// This request's second KV write batch leaves this much later.
    pub slow_second_write: Option<(RequestId, Duration)>,
    /// This request's receipt claims page 0's checksum with its lowest bit
    /// flipped.
    pub corrupt_receipt_of: Option<RequestId>,
}

/// `inner`, with [`Staging`] acted out on the way.
pub struct StagedLink<L> {
    inner: L,
    staging: Staging,
    writes_seen: u32,
}

impl<L: PrefillLink> StagedLink<L> {
    pub fn new(inner: L, staging: Staging) -> Self {
        StagedLink {
            inner,
            staging,
            writes_seen: 0,
        }
    }
}

impl<L: PrefillLink> PrefillLink for StagedLink<L> {
    fn peer(&self) -> Option<handoff::transfer::PeerId> {
        self.inner.peer()
    }

    fn recv(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<handoff::transfer::ToPrefill>, LinkError> {
        self.inner.recv(timeout)
    }

    fn write_kv(&mut self, batch: WriteBatch, src: &Arc<KvSeq<Held>>) -> Result<(), LinkError> {
        if let Some((id, delay)) = self.staging.slow_second_write
            && batch.request == id
        {
            self.writes_seen += 1;
            if self.writes_seen == 2 {
                std::thread::sleep(delay);
            }
        }
        self.inner.write_kv(batch, src)
    }

    fn send(&mut self, mut msg: ToDecode) -> Result<(), LinkError> {
        if let ToDecode::Receipt(r) = &mut msg
            && Some(r.request) == self.staging.corrupt_receipt_of
            && let Some(sum) = r.page_checksums.first_mut()
        {
            *sum ^= 1;
        }
        self.inner.send(msg)
    }

    fn in_flight(&self) -> InFlightStats {
        self.inner.in_flight()
    }

    fn close(&mut self) {
        self.inner.close();
    }
}
