//! Hundreds of clients disconnect at once (a load balancer restarts, a
//! front end times out a burst). The next step ends every one of them,
//! cancelled, whether it was generating, prefilling or still waiting, frees
//! their pages, and the requests that stayed go on to exactly the tokens
//! they would have had alone. The same holds when many requests finish in
//! one step: the running set is swept once, not shifted once per request.

use handoff::model::{Model, ModelConfig, random_weights};
use handoff::{
    BatchLimits, Engine, EngineConfig, EngineOptions, FinishReason, KvDtype, Outcome, Request,
    RequestHandle, RequestId, TenantId,
};

const REQUESTS: u64 = 300;

fn engine(max_running: usize) -> Engine {
    let m = Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 21)).unwrap();
    let cfg = EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(64)
        .page_size(8)
        .pool_tokens(64 * REQUESTS as usize)
        .build()
        .unwrap();
    let opts = EngineOptions {
        limits: BatchLimits {
            max_running,
            max_prefill_tokens: 4096,
        },
        ..EngineOptions::default()
    };
    Engine::with_options(m, cfg, opts).unwrap()
}

fn req(id: u64, new: usize) -> Request {
    let prompt = vec![1, (id % 200) as u32 + 2, (id % 7) as u32 + 3];
    Request::new(RequestId(id), TenantId(id as u32 % 5), prompt, new)
}

/// What each request generates when nobody cancels.
fn undisturbed(ids: impl Iterator<Item = u64>) -> Vec<Vec<u32>> {
    let mut e = engine(REQUESTS as usize);
    let hs: Vec<RequestHandle> = ids.map(|id| e.submit(req(id, 12)).unwrap()).collect();
    e.run_until_idle();
    hs.into_iter().map(|h| h.wait().0).collect()
}

#[test]
fn a_disconnect_storm_ends_every_cancelled_request_in_one_step() {
    // 250 run, the last 50 wait for a place: the storm hits both.
    let mut e = engine(250);
    let hs: Vec<RequestHandle> = (0..REQUESTS)
        .map(|id| e.submit(req(id, 12)).unwrap())
        .collect();
    for _ in 0..3 {
        e.step();
    }
    assert_eq!(e.running(), 250);
    // Two thirds of the clients go away together, runners and waiters.
    for h in hs.iter().filter(|h| h.id().0 % 3 != 0) {
        h.cancel();
    }
    let step = e.step();
    assert_eq!(step.cancelled, 200, "every cancel ends in the next step");
    let kept: Vec<&RequestHandle> = hs.iter().filter(|h| h.id().0 % 3 == 0).collect();
    assert_eq!(e.running(), kept.len(), "the 100 kept requests all run");
    e.run_until_idle();
    let want = undisturbed((0..REQUESTS).filter(|id| id % 3 == 0));
    let mut got = Vec::new();
    for h in hs {
        let keep = h.id().0 % 3 == 0;
        let (tokens, outcome) = h.wait();
        if keep {
            assert_eq!(outcome, Outcome::Finished(FinishReason::Length));
            got.push(tokens);
        } else {
            assert_eq!(outcome, Outcome::Cancelled);
        }
    }
    assert_eq!(got, want, "the kept requests' tokens are as if alone");
    assert!(e.pool_stats().is_full());
}

#[test]
fn requests_that_finish_in_the_same_step_all_end_and_free_their_pages() {
    let mut e = engine(REQUESTS as usize);
    // Every other request is half as long: two waves of ends in one step each.
    let hs: Vec<RequestHandle> = (0..REQUESTS)
        .map(|id| e.submit(req(id, if id % 2 == 0 { 6 } else { 12 })).unwrap())
        .collect();
    let mut ends = Vec::new();
    while !e.is_idle() {
        let t = e.step();
        if t.finished > 0 {
            ends.push(t.finished);
        }
    }
    assert_eq!(ends, vec![REQUESTS / 2, REQUESTS / 2]);
    for h in hs {
        let n = if h.id().0 % 2 == 0 { 6 } else { 12 };
        let (tokens, outcome) = h.wait();
        assert_eq!(
            (tokens.len(), outcome),
            (n, Outcome::Finished(FinishReason::Length))
        );
    }
    assert!(e.pool_stats().is_full());
}
