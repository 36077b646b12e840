//! Story: one request's tokens drive the forward pass to non-finite logits
//! and it shares a batched step with an ordinary request. The bad request
//! must end with a typed failure and stream nothing; the ordinary one must
//! stream exactly the tokens it gets when served alone; every page must
//! come back.
//!
//! The weights pass every load check: a checkpoint saved with
//! `rms_norm_eps` 0 whose embedding row for one token is all zeros (as
//! padding tokens' rows often are). RMSNorm of that row is 0 * 1/sqrt(0) =
//! NaN, which reaches that sequence's K/V and its logits and no one else's.
//! (A huge finite row such as 3e38 does not do it: its mean square
//! overflows to infinity and RMSNorm scales the row to zeros, so the logits
//! stay finite.)

use handoff::model::{Model, ModelConfig, ModelWeights, random_weights};
use handoff::sampling::SamplingError;
use handoff::{
    Engine, EngineConfig, EngineError, FinishReason, KvDtype, Outcome, Request, RequestId, TenantId,
};

/// The token whose embedding row is poisoned.
const POISON: u32 = 7;

fn poisoned_weights() -> ModelWeights {
    let cfg = ModelConfig {
        norm_eps: 0.0,
        ..ModelConfig::tiny_gqa()
    };
    let mut w = random_weights(&cfg, 55);
    let d = w.config.dim;
    let t = POISON as usize;
    w.embedding[t * d..(t + 1) * d].fill(0.0);
    w
}

fn engine() -> Engine {
    let m = Model::cpu(poisoned_weights()).unwrap();
    let cfg = EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(64)
        .page_size(16)
        .pool_tokens(256)
        .build()
        .unwrap();
    Engine::new(m, cfg).unwrap()
}

fn normal() -> Request {
    Request::new(RequestId(1), TenantId(1), vec![1, 20, 33, 41, 5], 8)
}

fn poisoned() -> Request {
    Request::new(RequestId(2), TenantId(2), vec![1, 12, POISON, 90], 8)
}

#[test]
fn the_weights_really_produce_non_finite_logits_for_the_poisoned_token() {
    let m = Model::cpu(poisoned_weights()).unwrap();
    let bad = m.logits_for_prompt(&poisoned().prompt).unwrap();
    assert!(bad.last().unwrap().iter().any(|x| !x.is_finite()));
    let good = m.logits_for_prompt(&normal().prompt).unwrap();
    assert!(good.iter().flatten().all(|x| x.is_finite()));
}

#[test]
fn only_the_poisoned_request_fails_and_its_batch_mate_is_untouched() {
    let alone = {
        let mut e = engine();
        let h = e.submit(normal()).unwrap();
        e.run_until_idle();
        let (tokens, outcome) = h.try_collect();
        assert_eq!(outcome, Some(Outcome::Finished(FinishReason::Length)));
        tokens
    };
    assert_eq!(alone.len(), 8);

    let mut e = engine();
    let good = e.submit(normal()).unwrap();
    let bad = e.submit(poisoned()).unwrap();
    let first = e.step();
    assert_eq!(first.prefilled, 2, "both requests share the first pass");
    assert_eq!(first.failed, 1, "{first:?}");
    e.run_until_idle();

    let (bad_tokens, bad_outcome) = bad.try_collect();
    assert!(bad_tokens.is_empty(), "streamed {bad_tokens:?}");
    assert!(
        matches!(
            bad_outcome,
            Some(Outcome::Failed(EngineError::Sampling(
                SamplingError::NonFinite { .. }
            )))
        ),
        "{bad_outcome:?}"
    );
    let (good_tokens, good_outcome) = good.try_collect();
    assert_eq!(good_tokens, alone);
    assert_eq!(good_outcome, Some(Outcome::Finished(FinishReason::Length)));
    assert!(e.is_idle());
    assert!(e.pool_stats().is_full(), "{:?}", e.pool_stats());
}
