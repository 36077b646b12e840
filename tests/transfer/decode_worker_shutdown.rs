//! A host drains a decode worker for a deploy: it calls
//! `DecodeWorker::shutdown` while one request is generating and others are
//! still transferring their KV. Before, the transferring ones ended as
//! "the peer disconnected ...; reconnect" (502): the host's own shutdown
//! blamed on a healthy prefill worker, and a load balancer reading 502
//! marks the upstream bad instead of retrying the request elsewhere. The
//! colocated engine turns away what never generated (`ShuttingDown`, 503)
//! and fails what did (`Shutdown`, 503); the decode worker now does the
//! same, and every page on both sides is back.

use crate::support;

use handoff::{Decode, DecodeWorker, Prefill, PrefillWorker, RoleKind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use handoff::model::Model;
use handoff::transfer::{InProcess, Transfer, TransferConfig};
use handoff::{
    EngineConfig, EngineError, HttpStatus, Outcome, Rejection, Request, RequestId, TenantId,
};

fn model() -> Model {
    support::tiny_model(4)
}

fn cfg<R: RoleKind>(pool: usize) -> EngineConfig<R> {
    support::tiny_worker_config::<R>(pool)
}

#[test]
fn shutting_decode_down_turns_away_transfers_and_fails_only_what_generated() {
    let t = TransferConfig::default();
    let (p, d) = InProcess.connect(&t).unwrap();
    let mut prefill = PrefillWorker::new(p, model(), cfg::<Prefill>(128), t.clone()).unwrap();
    let mut decode = DecodeWorker::new(d, model(), cfg::<Decode>(256), t).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let prefill_thread = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let _ = prefill.run(&stop);
            prefill.shutdown();
            prefill
        })
    };

    // One request generating: step until its first token has streamed.
    let generating = decode
        .submit(Request::new(RequestId(1), TenantId(1), vec![3; 20], 40))
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while generating.events().is_empty() {
        assert!(Instant::now() < until, "no token within 30 s");
        decode.step();
    }
    // Two more admitted and planned, never landed: decode is not stepped
    // again before the shutdown.
    let transferring: Vec<_> = (2..4)
        .map(|i| {
            decode
                .submit(Request::new(RequestId(i), TenantId(1), vec![5; 30], 8))
                .unwrap()
        })
        .collect();

    decode.shutdown();

    let (tokens, outcome) = generating.try_collect();
    assert!(!tokens.is_empty());
    assert_eq!(outcome, Some(Outcome::Failed(EngineError::Shutdown)));
    for h in transferring {
        let id = h.id();
        let (tokens, outcome) = h.try_collect();
        assert!(tokens.is_empty());
        let Some(Outcome::Rejected(r)) = outcome else {
            panic!("{id}: expected a ShuttingDown rejection, got {outcome:?}");
        };
        assert_eq!(r, Rejection::ShuttingDown { id });
        assert_eq!(r.http_status(), 503);
    }
    let later = decode.submit(Request::new(RequestId(9), TenantId(1), vec![1], 1));
    assert!(matches!(later, Err(Rejection::ShuttingDown { .. })));
    assert_eq!(decode.tally().rejected, 3);
    assert_eq!(decode.tally().failed, 1);
    assert!(decode.pool().stats().is_full());

    stop.store(true, Ordering::Release);
    let prefill = prefill_thread.join().unwrap();
    let s = prefill.pool().stats();
    assert!(s.is_full(), "{s:?}");
    assert_eq!(s.isolation_violations, 0);
}
