//! The cap on KV bytes in flight between one prefill and one decode worker:
//! a sender takes credit before a write leaves and the receiver gives it
//! back once the write has landed (or been refused). At the cap, senders
//! wait (backpressure), at most the configured write timeout.
//!
//! Returned credit wakes a waiting sender only once at most half the cap
//! is in flight (or the link closes): bytes still in flight are writes that
//! each give their credit back when they land (or the link closes, which
//! wakes everyone), so a sender at the cap sleeps once per half window
//! instead of once per batch, and the receiver, which pays for every
//! wake-up, spends that time landing bytes. A sender whose wait times out
//! takes the room that came meanwhile, if any, instead of failing; it never
//! waits past the write timeout either way.

use std::time::{Duration, Instant};

use crate::sync::{Condvar, Mutex};

use crate::transfer::error::LinkError;

/// Figures of a link's in-flight accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InFlightStats {
    /// The configured cap.
    pub cap: usize,
    /// Bytes in flight now.
    pub current: usize,
    /// The most bytes ever in flight at once (never above `cap`).
    pub peak: usize,
    /// Times a sender had to wait for credit.
    pub waits: u64,
}

#[derive(Debug)]
struct State {
    stats: InFlightStats,
    closed: bool,
    /// Senders waiting for room now.
    waiters: usize,
    /// Of those, senders waiting for a released total.
    released_waiters: usize,
    /// Bytes given back since the link began.
    released: u64,
}

/// Byte credits shared by the two ends of a link.
#[derive(Debug)]
pub(crate) struct Credits {
    state: Mutex<State>,
    cv: Condvar,
}

impl Credits {
    pub(crate) fn new(cap: usize) -> Self {
        Credits {
            state: Mutex::new(State {
                stats: InFlightStats {
                    cap,
                    ..InFlightStats::default()
                },
                closed: false,
                waiters: 0,
                released_waiters: 0,
                released: 0,
            }),
            cv: Condvar::new(),
        }
    }

    /// Takes `bytes` of credit, waiting at most `timeout` for room.
    pub(crate) fn acquire(&self, bytes: usize, timeout: Duration) -> Result<(), LinkError> {
        let start = Instant::now();
        let deadline = crate::transfer::config::deadline(start, timeout);
        let mut st = self.state.lock();
        let cap = st.stats.cap;
        if bytes > cap {
            return Err(LinkError::Config {
                what: "a write batch larger than the in-flight cap",
            });
        }
        let mut waited = false;
        loop {
            if st.closed {
                return Err(LinkError::Disconnected);
            }
            if st.stats.current + bytes <= cap {
                st.stats.current += bytes;
                st.stats.peak = st.stats.peak.max(st.stats.current);
                return Ok(());
            }
            if !waited {
                waited = true;
                st.stats.waits += 1;
            }
            st.waiters += 1;
            let timed_out = self.cv.wait_until(&mut st, deadline).timed_out();
            st.waiters -= 1;
            if timed_out && !st.closed && st.stats.current + bytes > cap {
                return Err(LinkError::BackpressureTimeout {
                    bytes,
                    in_flight: st.stats.current,
                    cap,
                    waited_ms: start.elapsed().as_millis(),
                });
            }
        }
    }

    /// Waits, at most `timeout`, until `total` bytes in all have been given
    /// back since the link began (a sender whose source memory the peer
    /// reads until it credits the write).
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn wait_released(&self, total: u64, timeout: Duration) -> Result<(), LinkError> {
        let start = Instant::now();
        let deadline = crate::transfer::config::deadline(start, timeout);
        let mut st = self.state.lock();
        loop {
            if st.released >= total {
                return Ok(());
            }
            if st.closed {
                return Err(LinkError::Disconnected);
            }
            st.waiters += 1;
            st.released_waiters += 1;
            let timed_out = self.cv.wait_until(&mut st, deadline).timed_out();
            st.waiters -= 1;
            st.released_waiters -= 1;
            if timed_out && st.released < total && !st.closed {
                return Err(LinkError::DataPlane {
                    what: "the peer did not credit a staged write back within the write timeout",
                    detail: format!(
                        "{} of {total} bytes back after {} ms",
                        st.released,
                        start.elapsed().as_millis()
                    ),
                });
            }
        }
    }

    /// Gives back `bytes` of credit; wakes waiting senders once at most
    /// half the cap is in flight (at once, for one waiting on a total).
    pub(crate) fn release(&self, bytes: usize) {
        let mut st = self.state.lock();
        st.stats.current = st.stats.current.saturating_sub(bytes);
        st.released = st.released.saturating_add(bytes as u64);
        let wake =
            st.released_waiters > 0 || (st.waiters > 0 && st.stats.current <= st.stats.cap / 2);
        drop(st);
        if wake {
            self.cv.notify_all();
        }
    }

    /// Wakes every waiter with [`LinkError::Disconnected`].
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
        self.cv.notify_all();
    }

    /// Bytes given back since the link began (the receiver gives back in
    /// the order it landed them).
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn released_total(&self) -> u64 {
        self.state.lock().released
    }

    pub(crate) fn stats(&self) -> InFlightStats {
        self.state.lock().stats
    }
}

#[cfg(all(test, not(handoff_loom)))]
mod tests {
    use super::*;

    #[test]
    fn waits_at_the_cap_and_times_out_with_a_typed_error() {
        let c = Credits::new(100);
        c.acquire(60, Duration::from_millis(1)).unwrap();
        let e = c.acquire(60, Duration::from_millis(20)).unwrap_err();
        assert!(matches!(
            e,
            LinkError::BackpressureTimeout {
                in_flight: 60,
                cap: 100,
                ..
            }
        ));
        c.release(60);
        assert_eq!(c.released_total(), 60);
        c.acquire(100, Duration::from_millis(1)).unwrap();
        assert_eq!(c.stats().peak, 100);
        c.close();
        c.release(100);
        assert_eq!(
            c.acquire(1, Duration::from_millis(1)).unwrap_err(),
            LinkError::Disconnected
        );
    }
}
