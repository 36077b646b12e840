//! Story: a client asks for log-probabilities to score what it is served
//! (`SamplingParams::logprobs`). After each token it gets that token's
//! log-probability under the model and the `n` most likely tokens', as the
//! model's own logits give them (temperature 1, before top-k and top-p),
//! whatever else is batched with it; a request that did not ask gets none
//! and its tokens do not change; asking for more than 20 is a 400 at once.

use handoff::model::{Model, ModelConfig, random_weights};
use handoff::sampling::{TokenLogprobs, log_normaliser, logprob_of, top_ids};
use handoff::{
    Engine, EngineConfig, Event, HttpStatus, KvDtype, Outcome, Rejection, Request, RequestId,
    SamplingParams, TenantId,
};

fn model() -> Model {
    Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 8)).unwrap()
}

fn engine() -> Engine {
    let m = model();
    let cfg = EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(128)
        .page_size(16)
        .pool_tokens(1024)
        .build()
        .unwrap();
    Engine::new(m, cfg).unwrap()
}

fn req(id: u64, logprobs: Option<u8>, temperature: f32) -> Request {
    let prompt = (0..5 + id as u32)
        .map(|j| (j * 11 + id as u32) % 200 + 1)
        .collect();
    Request::new(RequestId(id), TenantId(id as u32), prompt, 6).with_sampling(SamplingParams {
        temperature,
        seed: id,
        logprobs,
        ..SamplingParams::greedy()
    })
}

/// The tokens and log-probabilities a request's events carry, checking
/// that each `Logprobs` directly follows its token.
fn read(events: Vec<Event>) -> (Vec<u32>, Vec<TokenLogprobs>, Outcome) {
    let (mut tokens, mut lps, mut done) = (Vec::new(), Vec::new(), None);
    for ev in events {
        match ev {
            Event::Token(t) => tokens.push(t),
            Event::Logprobs(lp) => {
                assert_eq!(lp.token, *tokens.last().expect("a token first"));
                assert_eq!(lps.len() + 1, tokens.len(), "one per token, right after it");
                lps.push(lp);
            }
            Event::Done(o) => done = Some(o),
        }
    }
    (tokens, lps, done.expect("an outcome"))
}

fn serve(reqs: &[Request]) -> Vec<(Vec<u32>, Vec<TokenLogprobs>)> {
    let mut e = engine();
    let hs: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    e.run_until_idle();
    assert!(e.pool_stats().is_full());
    hs.iter()
        .map(|h| {
            let (t, lp, o) = read(h.events().try_iter().collect());
            assert!(matches!(o, Outcome::Finished(_)), "{o:?}");
            (t, lp)
        })
        .collect()
}

#[test]
fn each_token_carries_the_models_own_log_probabilities() {
    let r = req(1, Some(4), 0.8);
    let (tokens, lps) = serve(std::slice::from_ref(&r)).remove(0);
    assert_eq!(lps.len(), tokens.len());
    let m = model();
    for (i, (lp, &tok)) in lps.iter().zip(&tokens).enumerate() {
        // The logits at this position, from a separate forward pass.
        let mut seq = r.prompt.clone();
        seq.extend(&tokens[..i]);
        let all = m.logits_for_prompt(&seq).unwrap();
        let logits = all.last().unwrap();
        let (max, ln_sum) = log_normaliser(logits);
        let exact = logprob_of(logits[tok as usize], max, ln_sum);
        assert!(
            (lp.logprob - exact).abs() < 1e-4,
            "token {i}: {} vs {exact}",
            lp.logprob
        );
        let ids: Vec<u32> = lp.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, top_ids(logits, 4), "token {i}");
        for &(id, x) in &lp.top {
            assert!((x - logprob_of(logits[id as usize], max, ln_sum)).abs() < 1e-4);
        }
        let p: f64 = lp.top.iter().map(|&(_, x)| (x as f64).exp()).sum();
        assert!(p <= 1.0 + 1e-5 && lp.logprob <= 0.0);
    }
}

#[test]
fn a_greedy_token_is_the_most_likely_one() {
    let (tokens, lps) = serve(&[req(2, Some(1), 0.0)]).remove(0);
    for (lp, &t) in lps.iter().zip(&tokens) {
        assert_eq!(lp.top[0].0, t);
        assert_eq!(lp.top[0].1, lp.logprob);
    }
    // Zero alternatives: the chosen token's alone.
    let (_, lps) = serve(&[req(2, Some(0), 0.0)]).remove(0);
    assert!(lps.iter().all(|lp| lp.top.is_empty()));
}

#[test]
fn batch_neighbours_neither_change_them_nor_receive_them() {
    let asking = req(3, Some(5), 0.7);
    let alone = serve(std::slice::from_ref(&asking)).remove(0);
    let quiet = [req(4, None, 0.0), req(5, None, 1.2)];
    let quiet_alone: Vec<_> = quiet
        .iter()
        .map(|r| serve(std::slice::from_ref(r)).remove(0))
        .collect();
    let batch = serve(&[quiet[0].clone(), asking, quiet[1].clone()]);
    assert_eq!(
        batch[1], alone,
        "the same tokens and log-probabilities, bit for bit"
    );
    for (b, a) in [&batch[0], &batch[2]].into_iter().zip(&quiet_alone) {
        assert!(b.1.is_empty(), "a request that did not ask gets none");
        assert_eq!(b.0, a.0, "and its tokens are unchanged");
    }
}

#[test]
fn asking_for_more_than_twenty_is_refused_before_anything_runs() {
    let mut e = engine();
    let err = e.submit(req(6, Some(21), 0.0)).unwrap_err();
    assert!(matches!(err, Rejection::InvalidSampling { .. }), "{err:?}");
    assert_eq!(err.http_status(), 400);
    assert!(e.pool_stats().is_full());
}
