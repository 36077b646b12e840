//! The decode pool's pages live in device memory, and the device hashes
//! where the bytes are (on a GPU, the xxh3 kernel over the pool's arena).
//! The receipt's checksums are then recomputed on the device over the KV
//! that landed, in one pass per request, and not one landed row is copied
//! back to the host for it. A flipped bit in a write is still caught there,
//! and a device that fails its hash pass fails that request closed: no
//! verified KV, the pool refuses further pages, accounting whole.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use handoff::transfer::{
    Fault, FaultPlan, FaultRule, InProcess, IntegrityError, Step, TransferConfig, TransferError,
    synthetic,
};
use handoff::{HttpStatus, KvDtype, KvPool, PoolConfig, RequestId};

use crate::support::device_pages::SharedStaged;
use crate::support::{self, Rig, RigSpec, request};

/// An in-process rig whose decode pool (audit trail off, as in production,
/// so that nothing else reads landed rows back) lives on `dev`.
fn rig(dev: &SharedStaged, cfg: TransferConfig) -> Rig<InProcess> {
    let g = support::geometry(KvDtype::BF16);
    let prefill_pool = KvPool::new(PoolConfig::new(g, 16, 32)).unwrap();
    let dcfg = PoolConfig::new(g, 16, 32).audit(false);
    let decode_pool = KvPool::with_device_pages(dcfg, Box::new(dev.handle())).unwrap();
    support::rig_over(
        &InProcess,
        cfg,
        prefill_pool,
        decode_pool,
        &RigSpec::default(),
    )
}

fn device(hashing: bool) -> SharedStaged {
    let g = support::geometry(KvDtype::BF16);
    SharedStaged::new(PoolConfig::new(g, 16, 32).storage_bytes().unwrap(), hashing)
}

/// Serves prompts of `lens` tokens one after another on `dev`; returns the
/// device's (reads, hash passes) taken by landing and verifying them, and
/// checks every verified sequence's bytes afterwards.
fn serve(dev: &SharedStaged, lens: &[usize]) -> (usize, usize) {
    let mut rig = rig(dev, TransferConfig::default());
    let pages = &dev.pages;
    let (reads0, passes0) = (pages.reads(), pages.hash_passes());
    let mut verified = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let id = i as u64 + 1;
        let _ = rig.decode.submit(request(id, 1, len)).unwrap();
        rig.serve_one().unwrap();
        let o = rig.outcomes(1).pop().unwrap();
        let v = o.result.unwrap_or_else(|e| panic!("request {id}: {e}"));
        assert_eq!(v.seq().complete_len(), Some(len));
        verified.push((o.request, v));
    }
    let taken = (pages.reads() - reads0, pages.hash_passes() - passes0);
    for (id, v) in &verified {
        assert_eq!(
            synthetic::check(&rig.decode_pool, v.seq(), *id).unwrap(),
            Ok(()),
            "{id}: the pages hold what prefill computed"
        );
    }
    drop(verified);
    rig.settle();
    rig.assert_clean();
    taken
}

#[test]
fn landed_kv_is_hashed_on_the_device_in_one_pass_per_request_and_never_read_back() {
    let lens = [40, 1, 17, 64];
    let (reads, passes) = serve(&device(true), &lens);
    assert_eq!(reads, 0, "no landed row came back to the host");
    assert_eq!(passes, lens.len(), "one hash pass per verified request");

    // A device that cannot hash: the same requests verify, by reading every
    // landed run back (what the device hash saves).
    let (reads, passes) = serve(&device(false), &lens);
    assert!(reads > 0, "the host hashed copies of the landed rows");
    assert_eq!(passes, 0);
}

#[test]
fn a_flipped_bit_in_a_write_is_caught_by_the_device_hash() {
    let faults = FaultPlan::new().with(FaultRule::at(Step::KvWriting, Fault::Corrupt).times(1));
    let cfg = TransferConfig::default().with_faults(Arc::new(faults));
    let dev = device(true);
    let mut rig = rig(&dev, cfg);
    let _ = rig.decode.submit(request(1, 1, 40)).unwrap();
    let _ = rig.serve_one();
    let outcomes = rig.outcomes(1);
    assert_eq!(outcomes.len(), 1);
    match &outcomes[0].result {
        Err(TransferError::Integrity(IntegrityError::ChecksumMismatch { request, .. })) => {
            assert_eq!(*request, RequestId(1));
        }
        other => panic!("a corrupted write must fail its checksum, got {other:?}"),
    }
    assert_eq!(dev.pages.hash_passes(), 1, "caught by the device's pass");
    assert_eq!(dev.pages.reads(), 0);
    drop(outcomes);
    rig.settle();
    rig.assert_clean();
}

#[test]
fn a_device_that_fails_its_hash_pass_fails_that_request_closed() {
    let dev = device(true);
    dev.fail_hash.store(true, Ordering::SeqCst);
    let mut rig = rig(&dev, TransferConfig::default());
    let _ = rig.decode.submit(request(1, 1, 40)).unwrap();
    let _ = rig.serve_one();
    let outcomes = rig.outcomes(1);
    assert_eq!(outcomes.len(), 1);
    let Err(e) = &outcomes[0].result else {
        panic!("verified KV whose checksums were never computed");
    };
    assert!(e.http_status() >= 500, "{e}");
    assert!(e.to_string().contains("device"), "{e}");
    drop(outcomes);

    // The pool admits nothing more (the device failed), typed, 503.
    dev.fail_hash.store(false, Ordering::SeqCst);
    let _ = rig.decode.submit(request(2, 1, 8)).unwrap();
    let refused = rig.outcomes(1);
    assert_eq!(refused.len(), 1);
    let Err(e) = &refused[0].result else {
        panic!("pages from a failed device");
    };
    assert_eq!(e.http_status(), 503, "{e}");
    drop(refused);
    rig.settle();
    rig.assert_clean();
}
