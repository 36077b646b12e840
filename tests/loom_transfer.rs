//! Model checking of the transfer layer's shared state with loom: every
//! interleaving (within the bounds below) of the threads that share it.
//!
//! - Landing zone: a KV write racing the fence (`take`) either lands before
//!   it, and the fenced destination shows it, or is counted stray and lands
//!   nowhere, not even in pages the fence freed and a new transfer reused;
//!   writes of two transfers landing at once each reach only their own
//!   pages.
//! - One-copy landing: two landers copying straight from one pool's held
//!   pages into the other's, in opposite directions at once, both finish
//!   and each destination gets exactly its source's bytes (page bytes have
//!   no lock; every page access is reported to loom, which checks that the
//!   handles' ownership orders them).
//! - In-flight credits: a sender waiting at the cap is woken by the credit
//!   a delivered write gives back; closing the link wakes every waiting
//!   sender with a typed error; the cap is never exceeded.
//! - Held source pages: pages a transfer holds for its in-flight writes are
//!   freed exactly once, by the last holder, never while a write can still
//!   read them, and a reservation racing the release gets them only after.
//!
//! Run: `RUSTFLAGS="--cfg handoff_loom" CARGO_TARGET_DIR=target/loom cargo test
//! --release --test loom_transfer` (without `--cfg handoff_loom` this file compiles
//! to nothing). Bounds: 2 or 3 threads, 2 pages of one token slot, at most
//! 2 writes per thread; loom explores every interleaving (no preemption
//! bound).
#![cfg(handoff_loom)]

use handoff::transfer::loom_api::{Credits, Landed, Landing};
use handoff::transfer::{LinkError, Nonce, WriteBatch};
use handoff::{KvDtype, KvError, KvGeometry, KvPool, PoolConfig, RequestId};
use loom::sync::Arc;
use loom::thread;

/// One layer, one KV head of one element, f32: 4 bytes per K (or V) row.
const ROW: usize = 4;

fn pool(pages: usize) -> KvPool {
    let g = KvGeometry {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 1,
        dtype: KvDtype::F32,
    };
    KvPool::new(PoolConfig::new(g, 1, pages)).unwrap()
}

fn batch(request: u64, nonce: u64, start: u32) -> WriteBatch {
    WriteBatch {
        request: RequestId(request),
        nonce: Nonce(nonce),
        layer: 0,
        start,
        tokens: 1,
    }
}

#[test]
fn a_write_racing_the_fence_lands_before_it_or_nowhere() {
    loom::model(|| {
        let pool = pool(2);
        let zone = Arc::new(Landing::new());
        zone.register(&pool, RequestId(1), Nonce(1), 2).unwrap();
        let lander = {
            let zone = zone.clone();
            thread::spawn(move || [0, 1].map(|start| zone.write(&batch(1, 1, start), ROW, 7)))
        };
        // Decode fences the transfer (cancel, timeout or receipt) and frees
        // its pages; a new transfer reuses them at once.
        let fenced = zone.take(Nonce(1)).unwrap();
        let landed_before_fence = fenced.written(0);
        drop(fenced);
        zone.register(&pool, RequestId(2), Nonce(2), 2).unwrap();

        let results = lander.join().unwrap();
        let applied = results.iter().filter(|&&r| r == Landed::Applied).count();
        let stray = results.iter().filter(|&&r| r == Landed::Stray).count();
        assert_eq!(applied, landed_before_fence, "{results:?}");
        assert_eq!(applied + stray, 2, "every write accounted for: {results:?}");
        assert_eq!(zone.stray_writes() as usize, stray);
        assert_eq!(zone.refused_writes(), 0);
        // Nothing of request 1 reached request 2's destination.
        let reused = zone.take(Nonce(2)).unwrap();
        assert_eq!(reused.written(0), 0);
        drop(reused);
        for page in 0..2 {
            assert!(pool.audit_page_matches_scrub(page), "page {page} dirty");
        }
        assert!(pool.stats().is_full());
    });
}

