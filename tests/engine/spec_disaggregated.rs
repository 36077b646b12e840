//! Incident-style check: disaggregated serving where the decode side drafts.
//! Prefill is unchanged (it computes the prompt and samples the first
//! token); the decode worker verifies prompt-lookup drafts over the pages
//! that the verified receipt gave it, a mixed batch of drafting and plain
//! requests, and every request's greedy tokens are the colocated engine's.
//! Both pools return to full with no cross-request read.

use std::time::{Duration, Instant};

use handoff::request::SpecConfig;
use handoff::transfer::{InProcess, TransferConfig};
use handoff::{Outcome, Request, RequestId, TenantId};

use crate::support::pd::{Pair, reference, weights};

#[test]
fn the_decode_side_drafts_and_its_greedy_output_is_colocated_output() {
    let w = weights();
    let reqs: Vec<Request> = (0..6u64)
        .map(|i| {
            let phrase = [i as u32 + 3, 40, 41, 42 + i as u32];
            let prompt: Vec<u32> = phrase.iter().cycle().take(13).copied().collect();
            let r = Request::new(RequestId(i), TenantId(0), prompt, 24);
            if i % 2 == 0 {
                r.with_speculative(SpecConfig::prompt_lookup(1, 3, 5))
            } else {
                r
            }
        })
        .collect();
    let want = reference(&w, &reqs);
    let mut pair = Pair::start(&InProcess, TransferConfig::default(), &w);
    let mut tracked: Vec<_> = reqs.iter().map(|r| pair.submit(r.clone())).collect();
    assert!(pair.run_until(&mut tracked, Instant::now() + Duration::from_secs(60)));
    for (t, want) in tracked.iter().zip(&want) {
        assert!(
            matches!(t.outcome, Some(Outcome::Finished(_))),
            "{:?}",
            t.outcome
        );
        assert_eq!(&t.tokens, want, "request {}", t.req.id);
    }
    let tally = pair.decode.tally();
    assert!(tally.drafted > 0, "{tally:?}");
    pair.pools_return_to_full(Duration::from_secs(10)).unwrap();
    pair.stop().unwrap();
}
