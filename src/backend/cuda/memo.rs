//! [`Memo`]: the last thing built from a host-side key, reused while the
//! next key is equal.
//!
//! A decode step asks for the same device-side inputs once per layer: the
//! same positions for RoPE, the same page tables (the views are validated
//! again for every layer, and yield the same pages and lengths), the same
//! append slots. Built from an equal key, the upload would put the same
//! bytes in a new buffer; the memo hands back the buffer of the last equal
//! key instead. The key is the whole host-side content, compared in full,
//! so a reused buffer never differs from what a fresh upload would hold;
//! those buffers are only read by kernels, never written.
//!
//! The next step's key differs, and its value is written into the last
//! one's memory where nothing can still read it (`get_or_refill`): the
//! addresses in every launch's parameters then stay the same from step to
//! step, which is what lets a pass replay as a CUDA graph (`graph.rs`).

use std::sync::Arc;

use parking_lot::Mutex;

/// When a value is asked for: the device's flush count, and whether the
/// asking thread's launches are being recorded (see `graph.rs`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Moment {
    pub segment: u64,
    pub recording: bool,
}

struct Entry<K, V> {
    key: K,
    value: Arc<V>,
    /// The flush count when it was last handed out.
    handed: u64,
}

/// The last `(key, value)` built, shared by clones of its `Arc`.
pub(super) struct Memo<K, V> {
    last: Mutex<Option<Entry<K, V>>>,
}

impl<K, V> Default for Memo<K, V> {
    fn default() -> Self {
        Memo {
            last: Mutex::new(None),
        }
    }
}

impl<K: PartialEq, V> Memo<K, V> {
    /// The value last built from a key equal to `key`, or `make(&key, old)`,
    /// which then replaces it. `old` is the replaced value when it may be
    /// refilled in place: nobody else holds it and no launch still
    /// recorded can read it (it was last handed out before the last flush,
    /// or nothing is recorded), so that its device memory, and with it
    /// every launch's parameter bytes, stays the same from step to step
    /// (what a replayed graph needs). Otherwise it goes to `retire`, which
    /// keeps it for the recorded launches. An error is returned and nothing
    /// kept.
    pub(super) fn get_or_refill<E>(
        &self,
        key: K,
        at: impl FnOnce() -> Moment,
        make: impl FnOnce(&K, Option<V>) -> Result<V, E>,
        retire: impl FnOnce(Arc<V>),
    ) -> Result<Arc<V>, E> {
        let mut last = self.last.lock();
        // Read under the lock: a pass that began recording before another
        // thread's call took it is seen.
        let at = at();
        if let Some(e) = last.as_mut()
            && e.key == key
        {
            e.handed = at.segment;
            return Ok(Arc::clone(&e.value));
        }
        // Taken before the new one is built: a failed build keeps nothing.
        let old = match last.take() {
            Some(e) if !at.recording || e.handed < at.segment => match Arc::try_unwrap(e.value) {
                Ok(v) => Some(v),
                Err(shared) => {
                    retire(shared);
                    None
                }
            },
            Some(e) => {
                retire(e.value);
                None
            }
            None => None,
        };
        let value = Arc::new(make(&key, old)?);
        *last = Some(Entry {
            key,
            value: Arc::clone(&value),
            handed: at.segment,
        });
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::{Memo, Moment};

    const EAGER: Moment = Moment {
        segment: 0,
        recording: false,
    };

    /// A value built from its key (refilled values say so).
    #[derive(Debug, PartialEq)]
    struct Built {
        key: Vec<u32>,
        refilled: bool,
    }

    fn get(
        memo: &Memo<Vec<u32>, Built>,
        key: &[u32],
        at: Moment,
    ) -> (std::sync::Arc<Built>, usize) {
        let mut retired = 0;
        let v = memo
            .get_or_refill(
                key.to_vec(),
                || at,
                |k, old| {
                    Ok::<_, ()>(Built {
                        key: k.clone(),
                        refilled: old.is_some(),
                    })
                },
                |_| retired += 1,
            )
            .unwrap();
        (v, retired)
    }

    #[test]
    fn an_equal_key_gets_the_same_value_and_any_other_key_a_new_one() {
        let memo = Memo::<Vec<u32>, Built>::default();
        let (a, _) = get(&memo, &[1, 2, 3], EAGER);
        let (again, _) = get(&memo, &[1, 2, 3], EAGER);
        assert!(std::sync::Arc::ptr_eq(&a, &again), "equal key: reused");
        let (b, retired) = get(&memo, &[1, 2, 4], EAGER);
        assert_eq!(b.key, [1, 2, 4], "one element differs: rebuilt");
        assert!(!b.refilled, "the old value is still held (a): not refilled");
        assert_eq!(retired, 1, "and kept alive for its holder instead");
        drop((a, again));
        let (c, _) = get(&memo, &[1, 2], EAGER);
        assert_eq!(c.key, [1, 2], "a prefix is another key");
        drop(b);
    }

    /// Nobody holds the old value and nothing recorded can read it: its
    /// memory is refilled (the address a graph replays stays put).
    #[test]
    fn an_unheld_value_is_refilled_in_place() {
        let memo = Memo::<Vec<u32>, Built>::default();
        drop(get(&memo, &[1], EAGER).0);
        let (v, retired) = get(&memo, &[2], EAGER);
        assert_eq!((v.key.as_slice(), v.refilled, retired), (&[2][..], true, 0));
    }

    /// While launches are recorded, a value handed out since the last
    /// flush may be read by one of them: it is retired, not overwritten.
    /// After a flush it may be refilled again.
    #[test]
    fn a_value_a_recorded_launch_may_read_is_never_refilled() {
        let memo = Memo::<Vec<u32>, Built>::default();
        let rec = |segment| Moment {
            segment,
            recording: true,
        };
        drop(get(&memo, &[1], rec(5)).0);
        let (v, retired) = get(&memo, &[2], rec(5));
        assert_eq!((v.refilled, retired), (false, 1), "same segment");
        drop(v);
        let (v, retired) = get(&memo, &[3], rec(6));
        assert_eq!((v.refilled, retired), (true, 0), "flushed since");
        drop(v);
        // Handed out again (equal key) in segment 7: not refillable in 7.
        drop(get(&memo, &[3], rec(7)).0);
        let (v, retired) = get(&memo, &[4], rec(7));
        assert_eq!((v.refilled, retired), (false, 1));
    }

    #[test]
    fn a_failed_build_keeps_nothing() {
        let memo = Memo::<u32, u32>::default();
        let ok = |v| move |_: &u32, _| Ok::<_, &str>(v);
        assert_eq!(*memo.get_or_refill(7, || EAGER, ok(70), drop).unwrap(), 70);
        let failed = memo.get_or_refill(8, || EAGER, |_, _| Err("no device"), drop);
        assert_eq!(failed.unwrap_err(), "no device");
        // Neither 8 (failed) nor 7 (replaced before the build) is reused.
        assert_eq!(*memo.get_or_refill(7, || EAGER, ok(71), drop).unwrap(), 71);
    }
}
