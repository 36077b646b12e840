//! A serving stack's clients arrive on many threads at once. Before the
//! service, every host wrapped the engine in its own command loop; a loop
//! that drops a reply, spins when idle or forgets its live requests at
//! shutdown loses requests. These stories drive `Service` the way a server
//! does: many client threads submitting, reading and cancelling at once, and
//! shutdowns with and without grace, on the colocated engine and on a decode
//! worker over both transports.

use crate::support::pd;

use handoff::{Colocated, Decode, DecodeWorker, Prefill, PrefillWorker};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use handoff::model::{Model, ModelWeights};
use handoff::service::{Service, Submitter};
use handoff::transfer::{InProcess, Tcp, Transfer, TransferConfig};
use handoff::{
    Engine, EngineError, Event, HttpStatus, Outcome, Rejection, Request, RequestHandle, RequestId,
    SamplingParams, TenantId,
};

/// Long enough for any of these tiny requests; a hang fails instead.
const PATIENCE: Duration = Duration::from_secs(60);

fn engine(w: &ModelWeights) -> Engine {
    Engine::new(
        Model::cpu(w.clone()).unwrap(),
        pd::engine_config::<Colocated>(w),
    )
    .unwrap()
}

/// Requests of mixed lengths from several tenants; every third one samples
/// with its own seed.
fn workload(first_id: u64, n: u64) -> Vec<Request> {
    (0..n)
        .map(|i| {
            let id = first_id + i;
            let prompt: Vec<u32> = (0..3 + (id % 11) as u32)
                .map(|t| (t * 7 + id as u32) % 97)
                .collect();
            let req = Request::new(
                RequestId(id),
                TenantId((id % 4) as u32),
                prompt,
                4 + (id % 9) as usize,
            );
            if id.is_multiple_of(3) {
                req.with_sampling(SamplingParams {
                    temperature: 0.9,
                    top_k: Some(20),
                    top_p: Some(0.95),
                    seed: id,
                    stop_ids: Vec::new(),
                    logprobs: None,
                })
            } else {
                req
            }
        })
        .collect()
}

/// What each request generates alone on a colocated engine stepped here.
fn alone(w: &ModelWeights, reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| {
            let mut e = engine(w);
            let h = e.submit(r.clone()).unwrap();
            e.run_until_idle();
            let (tokens, outcome) = h.try_collect();
            assert!(matches!(outcome, Some(Outcome::Finished(_))), "{outcome:?}");
            tokens
        })
        .collect()
}

fn wait(h: &RequestHandle) -> (Vec<u32>, Outcome) {
    let (tokens, outcome) = h.wait_timeout(PATIENCE);
    let outcome = outcome.unwrap_or_else(|| panic!("{} never ended", h.id()));
    (tokens, outcome)
}

