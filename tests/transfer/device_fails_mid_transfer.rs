//! The decode pool's pages live in device memory and the device dies while
//! a prompt's KV is landing. The landing writes fail, so the request fails
//! with a typed error and no verified KV (nothing to decode from); prefill
//! lets go of its held source pages; both pools' accounting returns to
//! full; and the dead device's pool admits nothing more, since a page whose
//! scrub may not have landed must never be handed out again.

use std::sync::Arc;
use std::time::Duration;

use handoff::kv::{DeviceError, DevicePages, StagedHostPages};
use handoff::transfer::{DecodeSide, InProcess, PrefillSide, Transfer, TransferConfig};
use handoff::{AdmissionLimits, HttpStatus, KvDtype, KvPool, PoolConfig};

use crate::support::{self, Rig, request};

/// A device the test can kill while the pool uses it.
struct Killable(Arc<StagedHostPages>);

impl DevicePages for Killable {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn write(&self, at: usize, src: &[u8]) -> Result<(), DeviceError> {
        self.0.write(at, src)
    }
    fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.0.read(at, dst)
    }
    fn fill(&self, at: usize, len: usize, element: &[u8]) -> Result<(), DeviceError> {
        self.0.fill(at, len, element)
    }
    fn device_name(&self) -> String {
        self.0.device_name()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[test]
fn a_device_lost_while_kv_lands_fails_that_request_and_nothing_else_is_lost() {
    let g = support::geometry(KvDtype::BF16);
    let cfg = TransferConfig::default();
    let (pl, dl) = InProcess.connect(&cfg).unwrap();
    let prefill_pool = KvPool::new(PoolConfig::new(g, 16, 32)).unwrap();
    let dcfg = PoolConfig::new(g, 16, 32);
    let dev = Arc::new(StagedHostPages::new(dcfg.storage_bytes().unwrap()));
    let decode_pool = KvPool::with_device_pages(dcfg, Box::new(Killable(dev.clone()))).unwrap();
    let mut rig: Rig<InProcess> = Rig {
        prefill: PrefillSide::new(
            pl,
            prefill_pool.clone(),
            AdmissionLimits::new(256, 32, 16),
            cfg.clone(),
        ),
        decode: DecodeSide::new(
            dl,
            decode_pool.clone(),
            AdmissionLimits::new(256, 32, 16),
            cfg,
        ),
        prefill_pool,
        decode_pool,
    };

    // A first request lands whole: the device works.
    let _ = rig.decode.submit(request(1, 1, 40)).unwrap();
    rig.serve_one().unwrap();
    let first = rig.outcomes(1);
    assert!(
        first[0].result.is_ok(),
        "{:?}",
        first[0].result.as_ref().err()
    );
    drop(first);

    // The second one's pages are reserved, then the device dies before its
    // KV lands.
    let _ = rig.decode.submit(request(2, 1, 40)).unwrap();
    let _ = rig.decode.poll(Duration::ZERO);
    dev.fail_after(0);
    let _ = rig.serve_one();
    let outcomes = rig.outcomes(1);
    assert_eq!(outcomes.len(), 1);
    let Err(e) = &outcomes[0].result else {
        panic!("verified KV from a dead device");
    };
    assert!(e.http_status() >= 500, "{e}");
    drop(outcomes);

    // What comes next is refused, typed, before anything is sent: the
    // dead device's pool reserves no page.
    let _ = rig.decode.submit(request(3, 1, 8)).unwrap();
    let refused = rig.outcomes(1);
    assert_eq!(refused.len(), 1);
    let Err(e) = &refused[0].result else {
        panic!("pages from a dead device");
    };
    assert!(e.to_string().contains("device"), "{e}");
    assert_eq!(e.http_status(), 503, "{e}");
    drop(refused);
    rig.settle();
    rig.assert_clean();
}
