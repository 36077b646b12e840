//! One story body for every device-resident page storage: the staged host
//! stand-in on every machine, CUDA memory where a GPU is present.

use handoff::kv::Residence;
use handoff::{KvDtype, KvError, KvGeometry, KvPool, PoolConfig, RequestId, ScrubPolicy};

/// Builds a device-resident pool of a configuration.
pub type MakePool<'a> = &'a dyn Fn(PoolConfig) -> KvPool;

/// Rows of request `r` from position `start`: distinct per (request,
/// position, K|V), and exact in bf16 (at most 8 significant bits, scaled
/// by a power of two per element).
pub fn rows(r: u64, start: usize, n: usize, kvd: usize, kv: usize) -> Vec<f32> {
    assert!(r < 7 && start + n <= 32);
    (start..start + n)
        .flat_map(|p| (0..kvd).map(move |e| (r * 32 + p as u64) as f32 * (1u32 << (e % 4)) as f32))
        .map(|x| if kv == 1 { -x } else { x })
        .collect()
}

/// Fresh memory scrubbed; interleaved sequences each read back exactly
/// their own rows through copies (none lent in place), across page
/// boundaries; released pages scrubbed or poisoned per the policy; the
/// accounting whole and full at the end.
pub fn device_pages_keep_every_rule(make: MakePool<'_>) {
    // Rows of 16 bytes or more (the CUDA arena's rule): 2 heads x 8 bf16.
    let g = KvGeometry {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 8,
        dtype: KvDtype::BF16,
    };
    let kvd = g.kv_dim();
    for policy in [ScrubPolicy::Zero, ScrubPolicy::Poison] {
        let pool = make(PoolConfig::new(g, 4, 16).scrub(policy));
        assert_eq!(pool.residence(), Residence::Device);
        for page in 0..pool.capacity() as u32 {
            assert!(pool.audit_page_matches_scrub(page), "fresh page {page}");
        }
        let mut seqs: Vec<_> = (1..=3u64)
            .map(|r| pool.reserve(RequestId(r), 13).unwrap())
            .collect();
        // Interleaved appends of uneven lengths, crossing pages.
        for chunk in [3usize, 1, 5, 4] {
            for seq in seqs.iter_mut() {
                let r = seq.owner().0;
                for layer in 0..2 {
                    let at = seq.written(layer);
                    seq.append(
                        layer,
                        &rows(r, at, chunk, kvd, 0),
                        &rows(r, at, chunk, kvd, 1),
                    )
                    .unwrap();
                }
            }
        }
        let reader = pool.reader();
        let mut buf = vec![0f32; kvd];
        for seq in &seqs {
            let r = seq.owner().0;
            let view = reader.seq(seq).unwrap();
            for layer in 0..2 {
                let lv = view.layer(layer).unwrap();
                assert_eq!(lv.len(), 13);
                for pos in 0..13 {
                    assert!(lv.key(pos).is_none(), "no row is lent in place");
                    lv.copy_key_f32(pos, &mut buf).unwrap();
                    assert_eq!(buf, rows(r, pos, 1, kvd, 0), "{r} layer {layer} pos {pos}");
                    lv.copy_value_f32(pos, &mut buf).unwrap();
                    assert_eq!(buf, rows(r, pos, 1, kvd, 1));
                }
                assert!(matches!(
                    lv.copy_key_f32(13, &mut buf),
                    Err(KvError::Incomplete { .. })
                ));
            }
        }
        let pages: Vec<u32> = seqs
            .iter()
            .flat_map(|s| s.pages().iter().map(|p| p.index()))
            .collect();
        drop(seqs);
        let s = pool.stats();
        assert!(s.balanced() && s.is_full(), "{s:?}");
        for page in pages {
            assert!(
                pool.audit_page_matches_scrub(page),
                "{policy:?}: page {page}"
            );
        }
    }
}

