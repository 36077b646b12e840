use handoff::TenantId;
use handoff::kv::CacheSecret;

use super::*;
use crate::Epoch;
use crate::record::tests::record;

const MODEL: u64 = 0xfeed;
const PAGE: usize = 4;

fn member(id: &str, role: Role, free: u64, queue: u64) -> Member {
    let mut r = record(role, 1, 1);
    r.pages_free = free;
    r.pages_total = free.max(64);
    r.queue_depth = queue;
    r.epoch = Epoch(1);
    Member {
        id: wid(id),
        record: r,
        revision: 1,
    }
}

fn wid(s: &str) -> WorkerId {
    WorkerId::new(s).unwrap_or_else(|e| panic!("{e}"))
}

fn keys(tenant: u32, prompt: &[u32]) -> Vec<PageKey> {
    CacheSecret::from_bytes([7; 32]).page_keys(TenantId(tenant), MODEL, PAGE, prompt)
}

fn ok<T>(r: Result<T, ClusterError>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

fn pool() -> Vec<Member> {
    vec![
        member("p0", Role::Prefill, 40, 0),
        member("p1", Role::Prefill, 40, 0),
        member("d0", Role::Decode, 40, 1),
        member("d1", Role::Decode, 40, 0),
    ]
}

#[test]
fn the_tenants_cached_prefix_wins_over_load() {
    let prompt: Vec<u32> = (0..32).collect();
    let k = keys(1, &prompt);
    let mut index = PrefixIndex::new();
    ok(index.stored(&wid("p1"), &k[..5]));
    let mut live = pool();
    live[1].record.queue_depth = 3; // p1 busier, but holds the prefix
    let route = ok(choose(&live, &index, &k, 9));
    assert_eq!(route.prefill, wid("p1"));
    assert_eq!(route.cached_pages, 5);
    assert_eq!(route.decode, wid("d1"), "decode goes by queue");
}

#[test]
fn another_tenants_identical_prompt_is_not_steered() {
    let prompt: Vec<u32> = (0..32).collect();
    let mut index = PrefixIndex::new();
    ok(index.stored(&wid("p1"), &keys(1, &prompt)));
    let mut live = pool();
    live[0].record.pages_free = 41; // p0 slightly freer: the load choice
    let route = ok(choose(&live, &index, &keys(2, &prompt), 9));
    assert_eq!(route.prefill, wid("p0"));
    assert_eq!(route.cached_pages, 0);
    assert_eq!(index.cached_run(&wid("p1"), &keys(2, &prompt)), 0);
}

#[test]
fn the_longest_leading_run_counts_not_scattered_pages() {
    let prompt: Vec<u32> = (0..40).collect();
    let k = keys(1, &prompt);
    let mut index = PrefixIndex::new();
    ok(index.stored(&wid("p0"), &k[..3]));
    // p1 holds more pages, but not the first: its cache could reuse none.
    ok(index.stored(&wid("p1"), &k[1..]));
    assert_eq!(index.cached_run(&wid("p0"), &k), 3);
    assert_eq!(index.cached_run(&wid("p1"), &k), 0);
    assert_eq!(ok(choose(&pool(), &index, &k, 11)).prefill, wid("p0"));
}

#[test]
fn without_a_cached_prefix_load_decides_then_the_id() {
    let index = PrefixIndex::new();
    let k = keys(1, &[1, 2, 3, 4, 5]);
    let mut live = pool();
    assert_eq!(
        ok(choose(&live, &index, &k, 2)).prefill,
        wid("p0"),
        "tie: smaller id"
    );
    live[0].record.queue_depth = 2;
    assert_eq!(
        ok(choose(&live, &index, &k, 2)).prefill,
        wid("p1"),
        "shorter queue"
    );
    live[0].record.queue_depth = 0;
    live[1].record.pages_free = 50;
    assert_eq!(
        ok(choose(&live, &index, &k, 2)).prefill,
        wid("p1"),
        "more free pages"
    );
}

#[test]
fn workers_without_room_are_skipped_and_none_left_is_typed() {
    let prompt: Vec<u32> = (0..32).collect();
    let k = keys(1, &prompt);
    let mut index = PrefixIndex::new();
    ok(index.stored(&wid("p1"), &k[..6]));
    let mut live = pool();
    live[0].record.pages_free = 2;
    live[1].record.pages_free = 3; // needs 9 - 6 = 3: fits thanks to its cache
    assert_eq!(ok(choose(&live, &index, &k, 9)).prefill, wid("p1"));
    live[1].record.pages_free = 2;
    assert!(matches!(
        choose(&live, &index, &k, 9),
        Err(ClusterError::NoWorker {
            role: Role::Prefill,
            pages_needed: 9
        })
    ));
    let live = pool();
    assert!(matches!(
        choose(&live, &index, &k, 41),
        Err(ClusterError::NoWorker {
            role: Role::Decode,
            ..
        } | ClusterError::NoWorker {
            role: Role::Prefill,
            ..
        })
    ));
    assert!(matches!(
        choose(&live[..2], &index, &k, 1),
        Err(ClusterError::NoWorker {
            role: Role::Decode,
            ..
        })
    ));
}

#[test]
fn a_forgotten_or_evicting_worker_no_longer_steers() {
    let prompt: Vec<u32> = (0..32).collect();
    let k = keys(1, &prompt);
    let mut index = PrefixIndex::new();
    ok(index.stored(&wid("p1"), &k));
    ok(index.stored(&wid("p0"), &k[..2]));
    index.evicted(&wid("p1"), &k[4..]);
    assert_eq!(index.cached_run(&wid("p1"), &k), 4);
    index.forget(&wid("p1"));
    assert_eq!(index.cached_run(&wid("p1"), &k), 0);
    assert_eq!(index.pages(), 2);
    // The worker's slot is reused by the next one.
    ok(index.stored(&wid("p2"), &k[..1]));
    assert_eq!(index.cached_run(&wid("p2"), &k), 1);
    assert_eq!(index.cached_run(&wid("p0"), &k), 2);
}

#[test]
fn the_index_holds_at_most_64_workers() {
    let k = keys(1, &[1, 2, 3, 4]);
    let mut index = PrefixIndex::new();
    for i in 0..MAX_WORKERS {
        ok(index.stored(&wid(&format!("w{i}")), &k));
    }
    assert!(matches!(
        index.stored(&wid("w64"), &k),
        Err(ClusterError::IndexFull)
    ));
    assert_eq!(index.cached_run(&wid("w63"), &k), 1);
    index.forget(&wid("w5"));
    ok(index.stored(&wid("w64"), &k));
}
