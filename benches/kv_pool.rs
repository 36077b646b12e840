//! KvPool benchmarks: page reserve+release throughput (goal: >= 20 million
//! page operations per second on one core) and the scrub cost per page.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use handoff::{KvDtype, KvGeometry, KvPool, PoolConfig, RequestId, ScrubPolicy};

fn geometry() -> KvGeometry {
    // Llama-3-8B-shaped KV: 32 layers, 8 KV heads of 128, bf16.
    KvGeometry {
        n_layers: 32,
        n_kv_heads: 8,
        head_dim: 128,
        dtype: KvDtype::BF16,
    }
}

fn reserve_release(c: &mut Criterion) {
    let mut g = c.benchmark_group("kv_pool/reserve_release");
    for pages in [1usize, 16, 256] {
        // Page operations: each page is allocated once and released once.
        g.throughput(Throughput::Elements(2 * pages as u64));
        let small = KvGeometry {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 1,
            dtype: KvDtype::F32,
        };
        let pool =
            KvPool::new(PoolConfig::new(small, 16, 4096).scrub(ScrubPolicy::AcceptStaleBytes))
                .expect("valid pool");
        g.bench_function(format!("{pages}_pages"), |b| {
            b.iter(|| {
                let seq = pool.reserve(RequestId(1), pages * 16).expect("fits");
                black_box(&seq);
                seq.release();
            })
        });
    }
    g.finish();
}

fn scrub(c: &mut Criterion) {
    let mut g = c.benchmark_group("kv_pool/scrub_per_page");
    let page_size = 16;
    let bytes = geometry().bytes_per_token() * page_size;
    g.throughput(Throughput::Bytes(bytes as u64));
    for policy in [
        ScrubPolicy::AcceptStaleBytes,
        ScrubPolicy::Zero,
        ScrubPolicy::Poison,
    ] {
        let pool = KvPool::new(PoolConfig::new(geometry(), page_size, 64).scrub(policy))
            .expect("valid pool");
        g.bench_function(format!("{policy:?}"), |b| {
            b.iter(|| {
                let seq = pool.reserve(RequestId(1), page_size).expect("fits");
                seq.release();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, reserve_release, scrub);
criterion_main!(benches);
