//! Prefill and decode pools in one process, both with their pages in
//! device memory on devices that reach each other: a prompt's KV lands
//! device to device, one copy pass per write batch, and neither device is
//! written from, nor read back to, the host for it (both ends' checksums
//! are hashed on their devices). The request verifies and the pages
//! hold what prefill computed. A write the fault plan corrupts still passes
//! through the host, where the bit flips, and is caught; a device copy that
//! fails fails that request closed, and both pools refuse further pages. A
//! prefill device whose hash pass fails aborts the request with its own
//! error: decode hears that the compute failed, not of a checksum that
//! cannot match.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use handoff::transfer::{
    AbortReason, Fault, FaultPlan, FaultRule, InProcess, IntegrityError, Step, TransferConfig,
    TransferError, synthetic,
};
use handoff::{HttpStatus, KvDtype, RequestId};

use crate::support::device_pages::{DevicePools, device_pools};
use crate::support::{self, request};

/// Both pools on staged devices that reach each other (one process).
fn pools(cfg: TransferConfig) -> DevicePools<InProcess> {
    device_pools(&InProcess, cfg)
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
            p.decode_dev.pages.writes(),
            p.decode_dev.pages.reads(),
            p.decode_dev.pages.copy_passes(),
        );
        let _ = p.rig.decode.submit(request(id, 1, len)).unwrap();
        p.rig.serve_one().unwrap();
        let o = p.rig.outcomes(1).pop().unwrap();
        let v = o.result.unwrap_or_else(|e| panic!("request {id}: {e}"));
        assert_eq!(v.seq().complete_len(), Some(len));
        assert_eq!(
            p.decode_dev.pages.writes(),
            w0,
            "no row written from the host"
        );
        assert_eq!(p.decode_dev.pages.reads(), r0, "no row read back");
        assert_eq!(
            p.decode_dev.pages.copy_passes() - c0,
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
    assert_eq!(p.prefill_dev.pages.reads(), 0, "prefill read no row back");
    assert_eq!(p.prefill_dev.pages.hash_passes(), 3);
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
    assert!(
        p.decode_dev.pages.writes() > 0,
        "the tampered batch was staged"
    );
    drop(outcomes);
    p.rig.settle();
    p.rig.assert_clean();
}

#[test]
fn a_failed_device_copy_fails_that_request_closed_and_both_pools_refuse_pages() {
    let mut p = pools(TransferConfig::default());
    let _ = p.rig.decode.submit(request(1, 1, 40)).unwrap();
    let _ = p.rig.decode.poll(std::time::Duration::ZERO);
    p.decode_dev.fail_copies.store(true, Ordering::SeqCst);
    let _ = p.rig.serve_one();
    let outcomes = p.rig.outcomes(1);
    assert_eq!(outcomes.len(), 1);
    let Err(e) = &outcomes[0].result else {
        panic!("verified KV from a failed device copy");
    };
    assert!(e.http_status() >= 500, "{e}");
    drop(outcomes);
    p.decode_dev.fail_copies.store(false, Ordering::SeqCst);

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

#[test]
fn a_failed_hash_on_the_prefill_device_aborts_with_its_error_not_a_checksum_mismatch() {
    let mut p = pools(TransferConfig::default());
    let _ = p.rig.decode.submit(request(1, 1, 40)).unwrap();
    let _ = p.rig.decode.poll(std::time::Duration::ZERO);
    p.prefill_dev.fail_hash.store(true, Ordering::SeqCst);
    match p.rig.serve_one() {
        Err(TransferError::Kv(e)) => {
            assert!(
                e.to_string().contains("hash of"),
                "the device's own error: {e}"
            );
            assert!(e.http_status() >= 500, "{e}");
        }
        other => panic!("prefill sent a receipt after its device failed: {other:?}"),
    }
    let outcomes = p.rig.outcomes(1);
    assert_eq!(outcomes.len(), 1);
    match &outcomes[0].result {
        Err(TransferError::Aborted {
            reason: AbortReason::ComputeFailed,
            ..
        }) => {}
        Err(e) => panic!("decode should hear of an aborted compute, got: {e}"),
        Ok(_) => panic!("verified KV whose source device failed"),
    }
    drop(outcomes);
    p.prefill_dev.fail_hash.store(false, Ordering::SeqCst);
    assert!(
        p.rig.prefill_pool.reserve(RequestId(9), 8).is_err(),
        "prefill pages after a failed device"
    );
    p.rig.settle();
    p.rig.assert_clean();
}
