//! A host polls its request handles in a loop with `try_collect` and, as
//! hosts do, polls one again after it saw the outcome. Before, the second
//! poll found the stream closed and reported `Failed(Shutdown)` ("the
//! engine shut down before the request finished: resubmit it") for a
//! request that had finished: a host following the advice generated and
//! billed it twice. `wait` after `try_collect` did the same. The outcome a
//! handle has read is now its outcome for good.
//!
//! And a host that must not block a serving thread forever gets a bounded
//! wait: `wait` has no timeout, `wait_timeout` does.

use std::time::{Duration, Instant};

use handoff::model::{Model, ModelConfig, random_weights};
use handoff::{
    Engine, EngineConfig, FinishReason, KvDtype, Outcome, Request, RequestHandle, RequestId,
    TenantId,
};

fn engine() -> Engine {
    let m = Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 6)).unwrap();
    let cfg = EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(64)
        .pool_tokens(256)
        .build()
        .unwrap();
    Engine::new(m, cfg).unwrap()
}

fn req(id: u64) -> Request {
    Request::new(RequestId(id), TenantId(1), vec![1, 2, 3], 5)
}

#[test]
fn a_finished_request_polled_again_is_still_finished() {
    let mut e = engine();
    let h = e.submit(req(1)).unwrap();
    e.run_until_idle();
    let done = Some(Outcome::Finished(FinishReason::Length));

    let (tokens, first) = h.try_collect();
    assert_eq!(tokens.len(), 5);
    assert_eq!(first, done);
    for _ in 0..3 {
        assert_eq!(h.try_collect(), (vec![], done.clone()));
    }
    assert_eq!(h.wait_timeout(Duration::ZERO), (vec![], done.clone()));
    let (tokens, last) = h.wait();
    assert!(tokens.is_empty());
    assert_eq!(Some(last), done);
    assert!(e.pool_stats().is_full());
}

#[test]
fn a_cancelled_request_stays_cancelled() {
    let mut e = engine();
    let h = e.submit(req(2)).unwrap();
    h.cancel();
    e.step();
    assert_eq!(h.try_collect(), (vec![], Some(Outcome::Cancelled)));
    assert_eq!(h.try_collect(), (vec![], Some(Outcome::Cancelled)));
    assert!(e.pool_stats().is_full());
}

#[test]
fn wait_timeout_returns_while_the_engine_is_not_stepped_then_collects_the_rest() {
    let mut e = engine();
    let h: RequestHandle = e.submit(req(3)).unwrap();

    // Nobody steps the engine: `wait` would block forever here.
    let start = Instant::now();
    assert_eq!(h.wait_timeout(Duration::from_millis(50)), (vec![], None));
    assert!(start.elapsed() >= Duration::from_millis(50));
    assert!(start.elapsed() < Duration::from_secs(10));

    e.step(); // prefill + first token
    let (first, outcome) = h.wait_timeout(Duration::from_millis(10));
    assert_eq!((first.len(), outcome), (1, None));

    e.run_until_idle();
    // A timeout too large for the clock waits without a deadline, no panic.
    let (rest, outcome) = h.wait_timeout(Duration::MAX);
    assert_eq!(rest.len(), 4);
    assert_eq!(outcome, Some(Outcome::Finished(FinishReason::Length)));
    assert!(e.pool_stats().is_full());
}
