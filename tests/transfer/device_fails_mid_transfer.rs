//! The decode pool's pages live in device memory and the device dies while
//! a prompt's KV is landing. The landing writes fail, so the request fails
//! with a typed error and no verified KV (nothing to decode from); prefill
//! lets go of its held source pages; both pools' accounting returns to
//! full; and the dead device's pool admits nothing more, since a page whose
//! scrub may not have landed must never be handed out again.

use std::time::Duration;

use handoff::transfer::{InProcess, TransferConfig};
use handoff::{HttpStatus, KvDtype, KvPool, PoolConfig};

use crate::support::device_pages::SharedStaged;
use crate::support::{self, Rig, RigSpec, request};

#[test]
fn a_device_lost_while_kv_lands_fails_that_request_and_nothing_else_is_lost() {
    let g = support::geometry(KvDtype::BF16);
    let prefill_pool = KvPool::new(PoolConfig::new(g, 16, 32)).unwrap();
    let dcfg = PoolConfig::new(g, 16, 32);
    // A device that cannot hash: landed rows come back to be checked.
    let dev = SharedStaged::new(dcfg.storage_bytes().unwrap(), false);
    let decode_pool = KvPool::with_device_pages(dcfg, Box::new(dev.handle())).unwrap();
    let mut rig: Rig<InProcess> = support::rig_over(
        &InProcess,
        TransferConfig::default(),
        prefill_pool,
        decode_pool,
        &RigSpec::default(),
    );

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
    dev.pages.fail_after(0);
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