/// Staged device pages the test keeps a handle on (for their counters and
/// fault switches) while a pool owns them: every access forwards to the
/// shared [`StagedHostPages`], whose own `as_any` they answer with, so that
/// another pool's device-to-device copy reaches them. Hash passes and
/// device copies fail, typed, while their switch is on.
pub struct SharedStaged {
    pub pages: std::sync::Arc<handoff::kv::StagedHostPages>,
    pub fail_hash: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub fail_copies: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl SharedStaged {
    /// Fresh staged pages of `bytes` (hashing unless `hashing` is false),
    /// both switches off.
    pub fn new(bytes: usize, hashing: bool) -> Self {
        let pages = handoff::kv::StagedHostPages::new(bytes);
        SharedStaged {
            pages: std::sync::Arc::new(if hashing {
                pages
            } else {
                pages.without_hashing()
            }),
            fail_hash: Default::default(),
            fail_copies: Default::default(),
        }
    }

    /// Another handle on the same pages and switches (one goes to the pool).
    pub fn handle(&self) -> Self {
        SharedStaged {
            pages: self.pages.clone(),
            fail_hash: self.fail_hash.clone(),
            fail_copies: self.fail_copies.clone(),
        }
    }

    fn injected(&self, what: String) -> handoff::kv::DeviceError {
        use handoff::kv::DevicePages;
        handoff::kv::DeviceError {
            device: self.device_name(),
            what,
            reason: "device lost (injected)".into(),
        }
    }
}

impl handoff::kv::DevicePages for SharedStaged {
    fn len(&self) -> usize {
        self.pages.len()
    }
    fn write(&self, at: usize, src: &[u8]) -> Result<(), handoff::kv::DeviceError> {
        self.pages.write(at, src)
    }
    fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), handoff::kv::DeviceError> {
        self.pages.read(at, dst)
    }
    fn fill(&self, at: usize, len: usize, element: &[u8]) -> Result<(), handoff::kv::DeviceError> {
        self.pages.fill(at, len, element)
    }
    fn write_runs(
        &self,
        runs: &[(usize, usize)],
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<(), handoff::kv::DeviceError> {
        self.pages.write_runs(runs, fill)
    }
    fn read_runs(
        &self,
        runs: &[(usize, usize)],
        take: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), handoff::kv::DeviceError> {
        self.pages.read_runs(runs, take)
    }
    fn xxh3_ranges(
        &self,
        ranges: &[(usize, usize)],
    ) -> Option<Result<Vec<u64>, handoff::kv::DeviceError>> {
        use std::sync::atomic::Ordering;
        if !ranges.is_empty() && self.fail_hash.load(Ordering::SeqCst) {
            return Some(Err(
                self.injected(format!("hash of {} ranges", ranges.len()))
            ));
        }
        self.pages.xxh3_ranges(ranges)
    }
    fn copy_from(
        &self,
        src: &dyn handoff::kv::DevicePages,
        runs: &[(usize, usize, usize)],
    ) -> Option<Result<(), handoff::kv::DeviceError>> {
        use std::sync::atomic::Ordering;
        if self.fail_copies.load(Ordering::SeqCst) {
            return Some(Err(
                self.injected(format!("device copy of {} runs", runs.len()))
            ));
        }
        self.pages.copy_from(src, runs)
    }
    fn device_name(&self) -> String {
        self.pages.device_name()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self.pages.as_ref()
    }
}

/// Two pools on staged devices, joined by a transport: prefill pages of
/// 16 tokens, decode pages of 8 (a batch's runs cross page boundaries on
/// both sides), audit off on decode (as in production: nothing else reads
/// landed rows back).
pub struct DevicePools<T: handoff::transfer::Transfer> {
    pub rig: crate::support::Rig<T>,
    pub prefill_dev: SharedStaged,
    pub decode_dev: SharedStaged,
}

/// [`DevicePools`] over `t` with `cfg`.
pub fn device_pools<T: handoff::transfer::Transfer>(
    t: &T,
    cfg: handoff::transfer::TransferConfig,
) -> DevicePools<T> {
    use crate::support::{self, RigSpec};
    let g = support::geometry(KvDtype::BF16);
    let spec = RigSpec {
        decode_page: 8,
        decode_pages: 64,
        ..RigSpec::default()
    };
    let pcfg = PoolConfig::new(g, spec.prefill_page, spec.prefill_pages);
    let dcfg = PoolConfig::new(g, spec.decode_page, spec.decode_pages).audit(false);
    let prefill_dev = SharedStaged::new(pcfg.storage_bytes().unwrap(), true);
    let decode_dev = SharedStaged::new(dcfg.storage_bytes().unwrap(), true);
    let prefill_pool = KvPool::with_device_pages(pcfg, Box::new(prefill_dev.handle())).unwrap();
    let decode_pool = KvPool::with_device_pages(dcfg, Box::new(decode_dev.handle())).unwrap();
    DevicePools {
        rig: support::rig_over(t, cfg, prefill_pool, decode_pool, &spec),
        prefill_dev,
        decode_dev,
    }
}
