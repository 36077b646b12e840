//! A pool whose page bytes live in GPU memory (`CudaPages`) keeps every
//! rule the staged stand-in keeps in `tests/isolation/device_resident_pages`:
//! the same story body, on the device. Prints SKIP without a GPU.
#![cfg(feature = "cuda")]

use handoff::backend::cuda::{CudaPages, device_for_test};
use handoff::{KvPool, PoolConfig};

#[test]
fn cuda_pages_keep_every_rule_of_a_pool() {
    let Some(dev) = device_for_test("cuda_pages_keep_every_rule_of_a_pool") else {
        return;
    };
    crate::support::device_pages::device_pages_keep_every_rule(&|cfg: PoolConfig| {
        let pages = CudaPages::for_pool(&dev, &cfg).unwrap();
        KvPool::with_device_pages(cfg, Box::new(pages)).unwrap()
    });
}

#[test]
fn a_pool_planned_from_free_device_memory_builds_and_more_than_the_device_is_a_typed_error() {
    use handoff::{Colocated, EngineConfigBuilder, KvDtype, KvGeometry};
    let Some(dev) = device_for_test("a_pool_planned_from_free_device_memory") else {
        return;
    };
    let (free, total) = dev.memory_info().unwrap();
    assert!(free > 0 && free <= total, "{free} of {total}");
    let g = KvGeometry {
        n_layers: 16,
        n_kv_heads: 8,
        head_dim: 64,
        dtype: KvDtype::BF16,
    };
    // A tenth of what is free now: the pool takes the whole pages in it.
    let cfg = EngineConfigBuilder::<Colocated>::new(g)
        .max_context(4096)
        .pool_memory(free as u64 / 10)
        .build()
        .unwrap();
    let bytes = cfg.pool_config().storage_bytes().unwrap();
    assert!(bytes as u64 <= free as u64 / 10);
    let pages = CudaPages::for_pool(&dev, &cfg.pool_config()).unwrap();
    let pool = KvPool::with_device_pages(cfg.pool_config(), Box::new(pages)).unwrap();
    let (after, _) = dev.memory_info().unwrap();
    assert!(
        after + bytes / 2 <= free,
        "the pool's pages are on the device"
    );
    drop(pool);
    // More than the device holds is an error to report, not a crash.
    let huge = handoff::PoolConfig::new(g, 16, total / cfg.bytes_per_page() * 2);
    let e = CudaPages::for_pool(&dev, &huge).unwrap_err();
    eprintln!("asking for twice the device: {e}");
}

/// 8 pages of 16 tokens, 2 layers of 2 bf16 heads of 64: 128 KiB.
fn small_pool() -> PoolConfig {
    let g = handoff::KvGeometry {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 64,
        dtype: handoff::KvDtype::BF16,
    };
    PoolConfig::new(g, 16, 8)
}

#[test]
fn cuda_pages_hash_ranges_on_the_device_as_the_host_does() {
    use handoff::kv::DevicePages;
    let Some(dev) = device_for_test("cuda_pages_hash_ranges_on_the_device_as_the_host_does") else {
        return;
    };
    let cfg = small_pool();
    let pages = CudaPages::for_pool(&dev, &cfg).unwrap();
    let bytes: Vec<u8> = (0..pages.len())
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1])
        .collect();
    pages.write(0, &bytes).unwrap();
    // Empty, short, unaligned, one page's region, and the whole arena.
    let ranges = [
        (0, 0),
        (3, 1),
        (17, 255),
        (4096, 4096),
        (1, 12345),
        (0, pages.len()),
    ];
    let got = pages
        .xxh3_ranges(&ranges)
        .expect("CUDA pages hash")
        .unwrap();
    let want: Vec<u64> = ranges
        .iter()
        .map(|&(at, len)| twox_hash::XxHash3_64::oneshot(&bytes[at..at + len]))
        .collect();
    assert_eq!(got, want);
    // A range past the end is an error, not a read of other memory.
    let past = pages
        .xxh3_ranges(&[(pages.len() - 4, 8)])
        .expect("CUDA pages hash");
    assert!(past.is_err());
}

