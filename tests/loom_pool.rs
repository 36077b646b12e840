//! Model checking of the page pool's shared state with loom: every
//! interleaving of concurrent reserve, write, hold and release keeps
//! `free + in_use + held == capacity`, never hands one page to two owners,
//! never deadlocks, and returns the pool to full. Page bytes have no lock:
//! every access to a page is reported to loom, which fails the model if two
//! accesses (a write and anything else) are not ordered, e.g. a scrub
//! racing the page's next owner.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test --release --test loom_pool`
//! (CI runs it; without `--cfg loom` this file compiles to nothing).
#![cfg(loom)]

use handoff::{KvDtype, KvGeometry, KvPool, PoolConfig, RequestId};
use loom::thread;

fn pool(pages: usize) -> KvPool {
    let g = KvGeometry {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 1,
        dtype: KvDtype::F32,
    };
    KvPool::new(PoolConfig::new(g, 1, pages)).unwrap()
}

#[test]
fn concurrent_reserve_write_release_keeps_accounting() {
    loom::model(|| {
        let pool = pool(3);
        let handles: Vec<_> = (0..2u64)
            .map(|r| {
                let pool = pool.clone();
                thread::spawn(move || {
                    if let Ok(mut seq) = pool.reserve(RequestId(r), 2) {
                        seq.append(0, &[r as f32; 2], &[r as f32; 2]).unwrap();
                        let st = pool.stats();
                        assert!(st.balanced(), "{st:?}");
                        let reader = pool.reader();
                        let lv = reader.seq(&seq).unwrap().layer(0).unwrap();
                        let mut v = [0f32];
                        lv.key(1).unwrap().to_f32_into(&mut v);
                        assert_eq!(v[0], r as f32, "read another owner's bytes");
                        let held = seq.hold();
                        assert!(pool.stats().balanced());
                        drop(held);
                    }
                })
            })
            .collect();
        let st = pool.stats();
        assert!(st.balanced(), "{st:?}");
        for h in handles {
            h.join().unwrap();
        }
        assert!(pool.stats().is_full());
    });
}

#[test]
fn exhaustion_under_contention_is_typed_and_exact() {
    loom::model(|| {
        let pool = pool(2);
        let p2 = pool.clone();
        let t = thread::spawn(move || p2.reserve(RequestId(1), 2).map(|s| s.pages().len()));
        let mine = pool.reserve(RequestId(2), 2);
        let theirs = t.join().unwrap();
        // At most one of two 2-page reservations on a 2-page pool can win
        // while the other is alive; a loser gets Exhausted, never a page.
        match (&mine, &theirs) {
            (Ok(_), Ok(_)) => {} // the other had already released
            (Err(e), _) | (_, Err(e)) => {
                assert!(matches!(e, handoff::KvError::Exhausted { .. }), "{e}")
            }
        }
        drop(mine);
        assert!(pool.stats().is_full());
    });
}
