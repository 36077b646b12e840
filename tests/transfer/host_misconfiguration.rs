//! A host wires its workers wrongly: a configuration of another model's
//! geometry, a pool of another shape, a transfer config
//! whose limits cannot work. Before, both role mistakes read "a colocated
//! engine needs a Colocated configuration" (for the decode worker: "...,
//! got Colocated", which contradicts itself), and the host's own transfer
//! settings answered 502 Bad Gateway, blaming a peer that never spoke.
//! A receipt timeout of zero was accepted and then failed every transfer;
//! zero write, plan and ack timeouts too are refused when the link is made.
//! Each refusal must name the fix and count as a server fault (500).

use handoff::model::{Model, ModelConfig, random_weights};
use handoff::transfer::{InProcess, LinkError, Transfer, TransferConfig, TransferError};
use handoff::{Decode, DecodeWorker, EngineConfigBuilder, Prefill, PrefillWorker, RoleKind};
use handoff::{EngineConfig, EngineError, HttpStatus, KvDtype};

fn model() -> Model {
    Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 3)).unwrap()
}

fn cfg<R: RoleKind>() -> EngineConfig<R> {
    EngineConfigBuilder::<R>::new(ModelConfig::tiny_gqa().kv_geometry(KvDtype::F32))
        .max_context(64)
        .pool_tokens(256)
        .build()
        .unwrap()
}

// A worker handed another role's configuration (a Decode configuration to
// the prefill worker, a Colocated one to the decode worker) no longer
// compiles: the role is the configuration's type. The compile_fail examples
// in `handoff::config::role` hold each wrong pairing to that.

#[test]
fn the_hosts_own_transfer_settings_are_a_server_fault_not_a_bad_gateway() {
    let bad = TransferConfig::default().with_max_batch_bytes(0);
    let Err(e) = InProcess.connect(&bad) else {
        panic!("a link with max_batch_bytes 0 connected");
    };
    assert!(matches!(e, LinkError::Config { .. }), "{e}");
    assert_eq!(e.http_status(), 500);
    assert_eq!(TransferError::Link(e).http_status(), 500);

    // A receipt timeout of zero failed every transfer with a 504 that
    // blamed the peer; it is refused when the link is made.
    let never = TransferConfig::default().with_receipt_timeout(std::time::Duration::ZERO);
    let Err(e) = InProcess.connect(&never) else {
        panic!("a link whose every transfer must time out connected");
    };
    assert!(e.to_string().contains("receipt_timeout must be > 0"), "{e}");
    assert_eq!(e.http_status(), 500);
    // So are the other waits: a zero write timeout made a TCP socket refuse
    // it (an I/O error, 502, blaming the peer) and in-process senders give
    // up at once at the in-flight cap.
    let zero = std::time::Duration::ZERO;
    for (what, cfg) in [
        (
            "write_timeout",
            TransferConfig::default().with_write_timeout(zero),
        ),
        (
            "plan_timeout",
            TransferConfig::default().with_plan_timeout(zero),
        ),
        (
            "ack_timeout",
            TransferConfig::default().with_ack_timeout(zero),
        ),
    ] {
        for e in [
            InProcess.connect(&cfg).err(),
            handoff::transfer::Tcp.connect(&cfg).err(),
        ] {
            let e = e.unwrap_or_else(|| panic!("a link with a zero {what} connected"));
            assert!(matches!(e, LinkError::Config { .. }), "{what}: {e}");
            assert!(e.to_string().contains(what), "{e}");
            assert_eq!(e.http_status(), 500);
        }
    }

    let public = LinkError::NotLoopback {
        addr: "0.0.0.0:9000".into(),
    };
    assert_eq!(public.http_status(), 500);
    // A peer that went away is still the upstream's fault.
    assert_eq!(LinkError::Disconnected.http_status(), 502);
}

#[test]
fn workers_can_be_logged_and_their_refusals_unwrapped_like_any_result() {
    // A host keeps workers in its own `#[derive(Debug)]` structs and calls
    // `unwrap_err` in its checks: both need the workers to be `Debug`.
    let t = TransferConfig::default();
    let (p, d) = InProcess.connect(&t).unwrap();
    let mut other_geometry = ModelConfig::tiny_gqa().kv_geometry(KvDtype::F32);
    other_geometry.n_layers += 1;
    let other = EngineConfig::prefill(other_geometry)
        .max_context(64)
        .pool_tokens(256)
        .build()
        .unwrap();
    let e = PrefillWorker::new(p, model(), other, t.clone()).unwrap_err();
    assert!(matches!(e, EngineError::Geometry { .. }), "{e}");
    let decode = DecodeWorker::new(d, model(), cfg::<Decode>(), t).unwrap();
    let shown = format!("{decode:?}");
    assert!(shown.starts_with("DecodeWorker"), "{shown}");
    assert!(shown.contains("generating: 0"), "{shown}");
}

#[test]
fn an_infinite_headroom_is_not_called_below_one() {
    let e = handoff::Headroom::new(f64::INFINITY).unwrap_err();
    let msg = e.to_string();
    assert!(!msg.contains("below 1x"), "{msg}");
    assert!(msg.contains("Headroom::MIN"), "{msg}");
    assert!(handoff::Headroom::new(f64::NAN).is_err());
    assert!(handoff::Headroom::new(1.0).is_ok());
}

