//! Incident-style check: clients cancel (or drop their handle) while their
//! requests are drafting and verifying, some between steps and some while
//! a verify pass streams their tokens. Every request ends exactly once,
//! the others finish with the output they would have had, and every page
//! (the drafts' extra pages included) is back in the pool.

use handoff::model::{Model, ModelConfig, random_weights};
use handoff::request::SpecConfig;
use handoff::{
    Engine, EngineConfig, EngineOptions, FinishReason, KvDtype, Outcome, Request, RequestId,
    TenantId,
};

fn engine() -> Engine {
    let model = Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 3)).unwrap();
    let cfg = EngineConfig::colocated(model.kv_geometry(KvDtype::F32))
        .max_context(128)
        .page_size(2)
        .pool_tokens(16 * 128)
        .build()
        .unwrap();
    let opts = EngineOptions {
        speculative: Some(SpecConfig::prompt_lookup(1, 3, 6)),
        ..EngineOptions::default()
    };
    Engine::with_options(model, cfg, opts).unwrap()
}

fn prompt(i: u64) -> Vec<u32> {
    let p = [i as u32 + 1, 9, 4, i as u32 + 2];
    p.iter().cycle().take(16).copied().collect()
}

#[test]
fn cancelling_mid_verify_returns_every_page() {
    // The reference: each request served to the end.
    let mut e = engine();
    let full: Vec<Vec<u32>> = (0..8)
        .map(|i| {
            let h = e
                .submit(Request::new(RequestId(i), TenantId(0), prompt(i), 40))
                .unwrap();
            e.run_until_idle();
            h.try_collect().0
        })
        .collect();

    let mut e = engine();
    let mut handles: Vec<_> = (0..8)
        .map(|i| {
            Some(
                e.submit(Request::new(RequestId(i), TenantId(0), prompt(i), 40))
                    .unwrap(),
            )
        })
        .collect();
    for _ in 0..4 {
        e.step();
    }
    assert!(e.tally().drafted > 0, "the requests are drafting");
    // Requests 0 and 1: cancelled between steps. 2 and 3: handles dropped,
    // so the next verify pass's streaming finds no client.
    for i in [0, 1] {
        handles[i].as_ref().unwrap().cancel();
    }
    handles[2] = None;
    handles[3] = None;
    e.step();
    assert!(e.pool_stats().in_use > 0);
    e.run_until_idle();
    for (i, h) in handles.iter().enumerate() {
        let Some(h) = h else { continue };
        let (tokens, outcome) = h.try_collect();
        if i < 2 {
            assert_eq!(outcome, Some(Outcome::Cancelled), "request {i}");
            assert!(tokens.len() < 40);
            assert_eq!(tokens, full[i][..tokens.len()]);
        } else {
            assert_eq!(outcome, Some(Outcome::Finished(FinishReason::Length)));
            assert_eq!(tokens, full[i], "request {i} was not disturbed");
        }
    }
    let t = e.tally();
    assert_eq!(t.cancelled, 4, "{t:?}");
    assert_eq!(t.finished, 4);
    let stats = e.pool_stats();
    assert!(stats.is_full(), "{stats:?}");
    assert_eq!(stats.isolation_violations, 0);
}
