//! A decode worker that is generating polls its link with a zero timeout
//! once a step. It used to handle one message per poll, so a burst of
//! prompts finished by prefill landed one per decode step: with a thousand
//! sequences running, the thousandth arrival waited a thousand steps for its
//! first token. Every receipt already waiting lands at the next step, on
//! every transport, and generation goes on exactly as before.

use std::time::{Duration, Instant};

use handoff::model::Model;
use handoff::transfer::{InProcess, Transfer, TransferConfig};
use handoff::{DecodeWorker, Outcome, PrefillWorker, Request, RequestId, TenantId};

use crate::support::pd::{engine_config, reference, weights};

/// Requests that arrive together while one sequence is generating.
const BURST: u64 = 8;

fn run<T: Transfer>(t: &T) {
    let w = weights();
    let cfg = TransferConfig::default();
    let (p, d) = t.connect(&cfg).expect("link");
    let mut prefill = PrefillWorker::new(
        p,
        Model::cpu(w.clone()).expect("model"),
        engine_config(&w),
        cfg.clone(),
    )
    .expect("prefill worker");
    let dcfg = handoff::EngineConfigBuilder::<handoff::Decode>::new(
        w.config.kv_geometry(handoff::KvDtype::F32),
    )
    .max_context(crate::support::pd::WINDOW)
    .page_size(crate::support::pd::PAGE)
    .pool_tokens(crate::support::pd::WINDOW * (BURST as usize + 2))
    .build()
    .expect("decode config");
    let mut decode = DecodeWorker::new(d, Model::cpu(w.clone()).expect("model"), dcfg, cfg)
        .expect("decode worker")
        .with_idle_wait(Duration::from_millis(1));

    let req = |id: u64| Request::new(RequestId(id), TenantId(1), vec![3, 1, 4, 1, 5], 24);
    // One sequence generating, so every decode step polls with no wait.
    let first = decode.submit(req(0)).expect("admitted");
    while decode.tally().landed < 1 {
        decode.step();
        prefill.step(Duration::from_millis(10)).expect("prefill");
    }
    let burst: Vec<_> = (1..=BURST)
        .map(|id| decode.submit(req(id)).expect("admitted"))
        .collect();
    decode.step(); // sends the plans, decodes the first sequence
    let mut sent = 0;
    while sent < BURST as usize {
        sent += prefill.step(Duration::from_secs(5)).expect("prefill");
    }
    // Every transport hands receipts over from its own thread (the
    // in-process lander, the socket reader) once the writes before them
    // have landed: wait until all of them are waiting on the link.
    let until = Instant::now() + Duration::from_secs(30);
    while decode.side().arrived() < BURST as usize {
        assert!(Instant::now() < until, "the receipts never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    let landed_before = decode.tally().landed;
    decode.step();
    let landed = decode.tally().landed - landed_before;
    assert_eq!(
        landed,
        BURST,
        "{}: every receipt waiting lands in one step",
        std::any::type_name::<T>()
    );

    assert!(decode.run_until_idle_within(Duration::from_secs(30)));
    let reqs: Vec<Request> = (0..=BURST).map(req).collect();
    let want = reference(&w, &reqs);
    let got = std::iter::once(first).chain(burst).map(|h| h.wait());
    for ((tokens, outcome), want) in got.zip(want) {
        assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
        assert_eq!(tokens, want, "the same tokens as colocated serving");
    }
    assert!(decode.pool().stats().is_full());
    drop(decode);
    prefill.shutdown();
    assert!(prefill.pool().stats().is_full());
}

#[test]
fn every_receipt_waiting_lands_at_the_next_decode_step() {
    run(&InProcess);
    run(&handoff::transfer::Tcp);
    run(&handoff::transfer::TcpAuth);
    on_nixl!(|t| run(&t));
}
