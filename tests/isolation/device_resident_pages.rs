//! A pool whose page bytes live in device memory keeps every rule of a host
//! pool: the host holds who owns each page, at which generation, and what
//! was written; the device holds only bytes. Fresh device memory holds
//! whatever the last process left there, so the pool scrubs it before the
//! first page goes out. A device that fails fails closed: the access that
//! hit it is a typed error that counts nothing written, and the pool hands
//! out no page after it (a page whose scrub may not have landed is never
//! reused), while its accounting still returns to full. A worker refuses a
//! pool whose pages live where its backend does not compute.
//!
//! The device here is `StagedHostPages`: host memory behind explicit
//! copies, so these stories run on every machine.

use handoff::kv::{DevicePages, Residence, StagedHostPages};
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::transfer::InProcess;
use handoff::transfer::{Transfer, TransferConfig};
use handoff::{
    Decode, DecodeWorker, EngineConfigBuilder, EngineError, HttpStatus, KvDtype, KvError,
    KvGeometry, KvPool, PoolConfig, RequestId, ScrubPolicy,
};
use std::sync::Arc;

fn geometry() -> KvGeometry {
    KvGeometry {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 4,
        dtype: KvDtype::BF16,
    }
}

/// A device shared between the test and the pool, so the test can make it
/// fail.
struct Shared(Arc<StagedHostPages>);

