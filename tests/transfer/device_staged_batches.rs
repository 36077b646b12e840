//! Prefill and decode pools both keep their pages in device memory, on
//! devices that cannot reach each other, so KV crosses through the host
//! (over TCP, as between two machines). The prefill end reads each batch's
//! rows back in one staged pass per layer and K|V, and the decode end lands
//! each batch in one staged pass per layer, not one wait for the device per
//! page run; on a GPU the staging memory is page-locked, so those passes
//! are DMA that queue without waiting. The request verifies and the pages
//! hold what prefill computed; a device that dies between a request's
//! passes fails that request closed.

use handoff::transfer::{Tcp, TransferConfig, synthetic};
use handoff::{HttpStatus, KvDtype, RequestId};

use crate::support::device_pages::{DevicePools, device_pools};
use crate::support::{self, request};

/// Both pools on staged devices, over TCP (which never copies device to
/// device).
fn pools(cfg: TransferConfig) -> DevicePools<Tcp> {
    device_pools(&Tcp, cfg)
}

#[test]
fn each_batch_crosses_the_host_in_one_staged_pass_per_layer() {
    // 4 KiB batches of K and V rows of 32 bytes: 64 tokens per batch and
    // layer, so the 100-token prompt takes two.
    let g = support::geometry(KvDtype::BF16);
    let batch = (4 << 10) / (2 * g.kv_dim() * g.dtype.size_bytes());
    assert_eq!(batch, 64);
    let mut p = pools(TransferConfig::default().with_max_batch_bytes(4 << 10));
    for (id, len) in [(1u64, 100usize), (2, 7), (3, 64)] {
        let (dev_w, dev_wp) = (
            p.decode_dev.pages.writes(),
            p.decode_dev.pages.write_passes(),
        );
        let (src_r, src_rp) = (
            p.prefill_dev.pages.reads(),
            p.prefill_dev.pages.read_passes(),
        );
        let _ = p.rig.decode.submit(request(id, 1, len)).unwrap();
        p.rig.serve_one().unwrap();
        let o = p.rig.outcomes(1).pop().unwrap();
        let v = o.result.unwrap_or_else(|e| panic!("request {id}: {e}"));
        assert_eq!(v.seq().complete_len(), Some(len));
        assert_eq!(
            synthetic::check(&p.rig.decode_pool, v.seq(), RequestId(id)).unwrap(),
            Ok(()),
            "the pages hold what prefill computed"
        );

        let batches = len.div_ceil(batch) * g.n_layers;
        // Page runs per batch and layer: a batch starting at token `s` of
        // `n` tokens touches pages of `ps` tokens from s / ps to (s+n-1) / ps.
        let page_runs = |ps: usize| -> usize {
            (0..len)
                .step_by(batch)
                .map(|s| {
                    let n = batch.min(len - s);
                    (s + n - 1) / ps - s / ps + 1
                })
                .sum::<usize>()
                * g.n_layers
        };
        assert_eq!(
            p.decode_dev.pages.write_passes() - dev_wp,
            batches,
            "one write pass per batch and layer"
        );
        assert_eq!(
            p.decode_dev.pages.writes() - dev_w,
            2 * page_runs(8),
            "every K and V run of every destination page, written in those passes"
        );
        assert_eq!(
            p.prefill_dev.pages.read_passes() - src_rp,
            2 * batches,
            "one read pass per batch, layer and K|V"
        );
        assert_eq!(
            p.prefill_dev.pages.reads() - src_r,
            2 * page_runs(16),
            "every K and V run of every source page, read in those passes"
        );
    }
    p.rig.settle();
    p.rig.assert_clean();
}

#[test]
fn a_device_lost_between_landing_passes_fails_that_request_closed() {
    let mut p = pools(TransferConfig::default());
    // The decode device lands layer 0's pass, then dies: layer 1's pass
    // (of 3 layers) fails with the request's KV half landed.
    let passes = p.decode_dev.pages.write_passes();
    p.decode_dev.pages.fail_after(1);
    let _ = p.rig.decode.submit(request(1, 1, 40)).unwrap();
    let _ = p.rig.serve_one();
    let outcomes = p.rig.outcomes(1);
    assert_eq!(outcomes.len(), 1);
    let Err(e) = &outcomes[0].result else {
        panic!("verified KV from a device that failed its write pass");
    };
    assert!(e.http_status() >= 500, "{e}");
    assert!(e.to_string().contains("device"), "{e}");
    assert_eq!(
        p.decode_dev.pages.write_passes() - passes,
        1,
        "one pass landed before the device was lost"
    );
    drop(outcomes);
    p.rig.settle();
    p.rig.assert_clean();
}
