//! The cache under pool pressure: idle cached pages are reclaimed (scrubbed)
//! for a request that fits, pages a sequence is reading are never taken,
//! and random interleavings of start, publish, hold, read, evict and drop
//! keep every read exact, the accounting balanced and the pool full at the
//! end.

use handoff::kv::{CacheSecret, Filling, Held, KvSeq, PrefixCache, Readable};
use handoff::{KvDtype, KvError, KvGeometry, KvPool, PoolConfig, RequestId, ScrubPolicy, TenantId};
use proptest::prelude::*;

const PAGE: usize = 4;

fn pool(pages: usize, scrub: ScrubPolicy) -> KvPool {
    let g = KvGeometry {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 1,
        dtype: KvDtype::F32,
    };
    KvPool::new(PoolConfig::new(g, PAGE, pages).scrub(scrub)).unwrap()
}

fn cache(pool: &KvPool) -> PrefixCache {
    PrefixCache::new(pool, 42, CacheSecret::from_bytes([3; 32]))
}

/// The value `tenant` computes at `pos` of `prompt` in `layer` (never 0,
/// so a scrubbed slot cannot pass for it).
fn value(tenant: TenantId, prompt: &[u32], pos: usize, layer: usize) -> f32 {
    let mut h = u64::from(tenant.0) + 1;
    for &t in &prompt[..=pos] {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    (h.wrapping_add((layer * 1000 + pos) as u64) % 999_983) as f32 + 1.0
}

fn prefill(seq: &mut KvSeq<Filling>, tenant: TenantId, prompt: &[u32]) {
    for layer in 0..2 {
        for pos in seq.written(layer)..prompt.len() {
            let x = value(tenant, prompt, pos, layer);
            seq.append(layer, &[x], &[x]).unwrap();
        }
    }
}

fn check_reads<S: Readable>(pool: &KvPool, seq: &KvSeq<S>, tenant: TenantId, prompt: &[u32]) {
    let reader = pool.reader();
    let view = reader
        .seq(seq)
        .expect("every page of a live sequence validates");
    for layer in 0..2 {
        let lv = view.layer(layer).expect("audited read");
        for pos in 0..prompt.len() {
            let mut k = [0f32];
            lv.key(pos).unwrap().to_f32_into(&mut k);
            assert_eq!(k[0], value(tenant, prompt, pos, layer), "pos {pos}");
        }
    }
}

/// Publishes `prompt` for `tenant` and returns the sequence that computed it.
fn publish(cache: &PrefixCache, id: u64, tenant: TenantId, prompt: &[u32]) -> KvSeq<Filling> {
    let keys = cache.keys(tenant, prompt);
    let mut seq = cache.reserve(RequestId(id), &keys, prompt.len()).unwrap();
    prefill(&mut seq, tenant, prompt);
    cache.publish(&mut seq, &keys).unwrap();
    seq
}

#[test]
fn a_cache_full_of_idle_pages_still_admits_a_request_that_fits() {
    let pool = pool(8, ScrubPolicy::Zero);
    let cache = cache(&pool);
    let prompt: Vec<u32> = (0..25).collect(); // 6 full pages + 1 token
    drop(publish(&cache, 1, TenantId(1), &prompt));
    let st = pool.stats();
    assert_eq!((st.free, st.cached, st.cached_idle), (2, 6, 6));
    assert_eq!(st.available(), 8);
    // Another tenant needs 5 pages: 2 free, 3 evicted (least recent first).
    let other = pool.reserve(RequestId(2), 5 * PAGE).unwrap();
    assert_eq!(cache.counters().evictions, 3);
    let st = pool.stats();
    assert_eq!((st.free, st.in_use, st.cached), (0, 5, 3));
    assert!(st.balanced());
    // The deepest pages went first: the first 3 pages still hit.
    let keys = cache.keys(TenantId(1), &prompt);
    assert_eq!(cache.probe(&keys), 3);
    let again = cache.reserve(RequestId(3), &keys, prompt.len());
    let again = again.unwrap_err();
    assert!(matches!(again, KvError::Exhausted { .. }), "{again}");
    drop(other);
    let again = cache.reserve(RequestId(3), &keys, prompt.len()).unwrap();
    assert_eq!(again.shared_pages(), 3);
    check_reads(
        &pool,
        &{
            let mut s = again;
            prefill(&mut s, TenantId(1), &prompt);
            s
        },
        TenantId(1),
        &prompt,
    );
    assert!(pool.stats().is_full());
}

#[test]
fn eviction_never_takes_a_page_a_sequence_is_reading() {
    let pool = pool(8, ScrubPolicy::Poison);
    let cache = cache(&pool);
    let tenant = TenantId(5);
    let prompt: Vec<u32> = (0..17).collect(); // 4 full pages + 1 token
    drop(publish(&cache, 1, tenant, &prompt));
    let keys = cache.keys(tenant, &prompt);
    let mut reader = cache.reserve(RequestId(2), &keys, prompt.len()).unwrap();
    assert_eq!(reader.shared_pages(), 4);
    prefill(&mut reader, tenant, &prompt);
    // 3 pages are free; the 4 leased ones cannot be taken.
    let st = pool.stats();
    assert_eq!(
        (st.free, st.cached, st.cached_idle, st.available()),
        (3, 4, 0, 3)
    );
    let e = pool.reserve(RequestId(3), 4 * PAGE).unwrap_err();
    assert_eq!(
        e,
        KvError::Exhausted {
            requested: 4,
            free: 3,
            capacity: 8
        }
    );
    let taken = pool.reserve(RequestId(4), 3 * PAGE).unwrap();
    assert_eq!(cache.counters().evictions, 0);
    check_reads(&pool, &reader, tenant, &prompt);
    drop(taken);
    // Held, the lease stays: the cached pages still cannot be taken.
    let held: KvSeq<Held> = reader.hold();
    assert!(pool.reserve(RequestId(5), 4 * PAGE).is_err());
    check_reads(&pool, &held, tenant, &prompt);
    let st = pool.stats();
    assert_eq!((st.held, st.cached, st.cached_idle), (1, 4, 0));
    drop(held);
    // Now idle: a request that needs them gets them, scrubbed.
    let all = pool.reserve(RequestId(6), 8 * PAGE).unwrap();
    assert_eq!(cache.counters().evictions, 4);
    drop(all);
    assert!(pool.stats().all_free());
}

#[test]
fn an_evicted_page_is_scrubbed_per_the_pool_policy() {
    for scrub in [
        ScrubPolicy::Zero,
        ScrubPolicy::Poison,
        ScrubPolicy::AcceptStaleBytes,
    ] {
        let pool = pool(4, scrub);
        let cache = cache(&pool);
        let prompt: Vec<u32> = (0..9).collect();
        let seq = publish(&cache, 1, TenantId(1), &prompt);
        let cached: Vec<u32> = seq.pages()[..2].iter().map(|p| p.index()).collect();
        drop(seq);
        for &i in &cached {
            assert!(
                !pool.audit_page_matches_scrub(i),
                "{scrub:?}: a cached page is not free (nor scrubbed) until evicted"
            );
        }
        assert_eq!(cache.evict_idle(), 2);
        for &i in &cached {
            assert!(pool.audit_page_matches_scrub(i), "{scrub:?}: page {i}");
        }
        assert!(pool.stats().all_free());
    }
}

#[derive(Clone, Debug)]
enum Op {
    Start { tenant: u32, prompt: usize },
    Publish(usize),
    Hold(usize),
    Read(usize),
    Drop(usize),
    Evict,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3u32, 0..4usize).prop_map(|(tenant, prompt)| Op::Start { tenant, prompt }),
        3 => (0..8usize).prop_map(Op::Publish),
        1 => (0..8usize).prop_map(Op::Hold),
        2 => (0..8usize).prop_map(Op::Read),
        2 => (0..8usize).prop_map(Op::Drop),
        1 => Just(Op::Evict),
    ]
}

