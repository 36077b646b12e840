//! Prefill and decode pools in one process, both with their pages in
//! device memory on devices that reach each other: a prompt's KV lands
//! device to device, one copy pass per write batch, and neither device is
//! written from, nor read back to, the host for it (both ends' checksums
//! are hashed on their devices). The request verifies and the pages
//! hold what prefill computed. A write the fault plan corrupts still passes
//! through the host, where the bit flips, and is caught; a device copy that
//! fails fails that request closed, and both pools refuse further pages.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use handoff::kv::{DeviceError, DevicePages, StagedHostPages};
use handoff::transfer::{
    DecodeSide, Fault, FaultPlan, FaultRule, InProcess, IntegrityError, PrefillSide, Step,
    Transfer, TransferConfig, TransferError, synthetic,
};
use handoff::{AdmissionLimits, HttpStatus, KvDtype, KvPool, PoolConfig, RequestId};

use crate::support::{self, Rig, request};

/// Staged device pages shared with the test (for its counters), whose
/// device-to-device copies the test can make fail. They reach any other
/// such pages, as two pools on one GPU do.
struct Device {
    pages: Arc<StagedHostPages>,
    fail_copies: Arc<AtomicBool>,
}

impl DevicePages for Device {
    fn len(&self) -> usize {
        self.pages.len()
    }
    fn write(&self, at: usize, src: &[u8]) -> Result<(), DeviceError> {
        self.pages.write(at, src)
    }
    fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.pages.read(at, dst)
    }
    fn fill(&self, at: usize, len: usize, element: &[u8]) -> Result<(), DeviceError> {
        self.pages.fill(at, len, element)
    }
    fn xxh3_ranges(&self, ranges: &[(usize, usize)]) -> Option<Result<Vec<u64>, DeviceError>> {
        self.pages.xxh3_ranges(ranges)
    }
    fn copy_from(
        &self,
        src: &dyn DevicePages,
        runs: &[(usize, usize, usize)],
    ) -> Option<Result<(), DeviceError>> {
        if self.fail_copies.load(Ordering::SeqCst) {
            return Some(Err(DeviceError {
                device: self.device_name(),
                what: format!("device copy of {} runs", runs.len()),
                reason: "device lost (injected)".into(),
            }));
        }
        self.pages.copy_from(src, runs)
    }
    fn device_name(&self) -> String {
        self.pages.device_name()
    }
    // The staged pages themselves, so that another pool's copy reaches them.
    fn as_any(&self) -> &dyn std::any::Any {
        self.pages.as_ref()
    }
}

struct Pools {
    rig: Rig<InProcess>,
    prefill_dev: Arc<StagedHostPages>,
    decode_dev: Arc<StagedHostPages>,
    fail_copies: Arc<AtomicBool>,
}

/// Prefill pages of 16 tokens, decode pages of 8 (a batch's runs cross
/// page boundaries on both sides), both on staged devices, audit off on
/// decode (as in production: nothing else reads landed rows back).
fn pools(cfg: TransferConfig) -> Pools {
    let g = support::geometry(KvDtype::BF16);
    let (pl, dl) = InProcess.connect(&cfg).unwrap();
    let pcfg = PoolConfig::new(g, 16, 32);
    let dcfg = PoolConfig::new(g, 8, 64).audit(false);
    let prefill_dev = Arc::new(StagedHostPages::new(pcfg.storage_bytes().unwrap()));
    let decode_dev = Arc::new(StagedHostPages::new(dcfg.storage_bytes().unwrap()));
    let fail_copies = Arc::new(AtomicBool::new(false));
    let device = |pages: &Arc<StagedHostPages>| {
        Box::new(Device {
            pages: pages.clone(),
            fail_copies: fail_copies.clone(),
        })
    };
    let prefill_pool = KvPool::with_device_pages(pcfg, device(&prefill_dev)).unwrap();
    let decode_pool = KvPool::with_device_pages(dcfg, device(&decode_dev)).unwrap();
    Pools {
        rig: Rig {
            prefill: PrefillSide::new(
                pl,
                prefill_pool.clone(),
                AdmissionLimits::new(256, 32, 16),
                cfg.clone(),
            ),
            decode: DecodeSide::new(
                dl,
                decode_pool.clone(),
                AdmissionLimits::new(256, 64, 8),
                cfg,
            ),
            prefill_pool,
            decode_pool,
        },
        prefill_dev,
        decode_dev,
        fail_copies,
    }
}