#[test]
fn concurrent_transfers_land_only_in_their_own_pages() {
    loom::model(|| {
        let pool = pool(2);
        let zone = Arc::new(Landing::new());
        zone.register(&pool, RequestId(1), Nonce(1), 1).unwrap();
        zone.register(&pool, RequestId(2), Nonce(2), 1).unwrap();
        let landers: Vec<_> = [1u64, 2]
            .into_iter()
            .map(|r| {
                let zone = zone.clone();
                thread::spawn(move || zone.write(&batch(r, r, 0), ROW, r as u8))
            })
            .collect();
        for l in landers {
            assert_eq!(l.join().unwrap(), Landed::Applied);
        }
        for r in [1u64, 2] {
            let kv = zone.take(Nonce(r)).unwrap().into_verified();
            let reader = pool.reader();
            // The audit trail checks every slot's writer on this read.
            let layer = reader.seq(&kv).unwrap().layer(0).unwrap();
            assert_eq!(layer.key(0).unwrap().as_bytes(), [r as u8; ROW]);
            assert_eq!(layer.value(0).unwrap().as_bytes(), [r as u8; ROW]);
        }
        let st = pool.stats();
        assert!(st.is_full() && st.isolation_violations == 0, "{st:?}");
    });
}

#[test]
fn landers_copying_between_two_pools_in_opposite_directions_both_finish() {
    loom::model(|| {
        let pools = [pool(2), pool(2)];
        // Request r + 1 computed in pools[r], lands in pools[1 - r].
        let held: Vec<_> = (0..2usize)
            .map(|r| {
                let mut seq = pools[r].reserve(RequestId(r as u64 + 1), 1).unwrap();
                let x = (r + 1) as f32;
                seq.append(0, &[x], &[x]).unwrap();
                Arc::new(seq.seal(1).unwrap().hold())
            })
            .collect();
        let zones: Vec<_> = (0..2usize)
            .map(|r| {
                let zone = Arc::new(Landing::new());
                let id = r as u64 + 1;
                zone.register(&pools[1 - r], RequestId(id), Nonce(id), 1)
                    .unwrap();
                zone
            })
            .collect();
        let landers: Vec<_> = (0..2usize)
            .map(|r| {
                let (zone, src) = (zones[r].clone(), held[r].clone());
                let id = r as u64 + 1;
                thread::spawn(move || zone.write_from(&batch(id, id, 0), &src))
            })
            .collect();
        for l in landers {
            assert_eq!(l.join().unwrap(), Landed::Applied);
        }
        for r in 0..2usize {
            let id = r as u64 + 1;
            let kv = zones[r].take(Nonce(id)).unwrap().into_verified();
            let reader = pools[1 - r].reader();
            let layer = reader.seq(&kv).unwrap().layer(0).unwrap();
            let mut v = [0f32];
            layer.key(0).unwrap().to_f32_into(&mut v);
            assert_eq!(v[0], (r + 1) as f32);
            layer.value(0).unwrap().to_f32_into(&mut v);
            assert_eq!(v[0], (r + 1) as f32);
        }
        drop(held);
        for p in &pools {
            assert!(p.stats().is_full(), "{:?}", p.stats());
        }
    });
}

#[test]
fn a_sender_at_the_cap_is_woken_by_returned_credit() {
    loom::model(|| {
        let credits = Arc::new(Credits::new(2));
        let (delivered, arrivals) = loom::sync::mpsc::channel();
        let sender = {
            let credits = credits.clone();
            thread::spawn(move || {
                for _ in 0..2 {
                    credits.acquire(2).unwrap();
                    assert!(credits.stats().current <= 2);
                    delivered.send(()).unwrap();
                }
            })
        };
        // The receiving end gives credit back for each landed write.
        for _ in 0..2 {
            arrivals.recv().unwrap();
            credits.release(2);
        }
        sender.join().unwrap();
        let st = credits.stats();
        assert_eq!((st.current, st.peak), (0, 2), "{st:?}");
    });
}

