//! When the pool runs short, running sequences are preempted — their pages
//! released, their requests recomputed later — and nobody is ever handed
//! someone else's pages. The story: twelve requests whose combined growth
//! overflows a small pool. Every request still finishes, with exactly the
//! tokens it produces on an uncontended engine (greedy and seeded
//! sampling alike), the audit trail sees no cross-request read, and the pool
//! is full again afterwards.

use handoff::model::{Model, ModelConfig, ModelWeights, random_weights};
use handoff::{
    Engine, EngineConfig, FinishReason, KvDtype, Outcome, Request, RequestId, SamplingParams,
    Tally, TenantId,
};

fn engine(w: &ModelWeights, pool_tokens: usize) -> Engine {
    let model = Model::cpu(w.clone()).unwrap();
    let cfg = EngineConfig::colocated(model.kv_geometry(KvDtype::F16))
        .max_context(64)
        .page_size(4)
        .pool_tokens(pool_tokens)
        .build()
        .unwrap();
    Engine::new(model, cfg).unwrap()
}

fn request(i: u64) -> Request {
    let prompt: Vec<u32> = (0..20)
        .map(|j| ((i * 53 + j * 7 + 1) % 384) as u32)
        .collect();
    let r = Request::new(RequestId(i), TenantId(i as u32), prompt, 40);
    if i.is_multiple_of(2) {
        r
    } else {
        r.with_sampling(SamplingParams {
            temperature: 0.9,
            top_k: Some(40),
            top_p: Some(0.95),
            seed: 1000 + i,
            stop_ids: vec![],
            logprobs: None,
        })
    }
}

fn run(e: &mut Engine, reqs: Vec<Request>) -> (Vec<Vec<u32>>, Tally) {
    let handles: Vec<_> = reqs.into_iter().map(|r| e.submit(r).unwrap()).collect();
    let mut total = Tally::default();
    let mut steps = 0;
    while !e.is_idle() {
        let r = e.step();
        let s = e.pool_stats();
        assert!(s.balanced(), "accounting broke: {s:?}");
        total.preempted += r.preempted;
        total.finished += r.finished;
        steps += 1;
        assert!(steps < 10_000, "no progress");
    }
    let outs = handles
        .iter()
        .map(|h| {
            let (t, o) = h.try_collect();
            assert_eq!(o, Some(Outcome::Finished(FinishReason::Length)));
            t
        })
        .collect();
    (outs, total)
}

#[test]
fn a_pool_too_small_for_everyone_preempts_and_still_serves_everyone_exactly() {
    let w = random_weights(&ModelConfig::tiny_gqa(), 21);
    let mut roomy = engine(&w, 64 * 12);
    let alone: Vec<Vec<u32>> = (0..12)
        .map(|i| run(&mut roomy, vec![request(i)]).0.remove(0))
        .collect();

    // 128 token slots; twelve requests reaching 60 tokens each.
    let mut tight = engine(&w, 128);
    let (together, report) = run(&mut tight, (0..12).map(request).collect());
    assert!(report.preempted > 0, "the pool was meant to run short");
    assert_eq!(report.finished, 12);
    assert_eq!(together, alone);
    let s = tight.pool_stats();
    assert!(s.is_full(), "{s:?}");
    assert_eq!(s.isolation_violations, 0);
}

#[test]
fn a_preempted_request_that_streamed_tokens_fails_at_shutdown_and_is_never_rejected() {
    // `Rejected` means "turned away without generating: retry elsewhere".
    // A request preempted after streaming tokens has generated: when the
    // engine goes away it failed mid-way, and a retry would duplicate
    // output.
    let w = random_weights(&ModelConfig::tiny_gqa(), 21);
    let mut e = engine(&w, 128);
    let handles: Vec<_> = (0..12).map(|i| e.submit(request(i)).unwrap()).collect();
    let mut preempted = 0;
    let mut steps = 0;
    while preempted == 0 {
        preempted += e.step().preempted;
        steps += 1;
        assert!(steps < 10_000, "the pool was meant to run short");
    }
    drop(e);
    let mut streamed_then_ended = 0;
    for h in &handles {
        let (tokens, outcome) = h.try_collect();
        match outcome {
            Some(Outcome::Rejected(r)) => assert!(
                tokens.is_empty(),
                "{} streamed {} tokens, then was rejected ({r})",
                h.id(),
                tokens.len()
            ),
            Some(Outcome::Failed(_)) => streamed_then_ended += usize::from(!tokens.is_empty()),
            Some(_) => {}
            None => panic!("{}: no outcome after the engine was dropped", h.id()),
        }
    }
    assert!(streamed_then_ended > 0);
}
