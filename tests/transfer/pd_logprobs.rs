//! Story: a client scores each completion by its tokens' log-probabilities
//! (`SamplingParams::logprobs`). In disaggregated serving the first token
//! is sampled by the prefill worker, so its log-probabilities travel in the
//! receipt, and every later token's come from decode. A client must get the
//! same tokens and the same log-probabilities as from the colocated engine,
//! over every transport; a request that did not ask gets none; and both
//! pools end full.

use crate::support;
use crate::support::pd;

use std::time::{Duration, Instant};

use handoff::model::Model;
use handoff::sampling::TokenLogprobs;
use handoff::transfer::{InProcess, Tcp, TcpAuth, Transfer, TransferConfig};
use handoff::{
    Engine, EngineConfig, KvDtype, Outcome, Request, RequestId, SamplingParams, TenantId,
};
use pd::{Pair, Tracked};

fn requests() -> Vec<Request> {
    let asks = [
        (Some(5u8), 0.0f32),
        (Some(0), 0.9),
        (None, 0.0),
        (Some(20), 0.7),
        (None, 1.1),
    ];
    asks.iter()
        .enumerate()
        .map(|(i, &(logprobs, temperature))| {
            let prompt = (0..3 + 5 * i as u32)
                .map(|j| (j * 7 + i as u32) % 97)
                .collect();
            Request::new(RequestId(100 + i as u64), TenantId(i as u32), prompt, 7).with_sampling(
                SamplingParams {
                    temperature,
                    seed: 40 + i as u64,
                    logprobs,
                    ..SamplingParams::greedy()
                },
            )
        })
        .collect()
}

type Seen = (Vec<u32>, Vec<TokenLogprobs>);

fn colocated(reqs: &[Request]) -> Vec<Seen> {
    let w = pd::weights();
    let cfg = EngineConfig::colocated(w.config.kv_geometry(KvDtype::F32))
        .max_context(pd::WINDOW)
        .page_size(pd::PAGE)
        .pool_tokens(2 * pd::WINDOW * reqs.len())
        .build()
        .unwrap();
    let mut engine = Engine::new(Model::cpu(w).unwrap(), cfg).unwrap();
    let mut tracked: Vec<Tracked> = reqs
        .iter()
        .map(|r| Tracked::new(r.clone(), engine.submit(r.clone())))
        .collect();
    engine.run_until_idle();
    assert!(engine.pool_stats().is_full());
    tracked
        .iter_mut()
        .map(|t| {
            t.drain();
            assert!(
                matches!(t.outcome, Some(Outcome::Finished(_))),
                "{:?}",
                t.outcome
            );
            (t.tokens.clone(), t.logprobs.clone())
        })
        .collect()
}

fn disaggregated_reports_what_colocated_does<T: Transfer>(t: T) {
    let reqs = requests();
    let want = colocated(&reqs);
    let mut pair = Pair::start(&t, TransferConfig::default(), &pd::weights());
    let mut got: Vec<Tracked> = reqs.iter().map(|r| pair.submit(r.clone())).collect();
    assert!(pair.run_until(&mut got, Instant::now() + support::DEADLINE));
    for ((r, (tokens, logprobs)), g) in reqs.iter().zip(&want).zip(&got) {
        assert!(
            matches!(g.outcome, Some(Outcome::Finished(_))),
            "{}: {:?}",
            r.id,
            g.outcome
        );
        assert_eq!(&g.tokens, tokens, "{}: {}", r.id, t.name());
        match r.sampling.logprobs {
            None => assert!(g.logprobs.is_empty(), "{}: not asked, none sent", r.id),
            Some(n) => {
                assert_eq!(g.logprobs.len(), tokens.len(), "{}: one per token", r.id);
                for (lp, &tok) in g.logprobs.iter().zip(tokens) {
                    assert_eq!(lp.token, tok);
                    assert_eq!(lp.top.len(), n as usize);
                }
            }
        }
        // Bit for bit: the same pass computed the same logits on both sides.
        assert_eq!(&g.logprobs, logprobs, "{}: {}", r.id, t.name());
    }
    pair.pools_return_to_full(Duration::from_secs(10)).unwrap();
    pair.stop().unwrap();
}

#[test]
fn in_process() {
    disaggregated_reports_what_colocated_does(InProcess);
}

#[test]
fn tcp() {
    disaggregated_reports_what_colocated_does(Tcp);
}

#[test]
fn tcp_authenticated() {
    disaggregated_reports_what_colocated_does(TcpAuth);
}