#[test]
fn returned_credit_below_half_the_cap_wakes_a_waiting_sender() {
    // Credit wakes a waiting sender only once at most half the cap is in
    // flight: with a cap of 3 unit writes, the first write back after the
    // sender stalls does not wake it, the second does. No interleaving
    // leaves it asleep (loom reports a sender nobody wakes as a deadlock).
    loom::model(|| {
        let credits = Arc::new(Credits::new(3));
        let (delivered, arrivals) = loom::sync::mpsc::channel();
        let sender = {
            let credits = credits.clone();
            thread::spawn(move || {
                for _ in 0..4 {
                    credits.acquire(1).unwrap();
                    assert!(credits.stats().current <= 3);
                    delivered.send(()).unwrap();
                }
            })
        };
        for _ in 0..4 {
            arrivals.recv().unwrap();
            credits.release(1);
        }
        sender.join().unwrap();
        let st = credits.stats();
        assert_eq!(st.current, 0, "{st:?}");
        assert!(st.peak <= 3, "{st:?}");
    });
}

#[test]
fn a_sender_waiting_for_its_buffer_is_woken_by_the_credit_that_frees_it() {
    // The NIXL prefill end reuses its send buffer only once the peer has
    // credited the write it READ from there: credit that comes back while
    // most of the cap is still in flight must wake it all the same (the
    // half-cap rule is for senders waiting for room), and a close wakes it
    // with an error. No interleaving leaves it asleep.
    loom::model(|| {
        let credits = Arc::new(Credits::new(4));
        for _ in 0..4 {
            credits.acquire(1).unwrap();
        }
        let sender = {
            let credits = credits.clone();
            thread::spawn(move || credits.wait_released(1))
        };
        credits.release(1);
        assert_eq!(sender.join().unwrap(), Ok(()));
        assert_eq!(credits.stats().current, 3);
    });
    loom::model(|| {
        let credits = Arc::new(Credits::new(100));
        credits.acquire(1).unwrap();
        let sender = {
            let credits = credits.clone();
            thread::spawn(move || credits.wait_released(1))
        };
        credits.close();
        assert_eq!(sender.join().unwrap(), Err(LinkError::Disconnected));
    });
}

#[test]
fn closing_the_link_wakes_every_waiting_sender() {
    loom::model(|| {
        let credits = Arc::new(Credits::new(1));
        let senders: Vec<_> = (0..2)
            .map(|_| {
                let credits = credits.clone();
                thread::spawn(move || credits.acquire(1))
            })
            .collect();
        credits.close();
        let results: Vec<_> = senders.into_iter().map(|s| s.join().unwrap()).collect();
        let ok = results.iter().filter(|r| r.is_ok()).count();
        assert!(ok <= 1, "two senders past a cap of one: {results:?}");
        for r in results.iter().filter(|r| r.is_err()) {
            assert_eq!(r, &Err(LinkError::Disconnected));
        }
        assert!(credits.stats().current <= 1);
    });
}

#[test]
fn held_source_pages_are_freed_once_by_the_last_holder() {
    loom::model(|| {
        let pool = pool(2);
        let mut seq = pool.reserve(RequestId(1), 2).unwrap();
        seq.append(0, &[1.0, 1.0], &[1.0, 1.0]).unwrap();
        let held = Arc::new(seq.seal(2).unwrap().hold());
        assert_eq!(pool.stats().held, 2);
        // A write in flight keeps its own reference and reads the source.
        let write = {
            let held = held.clone();
            let pool = pool.clone();
            thread::spawn(move || {
                let reader = pool.reader();
                let layer = reader.seq(&*held).unwrap().layer(0).unwrap();
                let mut v = [0f32];
                layer.key(1).unwrap().to_f32_into(&mut v);
                assert_eq!(v[0], 1.0, "the source changed under a write");
                drop(held);
            })
        };
        // Decode's ack: the sender lets go of its reference.
        drop(held);
        let st = pool.stats();
        assert!(st.balanced() && (st.held == 2 || st.held == 0), "{st:?}");
        // Another request wants the pages: it gets them only once the
        // write has let go.
        match pool.reserve(RequestId(2), 2) {
            Ok(next) => {
                assert_eq!(pool.stats().held, 0);
                drop(next);
            }
            Err(e) => assert!(matches!(e, KvError::Exhausted { .. }), "{e}"),
        }
        write.join().unwrap();
        assert!(pool.stats().is_full());
    });
}