impl DevicePages for Shared {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn write(&self, at: usize, src: &[u8]) -> Result<(), handoff::kv::DeviceError> {
        self.0.write(at, src)
    }
    fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), handoff::kv::DeviceError> {
        self.0.read(at, dst)
    }
    fn fill(&self, at: usize, len: usize, e: &[u8]) -> Result<(), handoff::kv::DeviceError> {
        self.0.fill(at, len, e)
    }
    fn device_name(&self) -> String {
        self.0.device_name()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn device_pool(cfg: PoolConfig) -> (KvPool, Arc<StagedHostPages>) {
    let dev = Arc::new(StagedHostPages::new(cfg.storage_bytes().unwrap()));
    let pool = KvPool::with_device_pages(cfg, Box::new(Shared(dev.clone()))).unwrap();
    (pool, dev)
}

fn rows(r: u64, n: usize, kv: usize) -> Vec<f32> {
    (0..n * 4)
        .map(|j| (r * 100 + j as u64) as f32 + kv as f32 * 0.5)
        .collect()
}

#[test]
fn fresh_device_memory_is_scrubbed_before_any_page_is_handed_out() {
    let cfg = PoolConfig::new(geometry(), 4, 8);
    let (pool, dev) = device_pool(cfg);
    assert_eq!(pool.residence(), Residence::Device);
    // The device started as 0xA5 everywhere; every page is zero now.
    for page in 0..pool.capacity() as u32 {
        assert!(pool.audit_page_matches_scrub(page), "page {page}");
    }
    let mut raw = vec![0u8; dev.len()];
    dev.read(0, &mut raw).unwrap();
    assert!(raw.iter().all(|&b| b == 0));
}

#[test]
fn too_little_device_memory_is_refused_at_build() {
    let cfg = PoolConfig::new(geometry(), 4, 8);
    let need = cfg.storage_bytes().unwrap();
    let e = KvPool::with_device_pages(cfg, Box::new(StagedHostPages::new(need - 1))).unwrap_err();
    assert!(e.to_string().contains("needs"), "{e}");
    // A device that cannot even be scrubbed is refused too, as unavailable.
    let dead = StagedHostPages::new(need);
    dead.fail_after(0);
    let e = KvPool::with_device_pages(cfg, Box::new(dead)).unwrap_err();
    assert_eq!(e.http_status(), 503, "{e}");
}

#[test]
fn released_pages_are_scrubbed_on_the_device_per_the_policy() {
    for policy in [ScrubPolicy::Zero, ScrubPolicy::Poison] {
        let (pool, _dev) = device_pool(PoolConfig::new(geometry(), 4, 4).scrub(policy));
        let mut seq = pool.reserve(RequestId(7), 6).unwrap();
        for layer in 0..2 {
            seq.append(layer, &rows(7, 6, 0), &rows(7, 6, 1)).unwrap();
        }
        let pages: Vec<u32> = seq.pages().iter().map(|p| p.index()).collect();
        drop(seq);
        assert!(pool.stats().is_full());
        for page in pages {
            assert!(
                pool.audit_page_matches_scrub(page),
                "{policy:?}: page {page}"
            );
        }
    }
}

#[test]
fn a_device_that_fails_mid_append_fails_closed() {
    let (pool, dev) = device_pool(PoolConfig::new(geometry(), 4, 8));
    let mut a = pool.reserve(RequestId(1), 8).unwrap();
    a.append(0, &rows(1, 3, 0), &rows(1, 3, 1)).unwrap();
    dev.fail_after(0);
    let e = a.append(0, &rows(1, 2, 0), &rows(1, 2, 1)).unwrap_err();
    assert!(matches!(e, KvError::Device(_)), "{e}");
    assert_eq!(e.http_status(), 503);
    assert_eq!(a.written(0), 3, "a failed write counts nothing written");
    // No page goes out after a device failure, however many are free.
    let e = pool.reserve(RequestId(2), 4).unwrap_err();
    assert!(matches!(e, KvError::Device(_)), "{e}");
    drop(a);
    let s = pool.stats();
    assert!(s.balanced() && s.is_full(), "{s:?}");
    assert!(pool.reserve(RequestId(3), 1).is_err(), "still refused");
}

#[test]
fn a_scrub_that_fails_keeps_every_page_from_being_reused() {
    let (pool, dev) = device_pool(PoolConfig::new(geometry(), 4, 8));
    let mut a = pool.reserve(RequestId(1), 4).unwrap();
    for layer in 0..2 {
        a.append(layer, &rows(1, 4, 0), &rows(1, 4, 1)).unwrap();
    }
    // The release's scrub is the access that fails.
    dev.fail_after(0);
    drop(a);
    assert!(pool.stats().is_full(), "the accounting is whole");
    let e = pool.reserve(RequestId(2), 4).unwrap_err();
    assert!(matches!(e, KvError::Device(_)), "{e}");
}

#[test]
fn a_worker_refuses_a_pool_whose_pages_live_where_its_backend_does_not_compute() {
    let mc = ModelConfig::tiny_gqa();
    let model = Model::cpu(random_weights(&mc, 3)).unwrap();
    let cfg = EngineConfigBuilder::<Decode>::new(mc.kv_geometry(KvDtype::F32))
        .max_context(64)
        .pool_tokens(128)
        .build()
        .unwrap();
    let pc = cfg.pool_config();
    let pool = KvPool::with_device_pages(
        pc,
        Box::new(StagedHostPages::new(pc.storage_bytes().unwrap())),
    )
    .unwrap();
    let (_p, d) = InProcess.connect(&TransferConfig::default()).unwrap();
    let e = DecodeWorker::with_pool(d, model, cfg, pool.clone(), TransferConfig::default())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::PoolResidence {
                pool: Residence::Device
            }
        ),
        "{e}"
    );
    assert!(pool.stats().is_full());
}

#[test]
fn staged_device_pages_keep_every_rule_of_a_pool() {
    crate::support::device_pages::device_pages_keep_every_rule(&|cfg: PoolConfig| {
        let bytes = cfg.storage_bytes().unwrap();
        KvPool::with_device_pages(cfg, Box::new(StagedHostPages::new(bytes))).unwrap()
    });
}

/// Where the K (`kv == 0`) or V row of (`page`, `layer`, `slot`) lies in a
/// pool's page bytes (the documented layout `[page][layer][k|v][slot][kv_dim]`).
fn row_offset(
    g: KvGeometry,
    page_size: usize,
    page: u32,
    layer: usize,
    kv: usize,
    slot: u32,
) -> usize {
    let row = g.kv_dim() * g.dtype.size_bytes();
    let page_bytes = g.n_layers * 2 * page_size * row;
    page as usize * page_bytes + ((layer * 2 + kv) * page_size + slot as usize) * row
}