#[test]
fn kv_lands_device_to_device_and_never_touches_the_host() {
    // 4 KiB batches of K and V rows of 32 bytes: 64 tokens per batch and
    // layer, so the 100-token prompt takes two.
    let g = support::geometry(KvDtype::BF16);
    let batch = (4 << 10) / (2 * g.kv_dim() * g.dtype.size_bytes());
    assert_eq!(batch, 64);
    let cfg = TransferConfig::default().with_max_batch_bytes(4 << 10);
    let mut p = pools(cfg);
    for (id, len) in [(1u64, 100usize), (2, 7), (3, 64)] {
        let (w0, r0, c0) = (
            p.decode_dev.writes(),
            p.decode_dev.reads(),
            p.decode_dev.copy_passes(),
        );
        let _ = p.rig.decode.submit(request(id, 1, len)).unwrap();
        p.rig.serve_one().unwrap();
        let o = p.rig.outcomes(1).pop().unwrap();
        let v = o.result.unwrap_or_else(|e| panic!("request {id}: {e}"));
        assert_eq!(v.seq().complete_len(), Some(len));
        assert_eq!(p.decode_dev.writes(), w0, "no row written from the host");
        assert_eq!(p.decode_dev.reads(), r0, "no row read back");
        assert_eq!(
            p.decode_dev.copy_passes() - c0,
            len.div_ceil(batch) * g.n_layers,
            "one device copy pass per batch and layer"
        );
        assert_eq!(
            synthetic::check(&p.rig.decode_pool, v.seq(), RequestId(id)).unwrap(),
            Ok(()),
            "the pages hold what prefill computed"
        );
    }
    // Prefill's pages (16 tokens) hold whole destination pages (8): it
    // hashed each request's regions on its device, in one pass, too.
    assert_eq!(p.prefill_dev.reads(), 0, "prefill read no row back");
    assert_eq!(p.prefill_dev.hash_passes(), 3);
    p.rig.settle();
    p.rig.assert_clean();
}

#[test]
fn a_corrupted_write_passes_through_the_host_and_is_caught() {
    let faults = FaultPlan::new().with(FaultRule::at(Step::KvWriting, Fault::Corrupt).times(1));
    let mut p = pools(TransferConfig::default().with_faults(Arc::new(faults)));
    let _ = p.rig.decode.submit(request(1, 1, 40)).unwrap();
    let _ = p.rig.serve_one();
    let outcomes = p.rig.outcomes(1);
    assert_eq!(outcomes.len(), 1);
    match &outcomes[0].result {
        Err(TransferError::Integrity(IntegrityError::ChecksumMismatch { request, .. })) => {
            assert_eq!(*request, RequestId(1));
        }
        other => panic!("a corrupted write must fail its checksum, got {other:?}"),
    }
    assert!(p.decode_dev.writes() > 0, "the tampered batch was staged");
    drop(outcomes);
    p.rig.settle();
    p.rig.assert_clean();
}

#[test]
fn a_failed_device_copy_fails_that_request_closed_and_both_pools_refuse_pages() {
    let mut p = pools(TransferConfig::default());
    let _ = p.rig.decode.submit(request(1, 1, 40)).unwrap();
    let _ = p.rig.decode.poll(std::time::Duration::ZERO);
    p.fail_copies.store(true, Ordering::SeqCst);
    let _ = p.rig.serve_one();
    let outcomes = p.rig.outcomes(1);
    assert_eq!(outcomes.len(), 1);
    let Err(e) = &outcomes[0].result else {
        panic!("verified KV from a failed device copy");
    };
    assert!(e.http_status() >= 500, "{e}");
    drop(outcomes);
    p.fail_copies.store(false, Ordering::SeqCst);

    // Either device may be the one that failed: neither hands out pages.
    let _ = p.rig.decode.submit(request(2, 1, 8)).unwrap();
    let refused = p.rig.outcomes(1);
    assert_eq!(refused.len(), 1);
    let Err(e) = &refused[0].result else {
        panic!("decode pages after a failed device copy");
    };
    assert_eq!(e.http_status(), 503, "{e}");
    drop(refused);
    assert!(
        p.rig.prefill_pool.reserve(RequestId(9), 8).is_err(),
        "prefill pages after a failed device copy"
    );
    p.rig.settle();
    p.rig.assert_clean();
}