#[test]
fn a_host_chooses_its_workers_scrub_policy_in_the_configuration_and_keeps_their_pools() {
    use handoff::{Engine, KvPool, Outcome, Request, RequestId, ScrubPolicy, TenantId};
    use std::time::{Duration, Instant};
    fn poisoned_cfg<R: RoleKind>() -> EngineConfig<R> {
        EngineConfigBuilder::<R>::new(ModelConfig::tiny_gqa().kv_geometry(KvDtype::F32))
            .max_context(64)
            .pool_tokens(256)
            .scrub(ScrubPolicy::Poison)
            .build()
            .unwrap()
    }
    fn poisoned<R: RoleKind>() -> KvPool {
        KvPool::new(poisoned_cfg::<R>().pool_config()).unwrap()
    }
    let t = TransferConfig::default();
    let (ppool, dpool) = (poisoned::<Prefill>(), poisoned::<Decode>());
    let (p, d) = InProcess.connect(&t).unwrap();
    let mut prefill = PrefillWorker::with_pool(
        p,
        model(),
        poisoned_cfg::<Prefill>(),
        ppool.clone(),
        t.clone(),
    )
    .unwrap();
    let mut decode =
        DecodeWorker::with_pool(d, model(), poisoned_cfg::<Decode>(), dpool.clone(), t).unwrap();
    assert!(decode.pool().same_pool(&dpool) && prefill.pool().same_pool(&ppool));
    let req = Request::new(RequestId(1), TenantId(1), vec![5, 6, 7], 6);
    let h = decode.submit(req.clone()).unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while !decode.is_idle() && Instant::now() < until {
        prefill.step(Duration::from_millis(5)).unwrap();
        decode.step();
    }
    let (tokens, outcome) = h.wait_timeout(Duration::from_secs(1));
    assert!(matches!(outcome, Some(Outcome::Finished(_))), "{outcome:?}");
    let mut colocated = Engine::new(
        model(),
        EngineConfig::colocated(ModelConfig::tiny_gqa().kv_geometry(KvDtype::F32))
            .max_context(64)
            .pool_tokens(256)
            .build()
            .unwrap(),
    )
    .unwrap();
    let want = colocated.submit(req).unwrap();
    colocated.run_until_idle();
    assert_eq!(tokens, want.wait().0, "the same tokens as colocated");
    decode.shutdown();
    prefill.shutdown();
    for pool in [&ppool, &dpool] {
        assert_eq!(pool.config().scrub_policy(), ScrubPolicy::Poison);
        assert!(pool.stats().is_full());
    }

    // Another shape of pool, or one already in use, is refused.
    let (p, _d) = InProcess.connect(&TransferConfig::default()).unwrap();
    let small = KvPool::new(
        poisoned_cfg::<Prefill>()
            .pool_config()
            .audit(!cfg::<Prefill>().audit()),
    )
    .unwrap();
    let Err(e) = PrefillWorker::with_pool(
        p,
        model(),
        poisoned_cfg::<Prefill>(),
        small,
        TransferConfig::default(),
    ) else {
        panic!("a pool of another shape was accepted");
    };
    assert_eq!(e, EngineError::PoolMismatch);
    assert_eq!(e.http_status(), 500);
    // A pool whose scrub policy is not the configuration's is another pool:
    // the policy is set in one place.
    let (p, _d) = InProcess.connect(&TransferConfig::default()).unwrap();
    let Err(e) = PrefillWorker::with_pool(
        p,
        model(),
        cfg::<Prefill>(),
        poisoned::<Prefill>(),
        TransferConfig::default(),
    ) else {
        panic!("a pool with another scrub policy was accepted");
    };
    assert_eq!(e, EngineError::PoolMismatch);
    let (_p, d) = InProcess.connect(&TransferConfig::default()).unwrap();
    let busy = poisoned::<Decode>();
    let _someone_elses = busy.reserve(RequestId(9), 10).unwrap();
    let Err(e) = DecodeWorker::with_pool(
        d,
        model(),
        poisoned_cfg::<Decode>(),
        busy,
        TransferConfig::default(),
    ) else {
        panic!("a pool in use was accepted");
    };
    assert_eq!(e, EngineError::PoolInUse { in_use: 1, held: 0 });

    // One pool, two workers: the second is refused, though nothing is
    // reserved yet (each would admit against pages the other takes).
    let shared = poisoned::<Decode>();
    let (_p1, d1) = InProcess.connect(&TransferConfig::default()).unwrap();
    let (_p2, d2) = InProcess.connect(&TransferConfig::default()).unwrap();
    let _first = DecodeWorker::with_pool(
        d1,
        model(),
        poisoned_cfg::<Decode>(),
        shared.clone(),
        TransferConfig::default(),
    )
    .unwrap();
    let Err(e) = DecodeWorker::with_pool(
        d2,
        model(),
        poisoned_cfg::<Decode>(),
        shared,
        TransferConfig::default(),
    ) else {
        panic!("a second worker took a pool another worker serves");
    };
    assert_eq!(e, EngineError::PoolClaimed);
}
