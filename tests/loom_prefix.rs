//! Model checking of the prefix cache's lease and eviction paths with loom:
//! in every interleaving of a sequence leasing cached pages and reading
//! them while another request's allocation evicts idle cached pages, the
//! reader sees exactly the publisher's bytes (a page it leased is never
//! evicted, scrubbed or handed out under it), the accounting
//! `free + in_use + held + cached == capacity` holds, nothing deadlocks,
//! and the pool ends full. Every page access is reported to loom, which
//! fails the model if an eviction's scrub is not ordered after the last
//! read of the page.
//!
//! Run: `RUSTFLAGS="--cfg handoff_loom" cargo test --release --test loom_prefix`
//! (CI runs it; without `--cfg handoff_loom` this file compiles to nothing).
#![cfg(handoff_loom)]

use handoff::kv::{CacheSecret, PrefixCache};
use handoff::{KvDtype, KvError, KvGeometry, KvPool, PoolConfig, RequestId, TenantId};
use loom::thread;

const PROMPT: [u32; 3] = [5, 6, 7];

fn value(pos: usize) -> f32 {
    10.0 + pos as f32
}

/// A 3-page pool (1 token a page) whose cache holds the 3 pages of
/// `PROMPT`, idle: the publisher has finished.
fn cached_pool() -> (KvPool, PrefixCache) {
    let g = KvGeometry {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 1,
        dtype: KvDtype::F32,
    };
    let pool = KvPool::new(PoolConfig::new(g, 1, 3)).unwrap();
    let cache = PrefixCache::new(&pool, 1, CacheSecret::from_bytes([9; 32]));
    let keys = cache.keys(TenantId(1), &PROMPT);
    let mut seq = cache.reserve(RequestId(1), &keys, 3).unwrap();
    for pos in 0..3 {
        seq.append(0, &[value(pos)], &[value(pos)]).unwrap();
    }
    assert_eq!(cache.publish(&mut seq, &keys).unwrap(), 3);
    drop(seq);
    assert_eq!(pool.stats().cached_idle, 3);
    (pool, cache)
}

#[test]
fn a_leased_page_is_never_evicted_under_its_reader() {
    loom::model(|| {
        let (pool, cache) = cached_pool();
        let reader = {
            let cache = cache.clone();
            thread::spawn(move || {
                let keys = cache.keys(TenantId(1), &PROMPT);
                let mut seq = match cache.reserve(RequestId(2), &keys, 3) {
                    Ok(seq) => seq,
                    // The other request took two pages; one is left.
                    Err(KvError::Exhausted { .. }) => return None,
                    Err(e) => panic!("a reserve fails only by exhaustion, got {e}"),
                };
                // What was not leased is computed here, as a prefill would.
                for pos in seq.written(0)..3 {
                    seq.append(0, &[value(pos)], &[value(pos)]).unwrap();
                }
                let pool = cache.pool();
                assert!(pool.stats().balanced(), "{:?}", pool.stats());
                let reader = pool.reader();
                let lv = reader.seq(&seq).unwrap().layer(0).unwrap();
                for pos in 0..3 {
                    let mut v = [0f32];
                    lv.key(pos).unwrap().to_f32_into(&mut v);
                    assert_eq!(v[0], value(pos), "a leased page changed under its reader");
                }
                Some(seq.shared_pages())
            })
        };
        // Another tenant's request needs two pages: only idle ones can be
        // evicted for it.
        let other = match pool.reserve(RequestId(3), 2) {
            Ok(mut seq) => {
                seq.append(0, &[-1.0, -2.0], &[-1.0, -2.0]).unwrap();
                assert!(pool.stats().balanced(), "{:?}", pool.stats());
                Some(seq)
            }
            Err(KvError::Exhausted { .. }) => None,
            Err(e) => panic!("a reserve fails only by exhaustion, got {e}"),
        };
        let leased = reader.join().unwrap();
        // Whoever came first got its pages: both may, never neither.
        assert!(leased.is_some() || other.is_some());
        drop(other);
        let st = pool.stats();
        assert!(st.balanced() && st.is_full(), "{st:?}");
        cache.evict_idle();
        assert!(pool.stats().all_free());
        for i in 0..3 {
            assert!(pool.audit_page_matches_scrub(i), "page {i}");
        }
    });
}

#[test]
fn leases_returned_concurrently_leave_the_page_cached_and_idle() {
    loom::model(|| {
        let (pool, cache) = cached_pool();
        let keys = cache.keys(TenantId(1), &PROMPT);
        // Two readers of the same two pages (3 tokens: 2 leased, 1 private
        // page each; the first evicts the idle third page).
        let a = cache.reserve(RequestId(2), &keys, 3).unwrap();
        let t = thread::spawn(move || drop(a));
        let b = cache.reserve(RequestId(3), &keys, 3);
        let b_leased = b.as_ref().map(|s| s.shared_pages()).unwrap_or(0);
        drop(b);
        t.join().unwrap();
        assert!(b_leased == 0 || b_leased == 2);
        let st = pool.stats();
        assert!(st.balanced() && st.is_full(), "{st:?}");
        assert_eq!(st.cached, 2, "the two shared pages stay cached");
    });
}
