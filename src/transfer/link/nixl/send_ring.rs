//! Where each buffered write lies in the prefill end's send buffer: a ring
//! allocated in send order, each part kept until the peer has credited its
//! write back (it READs the part until then), freed in the same order. A
//! write that does not fit waits for the oldest part's credit, so writes
//! from a buffer pipeline up to the buffer's size instead of one at a time.
//! Private to this process: the peer only ever READs the parts it is told
//! of, and the decode end's memory is never involved.

use std::collections::VecDeque;

use crate::transfer::error::LinkError;
use crate::transfer::link::tcp::CreditMark;

/// The ring's bookkeeping.
#[derive(Debug)]
pub(super) struct SendRing {
    size: u64,
    /// Where the next part starts if it fits before the end.
    head: u64,
    /// Live parts, oldest first: offset, length, and the link's credit
    /// total at which the peer is done with it.
    live: VecDeque<(u64, u64, u64)>,
}

impl SendRing {
    pub(super) fn new(size: u64) -> Self {
        SendRing {
            size,
            head: 0,
            live: VecDeque::new(),
        }
    }

    /// A part of `len` bytes for the write that `mark` describes, waiting
    /// (at most `mark.limit` per wait) for older parts' credit when the
    /// buffer is full.
    pub(super) fn alloc(&mut self, len: u64, mark: &CreditMark<'_>) -> Result<u64, LinkError> {
        if len > self.size {
            return Err(LinkError::Config {
                what: "a write batch larger than the in-flight cap",
            });
        }
        loop {
            self.free_through(mark.credits.released_total());
            if let Some(at) = self.fit(len) {
                self.head = at + len;
                self.live.push_back((at, len, mark.until));
                return Ok(at);
            }
            // Not empty, or the part would have fit: wait for the oldest.
            let Some(&(_, _, oldest)) = self.live.front() else {
                return Err(LinkError::Config {
                    what: "a write batch larger than the in-flight cap",
                });
            };
            mark.credits.wait_released(oldest, mark.limit)?;
        }
    }

    /// Frees the parts whose writes the peer has credited back (`released`
    /// bytes in all on the link).
    fn free_through(&mut self, released: u64) {
        while self
            .live
            .front()
            .is_some_and(|&(_, _, until)| until <= released)
        {
            self.live.pop_front();
        }
        if self.live.is_empty() {
            self.head = 0;
        }
    }

    /// Where `len` bytes fit now, if anywhere.
    fn fit(&self, len: u64) -> Option<u64> {
        match self.live.front().map(|&(off, _, _)| off) {
            None => (len <= self.size).then_some(0),
            // Live parts lie in [tail, head): room after head, else before
            // the oldest part.
            Some(tail) if tail < self.head => {
                if self.head + len <= self.size {
                    Some(self.head)
                } else {
                    (len <= tail).then_some(0)
                }
            }
            // Wrapped: live parts lie in [tail, end) and [0, head); room
            // only between head and the oldest part.
            Some(tail) => (self.head + len <= tail).then_some(self.head),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::transfer::link::credits::Credits;

    /// Writes of varied sizes, credited back with a lag by a peer that
    /// lands them in order, never overlap a live part and always fit once
    /// the credit they would wait for has come.
    #[test]
    fn parts_never_overlap_a_live_part_and_fit_once_the_oldest_is_back() {
        let size = 1000u64;
        let credits = Credits::new(usize::MAX / 2);
        let mut ring = SendRing::new(size);
        let mut live: VecDeque<(u64, u64)> = VecDeque::new();
        let (mut sent, mut x) = (0u64, 7u64);
        for _ in 0..20_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 1 + (x >> 33) % (size / 2);
            // The peer credits a few of the oldest writes back.
            for _ in 0..(x >> 20) % 3 {
                if let Some((_, l)) = live.pop_front() {
                    credits.release(l as usize);
                }
            }
            // Where it would wait, the oldest write's credit comes.
            loop {
                ring.free_through(credits.released_total());
                if ring.fit(len).is_some() {
                    break;
                }
                let (_, l) = live.pop_front().expect("a live part to wait for");
                credits.release(l as usize);
            }
            sent += len;
            let mark = CreditMark {
                credits: &credits,
                until: sent,
                limit: Duration::from_millis(1),
            };
            let at = ring.alloc(len, &mark).expect("fits without waiting");
            assert!(at + len <= size);
            for &(o, l) in &live {
                assert!(at + len <= o || o + l <= at, "{at}+{len} overlaps {o}+{l}");
            }
            live.push_back((at, len));
        }
    }

    /// A write that must wait is woken by the oldest part's credit.
    #[test]
    fn a_write_waiting_for_room_is_woken_by_the_oldest_parts_credit() {
        let credits = Credits::new(1 << 20);
        let mut ring = SendRing::new(100);
        let mark = |until| CreditMark {
            credits: &credits,
            until,
            limit: Duration::from_secs(10),
        };
        assert_eq!(ring.alloc(100, &mark(100)).ok(), Some(0));
        let at = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                credits.release(100);
            });
            ring.alloc(50, &mark(150))
        });
        assert_eq!(at.ok(), Some(0));
    }

    #[test]
    fn a_full_buffer_whose_credit_never_comes_times_out_typed() {
        let credits = Credits::new(1 << 20);
        let mut ring = SendRing::new(100);
        let mark = |until| CreditMark {
            credits: &credits,
            until,
            limit: Duration::from_millis(20),
        };
        assert_eq!(ring.alloc(60, &mark(60)).ok(), Some(0));
        assert_eq!(ring.alloc(40, &mark(100)).ok(), Some(60));
        let err = ring.alloc(1, &mark(101)).unwrap_err();
        assert!(matches!(err, LinkError::DataPlane { .. }), "{err:?}");
        // Credit for the first write frees its part; a write too large for
        // the buffer is refused at once.
        credits.release(60);
        assert_eq!(ring.alloc(60, &mark(160)).ok(), Some(0));
        assert!(matches!(
            ring.alloc(101, &mark(261)),
            Err(LinkError::Config { .. })
        ));
    }
}
