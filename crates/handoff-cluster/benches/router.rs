//! The router's decision cost with 10,000 cached prefixes across 4 prefill
//! workers (issue 41: <= 20 us per request).
//!
//! 100 tenants x 100 prompts, each cached as 8 pages of 16 tokens on one of
//! the 4 prefill workers (80,000 indexed pages), 4 decode workers. Each
//! request is a 512-token prompt (32 pages) whose first 8 pages are one
//! cached prefix. `choose` is the decision given the request's page keys;
//! `page_keys + choose` adds deriving those keys (BLAKE3 over the prompt
//! under the tenant's salt), which the router does once per request.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use handoff::KvDtype;
use handoff::TenantId;
use handoff::fingerprint::ModelFingerprint;
use handoff::kv::CacheSecret;
use handoff_cluster::{
    Epoch, Member, PrefixIndex, Role, Transport, WorkerId, WorkerKey, WorkerRecord, choose,
};

const MODEL: u64 = 0xabc;
const PAGE: usize = 16;
const TENANTS: u32 = 100;
const PROMPTS: u32 = 100;

fn member(name: &str, role: Role, free: u64) -> Member {
    Member {
        id: WorkerId::new(name).unwrap_or_else(|e| panic!("{e}")),
        record: WorkerRecord {
            role,
            address: "127.0.0.1:7000".into(),
            transport: Transport::Tcp,
            public_key: WorkerKey::from_bytes([1; 32]),
            model: ModelFingerprint::from_u64(MODEL),
            pages_free: free,
            pages_total: 4096,
            queue_depth: free % 3,
            kv_dtype: KvDtype::F16,
            epoch: Epoch(1),
        },
        revision: 1,
    }
}

/// Prompt `j` of tenant `t`, `len` tokens, from a seeded generator.
fn prompt(t: u32, j: u32, len: usize) -> Vec<u32> {
    let mut s = (u64::from(t) << 32 | u64::from(j)).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 32_000) as u32
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let secret = CacheSecret::from_bytes([3; 32]);
    let mut index = PrefixIndex::new();
    let prefill: Vec<Member> = (0..4)
        .map(|i| member(&format!("p{i}"), Role::Prefill, 1000 + i))
        .collect();
    let decode: Vec<Member> = (0..4)
        .map(|i| member(&format!("d{i}"), Role::Decode, 900 + i))
        .collect();
    let live: Vec<Member> = prefill.iter().chain(&decode).cloned().collect();
    for t in 0..TENANTS {
        for j in 0..PROMPTS {
            let keys = secret.page_keys(TenantId(t), MODEL, PAGE, &prompt(t, j, 8 * PAGE));
            let w = &prefill[((t * PROMPTS + j) % 4) as usize].id;
            index.stored(w, &keys).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    assert_eq!(index.pages(), (TENANTS * PROMPTS * 8) as usize);

    let requests: Vec<(TenantId, Vec<u32>)> = (0..64)
        .map(|r| {
            let (t, j) = (r * 37 % TENANTS, r * 11 % PROMPTS);
            let mut p = prompt(t, j, 8 * PAGE);
            p.extend(prompt(t + 1000, r, 24 * PAGE));
            (TenantId(t), p)
        })
        .collect();
    let keys: Vec<_> = requests
        .iter()
        .map(|(t, p)| secret.page_keys(*t, MODEL, PAGE, &p[..p.len() - 1]))
        .collect();
    for k in &keys {
        let route = choose(&live, &index, k, 40).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            route.cached_pages, 8,
            "every request finds its cached prefix"
        );
    }

    let mut g = c.benchmark_group("router_10k_prefixes_4_workers");
    let mut i = 0;
    g.bench_function("choose", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            black_box(choose(&live, &index, black_box(&keys[i]), 40))
        })
    });
    g.bench_function("page_keys + choose", |b| {
        b.iter(|| {
            i = (i + 1) % requests.len();
            let (t, p) = &requests[i];
            let k = secret.page_keys(*t, MODEL, PAGE, &p[..p.len() - 1]);
            black_box(choose(&live, &index, &k, 40))
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
