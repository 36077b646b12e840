//! Story: an operator rolls a new fine-tune out to the decode workers while
//! the prefill workers still run the old weights. Both have the same shapes,
//! so every KV transfer would verify: same request, same token counts, same
//! pages, checksums of exactly the bytes prefill wrote. Decode would then
//! generate from KV that another model computed, and every answer would be
//! silently wrong.
//!
//! Decode names its model (a hash of its configuration and weights) in each
//! plan; prefill refuses a plan for any other model with a typed abort. The
//! client gets a server error (500) and not one token, both pools end full,
//! and the same weights loaded separately on both sides serve normally.

use crate::support;
use crate::support::pd;

use std::time::{Duration, Instant};

use handoff::model::{Model, ModelWeights, random_weights};
use handoff::transfer::{AbortReason, Transfer, TransferConfig, TransferError};
use handoff::{EngineError, HttpStatus, Outcome, Request, RequestId, TenantId};
use pd::{Pair, Tracked};

fn old_weights() -> ModelWeights {
    random_weights(&pd::tiny_model(), 1)
}

/// The fine-tune: the same shapes, other values.
fn new_weights() -> ModelWeights {
    random_weights(&pd::tiny_model(), 2)
}

fn requests() -> Vec<Request> {
    (0..3)
        .map(|i| {
            Request::new(
                RequestId(10 + i),
                TenantId(i as u32),
                vec![3, 1, 4, 1, 5],
                6,
            )
        })
        .collect()
}

fn run<T: Transfer>(pair: &mut Pair<T>) -> Vec<Tracked> {
    let mut reqs: Vec<Tracked> = requests().into_iter().map(|r| pair.submit(r)).collect();
    assert!(
        pair.run_until(&mut reqs, Instant::now() + support::DEADLINE),
        "requests did not end"
    );
    reqs
}

fn refuse_kv_from_other_weights<T: Transfer>(t: T) {
    let (old, new) = (old_weights(), new_weights());
    let (old_fp, new_fp) = (
        Model::cpu(old.clone()).unwrap().fingerprint(),
        Model::cpu(new.clone()).unwrap().fingerprint(),
    );
    assert_ne!(old_fp, new_fp);
    let mut pair = Pair::start_with(&t, TransferConfig::default(), &old, &new);
    for r in run(&mut pair) {
        assert!(
            r.tokens.is_empty(),
            "{}: tokens from another model's KV",
            r.req.id
        );
        let Some(Outcome::Failed(failed)) = &r.outcome else {
            panic!("{}: {:?}", r.req.id, r.outcome);
        };
        assert_eq!(
            failed.http_status(),
            500,
            "a deployment error, not the client's"
        );
        let EngineError::Transfer(e) = failed else {
            panic!("{}: {failed:?}", r.req.id);
        };
        assert_eq!(
            e,
            &TransferError::Aborted {
                request: r.req.id,
                reason: AbortReason::ModelMismatch {
                    planned: Some(new_fp),
                    served: Some(old_fp),
                },
            }
        );
    }
    assert_eq!(pair.decode.side().stats().verified, 0, "nothing verified");
    pair.pools_return_to_full(Duration::from_secs(5)).unwrap();
    pair.stop().unwrap();
}

fn serve_same_weights_loaded_twice<T: Transfer>(t: T) {
    // Two separate loads of one checkpoint are one model.
    let (a, b) = (old_weights(), old_weights());
    let want = pd::reference(&a, &requests());
    let mut pair = Pair::start_with(&t, TransferConfig::default(), &a, &b);
    for (r, want) in run(&mut pair).iter().zip(&want) {
        assert_eq!(r.judge(want), Ok("ok".to_string()));
    }
    pair.pools_return_to_full(Duration::from_secs(5)).unwrap();
    pair.stop().unwrap();
}

on_both_transports! {
    decode_on_new_weights_refuses_kv_from_old_weights => refuse_kv_from_other_weights;
    the_same_weights_loaded_twice_serve_normally => serve_same_weights_loaded_twice;
}