/// `threads` clients, each submitting its share of `reqs` and reading every
/// stream to the end; returns each request's tokens and outcome, by id.
fn clients(
    submitter: &Submitter,
    reqs: &[Request],
    threads: usize,
) -> Vec<(RequestId, Vec<u32>, Outcome)> {
    let chunks: Vec<Vec<Request>> = (0..threads)
        .map(|t| reqs.iter().skip(t).step_by(threads).cloned().collect())
        .collect();
    let joins: Vec<_> = chunks
        .into_iter()
        .map(|mine| {
            let s = submitter.clone();
            std::thread::spawn(move || {
                let handles: Vec<RequestHandle> =
                    mine.into_iter().map(|r| s.submit(r).unwrap()).collect();
                handles
                    .iter()
                    .map(|h| {
                        let (t, o) = wait(h);
                        (h.id(), t, o)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all: Vec<_> = joins.into_iter().flat_map(|j| j.join().unwrap()).collect();
    all.sort_by_key(|(id, _, _)| *id);
    all
}

#[test]
fn many_client_threads_get_exactly_what_each_request_gives_alone() {
    let w = pd::weights();
    let reqs = workload(1, 24);
    let want = alone(&w, &reqs);
    let service = Service::spawn(engine(&w)).unwrap();

    let got = clients(&service.submitter(), &reqs, 6);

    assert_eq!(got.len(), reqs.len());
    for ((id, tokens, outcome), want) in got.iter().zip(&want) {
        assert!(matches!(outcome, Outcome::Finished(_)), "{id}: {outcome:?}");
        assert_eq!(tokens, want, "{id}: output differs from the request alone");
    }
    let engine = service.shutdown(Duration::from_secs(5)).unwrap();
    let stats = engine.pool_stats();
    assert!(
        stats.is_full() && stats.isolation_violations == 0,
        "{stats:?}"
    );
}

#[test]
fn rejections_reach_the_submitting_thread_typed_and_allocate_nothing() {
    let w = pd::weights();
    let service = Service::spawn(engine(&w)).unwrap();
    let s = service.submitter();
    let over = std::thread::spawn(move || {
        s.submit(Request::new(
            RequestId(1),
            TenantId(1),
            vec![1; pd::WINDOW + 1],
            1,
        ))
    })
    .join()
    .unwrap();
    let err = over.expect_err("a prompt over the window is refused");
    assert!(matches!(err, Rejection::PromptTooLong { .. }), "{err:?}");
    assert_eq!(err.http_status(), 413);
    assert!(service.pool_stats().is_full());

    let stopped = service.shutdown(Duration::ZERO).unwrap();
    assert!(stopped.pool_stats().is_full());

    // The same id twice while the first is live (queued behind a hundred
    // others): the second is refused and the first is untouched.
    let mut e = engine(&w);
    let ahead: Vec<RequestHandle> = (100..200)
        .map(|i| {
            e.submit(Request::new(RequestId(i), TenantId(1), vec![1; 8], 40))
                .unwrap()
        })
        .collect();
    let first = e
        .submit(Request::new(RequestId(2), TenantId(1), vec![1, 2, 3], 40))
        .unwrap();
    let service = Service::spawn(e).unwrap();
    let dup = service
        .submit(Request::new(RequestId(2), TenantId(2), vec![4, 5], 3))
        .expect_err("a live id is refused");
    assert_eq!(dup.http_status(), 409);
    let (tokens, outcome) = wait(&first);
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    assert_eq!(tokens.len(), 40);
    drop(ahead);
    let engine = service.shutdown(Duration::ZERO).unwrap();
    assert!(engine.pool_stats().is_full());
}

#[test]
fn a_client_cancelling_on_its_own_thread_frees_its_pages_and_harms_no_other() {
    let w = pd::weights();
    let reqs = workload(10, 6);
    let want = alone(&w, &reqs);
    let service = Service::spawn(engine(&w)).unwrap();
    let long = service
        .submit(Request::new(RequestId(99), TenantId(9), vec![3, 1, 4], 60))
        .unwrap();
    let canceller = long.canceller();
    let s = service.submitter();
    let others = std::thread::spawn(move || clients(&s, &reqs, 3));
    std::thread::spawn(move || canceller.cancel())
        .join()
        .unwrap();

    let (_, outcome) = wait(&long);
    assert!(
        matches!(outcome, Outcome::Cancelled | Outcome::Finished(_)),
        "{outcome:?}"
    );
    for ((id, tokens, outcome), want) in others.join().unwrap().iter().zip(&want) {
        assert!(matches!(outcome, Outcome::Finished(_)), "{id}: {outcome:?}");
        assert_eq!(tokens, want, "{id}");
    }
    let engine = service.shutdown(Duration::ZERO).unwrap();
    assert!(engine.pool_stats().is_full());
}

#[test]
fn shutdown_with_grace_finishes_live_requests_and_turns_later_ones_away() {
    let w = pd::weights();
    let reqs = workload(20, 8);
    let want = alone(&w, &reqs);
    let service = Service::spawn(engine(&w)).unwrap();
    let late = service.submitter();
    let handles: Vec<RequestHandle> = reqs
        .iter()
        .map(|r| service.submit(r.clone()).unwrap())
        .collect();

    let engine = service.shutdown(PATIENCE).unwrap();

    for (h, want) in handles.iter().zip(&want) {
        let (tokens, outcome) = wait(h);
        assert!(
            matches!(outcome, Outcome::Finished(_)),
            "{}: {outcome:?}",
            h.id()
        );
        assert_eq!(&tokens, want);
    }
    let refused = late
        .submit(Request::new(RequestId(500), TenantId(1), vec![1], 1))
        .expect_err("the service has stopped");
    assert!(
        matches!(refused, Rejection::ShuttingDown { .. }),
        "{refused:?}"
    );
    assert_eq!(refused.http_status(), 503);
    assert!(engine.pool_stats().is_full());
}

#[test]
fn shutdown_without_grace_ends_every_live_request_with_a_503_and_frees_every_page() {
    let w = pd::weights();
    // Far more than the pool holds at once: most are still waiting when the
    // shutdown comes. They are submitted before the thread starts, so its
    // first steps cannot race through them.
    let reqs: Vec<Request> = (0..200)
        .map(|i| {
            Request::new(
                RequestId(i),
                TenantId(1),
                vec![1 + i as u32 % 90; 8],
                40 + i as usize % 7,
            )
        })
        .collect();
    let want = alone(&w, &reqs[..8]);
    let mut e = engine(&w);
    let handles: Vec<RequestHandle> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    let service = Service::spawn(e).unwrap();
    let engine = service.shutdown(Duration::ZERO).unwrap();

    let mut turned_away = 0;
    for (i, h) in handles.iter().enumerate() {
        let (tokens, outcome) = wait(h);
        if let Some(want) = want.get(i) {
            assert!(
                want.starts_with(&tokens),
                "{}: a token nobody generated",
                h.id()
            );
        }
        match &outcome {
            Outcome::Finished(_) => assert_eq!(tokens.len(), reqs[i].max_new_tokens),
            Outcome::Failed(EngineError::Shutdown) => assert!(!tokens.is_empty()),
            Outcome::Rejected(Rejection::ShuttingDown { .. }) => {
                assert!(tokens.is_empty());
                turned_away += 1;
            }
            other => panic!("{}: {other:?}", h.id()),
        }
        if !matches!(outcome, Outcome::Finished(_)) {
            assert_eq!(outcome.http_status(), 503);
        }
    }
    // Each request still waiting was turned away, not dropped.
    assert!(turned_away > 0, "no request was still waiting at shutdown");
    let stats = engine.pool_stats();
    assert!(stats.is_full(), "{stats:?}");
}

#[test]
fn dropping_the_service_ends_its_requests_and_later_submissions_are_refused() {
    let w = pd::weights();
    let service = Service::spawn(engine(&w)).unwrap();
    let s = service.submitter();
    let h = s
        .submit(Request::new(RequestId(1), TenantId(1), vec![1, 2], 60))
        .unwrap();
    // The request is running (its first token came) when the service goes;
    // one still in its queue would be turned away instead, which
    // `shutdown_without_grace_ends_every_live_request_with_a_503_and_frees_every_page`
    // covers.
    match h.events().recv_timeout(PATIENCE) {
        Ok(Event::Token(_)) => {}
        other => panic!("expected the first token, got {other:?}"),
    }
    drop(service);
    let (_, outcome) = wait(&h);
    assert!(
        matches!(
            outcome,
            Outcome::Finished(_) | Outcome::Failed(EngineError::Shutdown)
        ),
        "{outcome:?}"
    );
    let refused = s
        .submit(Request::new(RequestId(2), TenantId(1), vec![1], 1))
        .expect_err("no service is left");
    assert_eq!(refused.http_status(), 503);
}

/// The decode side of a disaggregated deployment behind a service, its
/// prefill peer on a thread of its own: clients on many threads get what the
/// colocated engine gives.
fn decode_service_serves_concurrent_clients<T: Transfer>(t: &T) {
    let w = pd::weights();
    let reqs = workload(40, 18);
    let want = alone(&w, &reqs);
    let cfg = TransferConfig::default();
    let (pl, dl) = t.connect(&cfg).unwrap();
    let mut prefill = PrefillWorker::new(
        pl,
        Model::cpu(w.clone()).unwrap(),
        pd::engine_config::<Prefill>(&w),
        cfg.clone(),
    )
    .unwrap();
    let prefill_pool = prefill.pool().clone();
    let stop = Arc::new(AtomicBool::new(false));
    let prefill_thread = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let _ = prefill.run(&stop);
            prefill.shutdown();
        })
    };
    let decode = DecodeWorker::new(
        dl,
        Model::cpu(w.clone()).unwrap(),
        pd::engine_config::<Decode>(&w),
        cfg,
    )
    .unwrap();
    let service = Service::spawn(decode).unwrap();

    let got = clients(&service.submitter(), &reqs, 4);

    for ((id, tokens, outcome), want) in got.iter().zip(&want) {
        assert!(matches!(outcome, Outcome::Finished(_)), "{id}: {outcome:?}");
        assert_eq!(tokens, want, "{id}: output differs from colocated");
    }
    let decode = service.shutdown(Duration::from_secs(5)).unwrap();
    assert_eq!(decode.tally().finished, reqs.len() as u64);
    assert!(decode.pool().stats().is_full());
    stop.store(true, Ordering::Release);
    prefill_thread.join().unwrap();
    let p = prefill_pool.stats();
    assert!(p.is_full() && p.isolation_violations == 0, "{p:?}");
}

#[test]
fn decode_service_in_process() {
    decode_service_serves_concurrent_clients(&InProcess);
}

#[test]
fn decode_service_over_tcp() {
    decode_service_serves_concurrent_clients(&Tcp);
}

#[test]
fn submissions_racing_a_shutdown_are_each_answered_and_no_page_is_lost() {
    // Non-negotiable 5 at the service's edge: whatever a submission races
    // (a shutdown with a short grace, then the thread's exit), it gets an
    // answer, every admitted request gets exactly one outcome, and every
    // page comes back. A hang fails the test instead of stalling it.
    let w = pd::weights();
    for (round, grace_ms) in [0u64, 1, 5, 20].into_iter().enumerate() {
        let service = Service::spawn(engine(&w)).unwrap();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        for c in 0..4u64 {
            let s = service.submitter();
            let done = done_tx.clone();
            std::thread::spawn(move || {
                let mut admitted = 0;
                for i in 0..30u64 {
                    let id = RequestId(round as u64 * 1000 + c * 100 + i);
                    let req = Request::new(id, TenantId(c as u32), vec![1 + i as u32 % 90; 4], 6);
                    match s.submit(req) {
                        Ok(h) => {
                            admitted += 1;
                            let (_, outcome) = h.wait_timeout(PATIENCE);
                            let outcome = outcome.expect("an admitted request ended");
                            if !matches!(outcome, Outcome::Finished(_)) {
                                assert_eq!(outcome.http_status(), 503, "{outcome:?}");
                            }
                        }
                        Err(r) => assert!(matches!(r, Rejection::ShuttingDown { .. }), "{r:?}"),
                    }
                }
                let _ = done.send(admitted);
            });
        }
        std::thread::sleep(Duration::from_millis(2));
        let engine = service.shutdown(Duration::from_millis(grace_ms)).unwrap();
        for _ in 0..4 {
            done_rx
                .recv_timeout(PATIENCE)
                .expect("a client thread hung on a submission or an outcome");
        }
        let stats = engine.pool_stats();
        assert!(
            stats.is_full() && stats.isolation_violations == 0,
            "{stats:?}"
        );
    }
}

/// A host's metrics read the server's counters and queue from any thread
/// while the service runs: the backlog shows as waiting, and once every
/// request has ended the counters say how each did.
#[test]
fn the_service_reports_its_queue_and_counters_while_it_runs() {
    let w = pd::weights();
    let reqs: Vec<Request> = (0..60)
        .map(|i| Request::new(RequestId(i), TenantId(2), vec![1 + i as u32 % 90; 8], 12))
        .collect();
    let mut e = engine(&w);
    let handles: Vec<RequestHandle> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    let service = Service::spawn(e).unwrap();
    let early = service.submitter().stats();
    assert!(
        early.waiting > 0,
        "a backlog of 60 shows as waiting: {early:?}"
    );
    for h in &handles {
        assert!(matches!(wait(h).1, Outcome::Finished(_)));
    }
    let until = std::time::Instant::now() + PATIENCE;
    let done = loop {
        let s = service.stats();
        if s.tally.finished == 60 || std::time::Instant::now() > until {
            break s;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(done.tally.finished, 60, "{done:?}");
    assert_eq!(done.waiting, 0);
    assert!(done.tally.prefill_tokens + done.tally.reused_tokens >= 60 * 8);
    // Each request's first token comes from its prefill, the other 11 from
    // decode steps, except that a preempted request's recompute prefill
    // yields the token a decode step would have.
    assert_eq!(
        done.tally.decoded + done.tally.preempted,
        60 * 11,
        "{done:?}"
    );
    let engine = service.shutdown(Duration::ZERO).unwrap();
    assert!(engine.pool_stats().is_full());
}