#[test]
fn rows_a_kernel_writes_on_the_device_count_only_once_committed() {
    let g = geometry();
    let (pool, dev) = device_pool(PoolConfig::new(g, 4, 8));
    let mut seq = pool.reserve(RequestId(5), 6).unwrap();
    // The "kernel": writes bf16 rows where the slots say.
    let kernel = |slots: &[(u32, u32)], first: usize| {
        for (i, &(page, slot)) in slots.iter().enumerate() {
            for kv in 0..2 {
                let vals: Vec<u8> = rows(5, 1, kv)
                    .iter()
                    .map(|x| half::bf16::from_f32(x + (first + i) as f32))
                    .flat_map(|b| b.to_le_bytes())
                    .collect();
                dev.write(row_offset(g, 4, page, 0, kv, slot), &vals)
                    .unwrap();
            }
        }
    };
    let (p0, p1) = (seq.pages()[0].index(), seq.pages()[1].index());
    let app = seq.device_append(0, 3).unwrap();
    let slots = app.slots().to_vec();
    assert_eq!(slots, vec![(p0, 0), (p0, 1), (p0, 2)]);
    kernel(&slots, 0);
    app.commit();
    assert_eq!(seq.written(0), 3);
    // A launch that failed: dropped uncommitted, nothing counts.
    let app = seq.device_append(0, 2).unwrap();
    let slots = app.slots().to_vec();
    assert_eq!(slots[0], (p0, 3), "continues after the written rows");
    assert_eq!(slots[1], (p1, 0), "and crosses into the next page");
    drop(app);
    assert_eq!(seq.written(0), 3);
    // Past the reservation (two pages: 8 slots) is refused before any slot is given.
    assert!(matches!(
        seq.device_append(0, 6),
        Err(KvError::BeyondReservation { .. })
    ));
    let app = seq.device_append(0, 3).unwrap();
    let slots = app.slots().to_vec();
    kernel(&slots, 3);
    app.commit();
    let reader = pool.reader();
    let lv = reader.seq(&seq).unwrap().layer(0).unwrap();
    assert_eq!(lv.len(), 6);
    let mut buf = [0f32; 4];
    for pos in 0..6 {
        lv.copy_key_f32(pos, &mut buf).unwrap();
        let want: Vec<f32> = rows(5, 1, 0)
            .iter()
            .map(|x| half::bf16::from_f32(x + pos as f32).to_f32())
            .collect();
        assert_eq!(buf.to_vec(), want, "pos {pos}");
    }
    drop(seq);
    assert!(pool.stats().is_full());
    // A host pool writes its own bytes: no kernel may.
    let host = KvPool::new(PoolConfig::new(g, 4, 8)).unwrap();
    let mut s = host.reserve(RequestId(6), 4).unwrap();
    assert!(matches!(
        s.device_append(0, 1).map(|_| ()),
        Err(KvError::NotDeviceResident)
    ));
}

#[test]
fn the_cpu_backend_refuses_attention_over_device_pages_instead_of_computing_on_nothing() {
    let mc = ModelConfig::tiny_gqa();
    let model = Model::cpu(random_weights(&mc, 3)).unwrap();
    let cfg = PoolConfig::new(mc.kv_geometry(KvDtype::F32), 8, 8);
    let pool = KvPool::with_device_pages(
        cfg,
        Box::new(StagedHostPages::new(cfg.storage_bytes().unwrap())),
    )
    .unwrap();
    let mut seq = pool.reserve(RequestId(1), 8).unwrap();
    let mut scratch = model.scratch();
    let e = model
        .prefill(&mut scratch, &mut [&mut seq], &[&[1, 2, 3]])
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("device memory"), "{e}");
    drop(seq);
    assert!(pool.stats().is_full());
}
