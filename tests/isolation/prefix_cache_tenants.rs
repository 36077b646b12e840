//! Eight tenants send conversations that all begin with the same system
//! prompt. Each tenant's later requests reuse the pages its own first
//! request published; no request ever reads a page another tenant
//! published, even for the very same tokens, and what a request reads from
//! the cache is exactly what it would have computed itself.

use std::collections::HashMap;

use handoff::kv::{CacheSecret, Filling, KvSeq, PrefixCache};
use handoff::{KvDtype, KvGeometry, KvPool, PoolConfig, RequestId, TenantId};

const PAGE: usize = 4;

fn pool(pages: usize) -> KvPool {
    let g = KvGeometry {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 2,
        dtype: KvDtype::F32,
    };
    KvPool::new(PoolConfig::new(g, PAGE, pages)).unwrap()
}

/// What a tenant's model computes at `pos` of `prompt` in `layer`: a value
/// that depends on the tenant (a stand-in for tenant-specific state such as
/// an adapter), every token up to `pos`, the position and the layer.
fn value(tenant: TenantId, prompt: &[u32], pos: usize, layer: usize) -> f32 {
    let mut h = u64::from(tenant.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for &t in &prompt[..=pos] {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    h ^= (layer as u64) << 56 | pos as u64;
    (h % 1_000_003) as f32 + 1.0
}

/// Computes (appends) every position of `prompt` the sequence did not reuse.
fn prefill(seq: &mut KvSeq<Filling>, tenant: TenantId, prompt: &[u32]) {
    for layer in 0..2 {
        for pos in seq.written(layer)..prompt.len() {
            let x = value(tenant, prompt, pos, layer);
            seq.append(layer, &[x, -x], &[-x, x]).unwrap();
        }
    }
}

/// Reads every written position through the validated views and checks it
/// holds what `tenant` computes for `prompt`.
fn reads_its_own_prompt(pool: &KvPool, seq: &KvSeq<Filling>, tenant: TenantId, prompt: &[u32]) {
    let reader = pool.reader();
    let view = reader.seq(seq).expect("a valid sequence");
    for layer in 0..2 {
        let lv = view.layer(layer).expect("audited read");
        assert_eq!(lv.len(), prompt.len());
        for pos in 0..prompt.len() {
            let mut k = [0f32; 2];
            lv.key(pos).unwrap().to_f32_into(&mut k);
            let x = value(tenant, prompt, pos, layer);
            assert_eq!(k, [x, -x], "{tenant} read a wrong value at {pos}");
        }
    }
}

#[test]
fn the_same_prompt_from_eight_tenants_shares_pages_only_within_each_tenant() {
    let pool = pool(256);
    let cache = PrefixCache::new(&pool, 0xfeed, CacheSecret::from_bytes([7; 32]));
    // A 5-page system prompt, then a per-conversation question.
    let system: Vec<u32> = (100..120).collect();
    let mut published_by: HashMap<u32, TenantId> = HashMap::new();
    let (mut same_tenant_hits, mut cross_tenant_hits, mut looked_up) = (0, 0, 0);
    let mut id = 0;
    for round in 0..4u32 {
        for t in 0..8 {
            let tenant = TenantId(t);
            let mut prompt = system.clone();
            prompt.extend([round, t, 7]);
            let keys = cache.keys(tenant, &prompt);
            id += 1;
            let mut seq = cache
                .reserve(RequestId(id), &keys, prompt.len() + 4)
                .unwrap();
            looked_up += keys.reusable_pages();
            for p in &seq.pages()[..seq.shared_pages()] {
                match published_by.get(&p.index()) {
                    Some(&owner) if owner == tenant => same_tenant_hits += 1,
                    _ => cross_tenant_hits += 1,
                }
            }
            // Round 0 finds nothing: every tenant computes its own copy.
            let expect_reused = if round == 0 { 0 } else { system.len() };
            assert_eq!(seq.reused_tokens(), expect_reused, "{tenant} round {round}");
            prefill(&mut seq, tenant, &prompt);
            reads_its_own_prompt(&pool, &seq, tenant, &prompt);
            let before = seq.shared_pages();
            let n = cache.publish(&mut seq, &keys).unwrap();
            for p in &seq.pages()[before..before + n] {
                published_by.insert(p.index(), tenant);
            }
            // Published pages stay readable by their publisher, unchanged.
            reads_its_own_prompt(&pool, &seq, tenant, &prompt);
            assert!(pool.stats().balanced(), "{:?}", pool.stats());
        }
    }
    assert_eq!(cross_tenant_hits, 0, "a tenant read another tenant's page");
    let rate = same_tenant_hits as f64 / looked_up as f64;
    assert!(rate >= 0.5, "same-tenant hit rate {rate}");
    let c = cache.counters();
    assert_eq!(c.hit_pages, same_tenant_hits);
    assert_eq!(c.lookups, 32);
    // 8 tenants x 5 system pages, each published once; the question's page
    // (the last, partial one) never is.
    assert_eq!(published_by.len(), 8 * 5);
    assert_eq!(pool.stats().isolation_violations, 0);
    let st = pool.stats();
    assert!(st.is_full() && st.cached == 40, "{st:?}");
    assert_eq!(cache.evict_idle(), 40);
    assert!(pool.stats().all_free());
}

#[test]
fn a_prompt_that_fills_its_last_page_still_computes_its_last_token() {
    let pool = pool(16);
    let cache = PrefixCache::new(&pool, 1, CacheSecret::from_bytes([1; 32]));
    let tenant = TenantId(3);
    let prompt: Vec<u32> = (0..(3 * PAGE) as u32).collect();
    let keys = cache.keys(tenant, &prompt);
    let mut first = cache
        .reserve(RequestId(1), &keys, prompt.len() + 1)
        .unwrap();
    prefill(&mut first, tenant, &prompt);
    assert_eq!(
        cache.publish(&mut first, &keys).unwrap(),
        3,
        "all 3 pages full"
    );
    drop(first);
    let mut again = cache
        .reserve(RequestId(2), &keys, prompt.len() + 1)
        .unwrap();
    // Pages 0 and 1 reused; page 2 holds the last token: computed, private.
    assert_eq!(again.reused_tokens(), 2 * PAGE);
    assert_eq!(again.shared_pages(), 2);
    assert_ne!(again.pages()[2], first_page_2(&cache, tenant, &prompt));
    prefill(&mut again, tenant, &prompt);
    reads_its_own_prompt(&pool, &again, tenant, &prompt);
    // Publishing again finds page 2's key taken: nothing new is cached.
    assert_eq!(cache.publish(&mut again, &keys).unwrap(), 0);
    drop(again);
    assert!(pool.stats().is_full());
}

/// The page the cache holds for the third page of `prompt` (leased from a
/// longer prompt that makes it reusable, then returned).
fn first_page_2(cache: &PrefixCache, tenant: TenantId, prompt: &[u32]) -> handoff::kv::PageId {
    let mut longer = prompt.to_vec();
    longer.push(0);
    let keys = cache.keys(tenant, &longer);
    let seq = cache.reserve(RequestId(99), &keys, longer.len()).unwrap();
    assert_eq!(seq.shared_pages(), 3);
    seq.pages()[2]
}

#[test]
fn keys_of_another_pool_or_a_short_reservation_are_refused() {
    let (p1, p2) = (pool(8), pool(8));
    let c1 = PrefixCache::new(&p1, 1, CacheSecret::from_bytes([1; 32]));
    let c2 = PrefixCache::new(&p2, 1, CacheSecret::from_bytes([1; 32]));
    let prompt = [1u32; 9];
    let keys = c1.keys(TenantId(1), &prompt);
    assert!(c2.reserve(RequestId(1), &keys, 12).is_err());
    assert!(
        c1.reserve(RequestId(1), &keys, 8).is_err(),
        "shorter than the prompt"
    );
    // A sequence that leased under one tenant cannot publish under another.
    let mut seq = c1.reserve(RequestId(1), &keys, 12).unwrap();
    prefill(&mut seq, TenantId(1), &prompt);
    c1.publish(&mut seq, &keys).unwrap();
    let other = c1.keys(TenantId(2), &prompt);
    let e = c1.publish(&mut seq, &other).unwrap_err();
    assert_eq!(handoff::HttpStatus::http_status(&e), 500);
    drop(seq);
    assert!(p1.stats().is_full() && p2.stats().all_free());
}
