//! Where each staged write lies in the decode end's staging region: a ring
//! of `size` bytes, allocated in send order and freed in the same order as
//! the peer credits writes back. The prefill end keeps it; the decode end
//! only checks that a write lies inside the region.
//!
//! With a region of twice the in-flight cap, and a write never taken before
//! its credit (so at most `cap` bytes are live), an allocation always fits:
//! the bytes skipped at the end when a write wraps to 0 are less than one
//! write, and the live bytes plus those plus the new write stay within
//! `2 * cap`.

use std::collections::VecDeque;

/// The ring's bookkeeping.
#[derive(Debug)]
pub(crate) struct Ring {
    size: u64,
    /// Where the next write starts if it fits before the end.
    head: u64,
    /// Live writes, oldest first: offset, length, and the credit total
    /// (bytes credited on the link) at which the write is freed.
    live: VecDeque<(u64, u64, u64)>,
    /// Bytes allocated since the start (what the peer will have credited
    /// once every live write is back).
    allocated: u64,
}

impl Ring {
    pub(crate) fn new(size: u64) -> Self {
        Ring {
            size,
            head: 0,
            live: VecDeque::new(),
            allocated: 0,
        }
    }

    /// Frees the writes whose bytes the peer has credited back (`credited`
    /// bytes in all on the link).
    pub(crate) fn free_through(&mut self, credited: u64) {
        while self
            .live
            .front()
            .is_some_and(|&(_, _, done)| done <= credited)
        {
            self.live.pop_front();
        }
        if self.live.is_empty() {
            self.head = 0;
        }
    }

    /// An offset for `len` bytes, or `None` when they do not fit (the peer
    /// credited less than it should have).
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        if len == 0 {
            return Some(self.head);
        }
        let at = match self.live.front().map(|&(off, _, _)| off) {
            None => (len <= self.size).then_some(0)?,
            // Live writes lie in [tail, head): room after head, else
            // before the oldest write.
            Some(tail) if tail < self.head => {
                if self.head + len <= self.size {
                    self.head
                } else if len <= tail {
                    0
                } else {
                    return None;
                }
            }
            // Wrapped: live writes lie in [tail, end) and [0, head); room
            // only between head and the oldest write (none when they meet).
            Some(tail) => (self.head + len <= tail).then_some(self.head)?,
        };
        self.head = at + len;
        self.allocated += len;
        self.live.push_back((at, len, self.allocated));
        Some(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes of varied sizes, credited back with a lag, never overlap a
    /// live write and always fit in twice the cap.
    #[test]
    fn writes_never_overlap_a_live_write_and_always_fit_in_twice_the_cap() {
        let cap = 1000u64;
        let mut ring = Ring::new(2 * cap);
        let mut live: VecDeque<(u64, u64)> = VecDeque::new();
        let (mut in_flight, mut credited) = (0u64, 0u64);
        let mut x = 7u64;
        for _ in 0..20_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 2 * (1 + (x >> 33) % (cap / 2));
            // The credit rule: give back the oldest until this one fits.
            while in_flight + len > cap {
                let (_, l) = live.pop_front().expect("in flight");
                in_flight -= l;
                credited += l;
            }
            ring.free_through(credited);
            let at = ring.alloc(len).expect("fits in twice the cap");
            assert!(at + len <= 2 * cap);
            for &(o, l) in &live {
                assert!(at + len <= o || o + l <= at, "{at}+{len} overlaps {o}+{l}");
            }
            live.push_back((at, len));
            in_flight += len;
        }
    }

    #[test]
    fn a_peer_that_credits_nothing_fills_the_ring_and_is_refused() {
        let mut ring = Ring::new(100);
        assert_eq!(ring.alloc(60), Some(0));
        assert_eq!(ring.alloc(40), Some(60));
        ring.free_through(0);
        assert_eq!(ring.alloc(1), None);
        ring.free_through(60);
        assert_eq!(ring.alloc(60), Some(0));
        assert_eq!(ring.alloc(1), None);
        ring.free_through(200);
        assert_eq!(ring.alloc(100), Some(0));
        assert_eq!(ring.alloc(101), None);
    }
}
