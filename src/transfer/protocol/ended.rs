//! Nonces of transfers that have ended, so that a late receipt or abort
//! for one is ignored and counted, even while a new transfer for the same
//! request id is live (a retry after a cancel or a timeout). Bounded: the
//! oldest are forgotten first, and a message with a forgotten nonce is
//! routed as any unknown nonce is (it fails a live request of the id it
//! names with an integrity error: closed, never applied).

use std::collections::{HashSet, VecDeque};

use crate::transfer::protocol::Nonce;

/// How many ended transfers a decode side remembers.
pub(crate) const REMEMBERED: usize = 4096;

#[derive(Debug)]
pub(crate) struct EndedNonces {
    order: VecDeque<Nonce>,
    set: HashSet<Nonce>,
    cap: usize,
}

impl EndedNonces {
    pub(crate) fn new(cap: usize) -> Self {
        EndedNonces {
            order: VecDeque::new(),
            set: HashSet::new(),
            cap: cap.max(1),
        }
    }

    /// Remembers `nonce` as ended, forgetting the oldest beyond the cap.
    pub(crate) fn insert(&mut self, nonce: Nonce) {
        if !self.set.insert(nonce) {
            return;
        }
        self.order.push_back(nonce);
        while self.order.len() > self.cap {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    pub(crate) fn contains(&self, nonce: &Nonce) -> bool {
        self.set.contains(nonce)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_the_latest_up_to_the_cap() {
        let mut e = EndedNonces::new(2);
        e.insert(Nonce(1));
        e.insert(Nonce(2));
        e.insert(Nonce(2));
        assert!(e.contains(&Nonce(1)) && e.contains(&Nonce(2)));
        e.insert(Nonce(3));
        assert!(!e.contains(&Nonce(1)));
        assert!(e.contains(&Nonce(2)) && e.contains(&Nonce(3)));
    }
}