#[test]
fn cuda_pages_copy_runs_from_another_pools_pages_on_the_device() {
    use handoff::kv::DevicePages;
    let Some(dev) = device_for_test("cuda_pages_copy_runs_from_another_pools_pages_on_the_device")
    else {
        return;
    };
    let cfg = small_pool();
    let (a, b) = (
        CudaPages::for_pool(&dev, &cfg).unwrap(),
        CudaPages::for_pool(&dev, &cfg).unwrap(),
    );
    let len = a.len();
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    a.write(0, &bytes).unwrap();
    b.fill(0, len, &[0, 0]).unwrap();
    let runs = [(0, 4096, 512), (8192, 0, 256), (100, 20_000, 3)];
    b.copy_from(&a, &runs)
        .expect("CUDA pages reach each other")
        .unwrap();
    let mut got = vec![0u8; len];
    b.read(0, &mut got).unwrap();
    let mut want = vec![0u8; len];
    for &(s, d, n) in &runs {
        want[d..d + n].copy_from_slice(&bytes[s..s + n]);
    }
    assert!(got == want, "exactly the runs landed, nothing else changed");
    // A run past either end is an error, and writes nothing.
    let e = b.copy_from(&a, &[(len - 8, 0, 16)]).expect("reachable");
    assert!(e.is_err());
    let mut again = vec![0u8; len];
    b.read(0, &mut again).unwrap();
    assert!(again == want);
}

#[test]
fn cuda_pages_write_and_read_runs_in_staged_passes_that_wait_once_per_chunk() {
    use handoff::kv::DevicePages;
    let Some(dev) =
        device_for_test("cuda_pages_write_and_read_runs_in_staged_passes_that_wait_once_per_chunk")
    else {
        return;
    };
    // Pages of 1 MiB (16 layers, 8 bf16 heads of 128, 16 tokens), 48 of
    // them: a pass over every page is larger than the 32 MiB of staging
    // memory a storage keeps, so it goes in two chunks.
    let g = handoff::KvGeometry {
        n_layers: 16,
        n_kv_heads: 8,
        head_dim: 128,
        dtype: handoff::KvDtype::BF16,
    };
    let cfg = PoolConfig::new(g, 16, 48);
    let pages = CudaPages::for_pool(&dev, &cfg).unwrap();
    let len = pages.len();
    let mib = 1 << 20;
    assert_eq!(len, 48 * mib);
    pages.fill(0, len, &[0, 0]).unwrap();
    let byte = |run: usize, i: usize| (run * 31 + i * 7 + 1) as u8;

    // Every page whole, then short unaligned runs between pages' starts.
    let mut runs: Vec<(usize, usize)> = (0..48).map(|p| (p * mib, mib)).collect();
    let syncs = dev.host_syncs();
    pages
        .write_runs(&runs, &mut |r, dst| {
            for (i, b) in dst.iter_mut().enumerate() {
                *b = byte(r, i);
            }
        })
        .unwrap();
    assert!(
        dev.host_syncs() - syncs <= 2,
        "48 MiB in two chunks: waited {} times",
        dev.host_syncs() - syncs
    );
    runs = vec![(3, 5), (mib + 17, 4093), (7 * mib - 1, 2), (47 * mib, 0)];
    pages
        .write_runs(&runs, &mut |r, dst| {
            for (i, b) in dst.iter_mut().enumerate() {
                *b = byte(r + 100, i);
            }
        })
        .unwrap();
    let mut want: Vec<u8> = (0..len).map(|i| byte(i / mib, i % mib)).collect();
    for (r, &(at, n)) in runs.iter().enumerate() {
        for i in 0..n {
            want[at + i] = byte(r + 100, i);
        }
    }
    let mut got = vec![0u8; len];
    pages.read(0, &mut got).unwrap();
    assert!(
        got == want,
        "every run landed where it was sent, nothing else"
    );

    // Read back as passes: each run's bytes, in order, through the same
    // staging (the whole arena in two chunks, then the short runs).
    let whole: Vec<(usize, usize)> = (0..48).map(|p| (p * mib, mib)).collect();
    for list in [&whole, &runs] {
        let mut seen = Vec::new();
        pages
            .read_runs(list, &mut |r, bytes| {
                let (at, n) = list[r];
                assert!(bytes == &want[at..at + n], "run {r} of {}", list.len());
                seen.push(r);
            })
            .unwrap();
        assert_eq!(seen, (0..list.len()).collect::<Vec<_>>());
    }

    // A run past the end fails the pass before anything is written.
    let e = pages.write_runs(&[(0, 4), (len - 2, 4)], &mut |_, dst| dst.fill(0xEE));
    assert!(e.is_err());
    let e = pages.read_runs(&[(len, 1)], &mut |_, _| panic!("nothing to take"));
    assert!(e.is_err());
    pages.read(0, &mut got).unwrap();
    assert!(got == want, "the failed pass wrote nothing");
}