/// Four prompts: two share a 3-page system prompt, one shares its first
/// page and a half, one shares nothing.
fn prompts() -> Vec<Vec<u32>> {
    let system: Vec<u32> = (10..22).collect();
    let mut a = system.clone();
    a.push(1);
    let mut b = system.clone();
    b.extend([2, 3, 4, 5, 6]);
    let mut c = system[..6].to_vec();
    c.extend([9; 7]);
    vec![a, b, c, (50..59).collect()]
}

enum Live {
    Filling(KvSeq<Filling>),
    Held(KvSeq<Held>),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn random_interleavings_keep_reads_exact_and_the_pool_balanced(
        ops in proptest::collection::vec(op(), 1..60)
    ) {
        let pool = pool(14, ScrubPolicy::Poison);
        let cache = cache(&pool);
        let prompts = prompts();
        let mut live: Vec<(TenantId, usize, Live)> = Vec::new();
        let mut id = 0;
        for op in ops {
            match op {
                Op::Start { tenant, prompt } => {
                    let (tenant, p) = (TenantId(tenant), &prompts[prompt]);
                    id += 1;
                    let keys = cache.keys(tenant, p);
                    match cache.reserve(RequestId(id), &keys, p.len() + 2) {
                        Ok(mut seq) => {
                            prefill(&mut seq, tenant, p);
                            live.push((tenant, prompt, Live::Filling(seq)));
                        }
                        Err(KvError::Exhausted { .. }) => {}
                        Err(e) => panic!("reserve fails only by exhaustion: {e}"),
                    }
                }
                Op::Publish(i) => {
                    if let Some((tenant, p, Live::Filling(seq))) = live.get_mut(i) {
                        let keys = cache.keys(*tenant, &prompts[*p]);
                        cache.publish(seq, &keys).unwrap();
                    }
                }
                Op::Hold(i) => {
                    if i < live.len() && matches!(live[i].2, Live::Filling(_)) {
                        let (t, p, s) = live.remove(i);
                        if let Live::Filling(seq) = s {
                            live.push((t, p, Live::Held(seq.hold())));
                        }
                    }
                }
                Op::Read(i) => {
                    if let Some((tenant, p, s)) = live.get(i) {
                        match s {
                            Live::Filling(seq) => check_reads(&pool, seq, *tenant, &prompts[*p]),
                            Live::Held(seq) => check_reads(&pool, seq, *tenant, &prompts[*p]),
                        }
                    }
                }
                Op::Drop(i) => {
                    if i < live.len() {
                        live.remove(i);
                    }
                }
                Op::Evict => {
                    cache.evict_idle();
                }
            }
            let st = pool.stats();
            prop_assert!(st.balanced(), "{st:?}");
            prop_assert_eq!(st.isolation_violations, 0);
        }
        // Every live sequence still reads exactly what it computed,
        // whatever was evicted around it.
        for (tenant, p, s) in &live {
            match s {
                Live::Filling(seq) => check_reads(&pool, seq, *tenant, &prompts[*p]),
                Live::Held(seq) => check_reads(&pool, seq, *tenant, &prompts[*p]),
            }
        }
        drop(live);
        prop_assert!(pool.stats().is_full(), "{:?}", pool.stats());
        cache.evict_idle();
        prop_assert!(pool.stats().all_free());
        for i in 0..14 {
            prop_assert!(pool.audit_page_matches_scrub(i), "page {} not scrubbed", i);
        }
    }
}
