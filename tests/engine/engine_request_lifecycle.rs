//! A request's life as its client sees it: admitted or rejected at once
//! with a typed reason, tokens streamed in order, exactly one final outcome
//! (finished by length or stop id, cancelled, rejected or failed), and its
//! pages back in the pool whatever way it ended.

use handoff::Colocated;
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::{
    BatchLimits, Engine, EngineConfig, EngineError, EngineOptions, Event, FinishReason, HttpStatus,
    KvDtype, Outcome, Rejection, Request, RequestHandle, RequestId, SamplingParams, TenantId,
};

fn model() -> Model {
    Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 8)).unwrap()
}

fn cfg(m: &Model) -> EngineConfig<Colocated> {
    EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(128)
        .page_size(16)
        .pool_tokens(1024)
        .build()
        .unwrap()
}

fn engine() -> Engine {
    let m = model();
    let c = cfg(&m);
    Engine::new(m, c).unwrap()
}

fn req(id: u64, new: usize) -> Request {
    Request::new(
        RequestId(id),
        TenantId(1),
        vec![1, 2, 3, (id % 300) as u32 + 4],
        new,
    )
}

#[test]
fn tokens_stream_in_order_then_one_outcome() {
    let mut e = engine();
    let h = e.submit(req(1, 6)).unwrap();
    e.run_until_idle();
    let events: Vec<Event> = h.events().try_iter().collect();
    assert_eq!(events.len(), 7);
    assert!(events[..6].iter().all(|ev| matches!(ev, Event::Token(_))));
    assert_eq!(
        events[6],
        Event::Done(Outcome::Finished(FinishReason::Length))
    );
    assert!(e.pool_stats().is_full());
}

#[test]
fn a_stop_id_ends_generation_after_streaming_it() {
    let mut e = engine();
    let (free_run, _) = {
        let h = e.submit(req(1, 8)).unwrap();
        e.run_until_idle();
        h.try_collect()
    };
    let stop = free_run[3];
    let first = free_run.iter().position(|&t| t == stop).unwrap();
    let h = e
        .submit(req(1, 8).with_sampling(SamplingParams {
            stop_ids: vec![stop],
            ..SamplingParams::greedy()
        }))
        .unwrap();
    e.run_until_idle();
    let (tokens, outcome) = h.try_collect();
    assert_eq!(tokens, free_run[..=first]);
    assert_eq!(outcome, Some(Outcome::Finished(FinishReason::Stop(stop))));
    assert!(e.pool_stats().is_full());
}

#[test]
fn bad_requests_are_rejected_at_once_with_typed_reasons() {
    let mut e = engine();
    let long = Request::new(RequestId(1), TenantId(1), vec![1; 129], 1);
    let r = e.submit(long).unwrap_err();
    assert!(matches!(r, Rejection::PromptTooLong { .. }));
    assert_eq!(r.http_status(), 413);
    let window = Request::new(RequestId(2), TenantId(1), vec![1; 100], 29);
    assert!(matches!(
        e.submit(window),
        Err(Rejection::ExceedsWindow { .. })
    ));
    let oov = Request::new(RequestId(3), TenantId(1), vec![1, 384], 1);
    assert!(matches!(
        e.submit(oov),
        Err(Rejection::InvalidToken {
            index: 1,
            token: 384,
            vocab: 384,
            ..
        })
    ));
    let bad_temp = req(4, 1).with_sampling(SamplingParams {
        temperature: f32::NAN,
        ..SamplingParams::greedy()
    });
    assert_eq!(e.submit(bad_temp).unwrap_err().http_status(), 400);
    let _h = e.submit(req(5, 2)).unwrap();
    assert!(matches!(
        e.submit(req(5, 2)),
        Err(Rejection::DuplicateId { .. })
    ));
    assert_eq!(
        e.pool_stats().in_use,
        0,
        "nothing was allocated for rejections"
    );
}

#[test]
fn cancellation_works_while_waiting_and_while_running() {
    let m = model();
    let c = cfg(&m);
    let opts = EngineOptions {
        limits: BatchLimits {
            max_running: 1,
            max_prefill_tokens: 1024,
        },
        ..EngineOptions::default()
    };
    let mut e = Engine::with_options(m, c, opts).unwrap();
    let running = e.submit(req(1, 50)).unwrap();
    let waiting = e.submit(req(2, 50)).unwrap();
    let gone = e.submit(req(3, 50)).unwrap();
    for _ in 0..5 {
        let _ = e.step();
    }
    assert_eq!((e.running(), e.waiting()), (1, 2));
    assert!(e.pool_stats().in_use > 0);

    // From another thread, through the canceller; and a client that left.
    let c = running.canceller();
    std::thread::spawn(move || c.cancel()).join().unwrap();
    waiting.cancel();
    drop(gone);
    let report = e.step();
    assert_eq!(report.cancelled, 3);
    let (tokens, outcome) = running.try_collect();
    assert_eq!(outcome, Some(Outcome::Cancelled));
    assert_eq!(
        Outcome::Cancelled.http_status(),
        499,
        "client closed request"
    );
    assert!(!tokens.is_empty() && tokens.len() < 50);
    assert_eq!(waiting.try_collect(), (vec![], Some(Outcome::Cancelled)));
    assert!(e.is_idle());
    assert!(e.pool_stats().is_full());
    // Cancelling something unknown is a no-op.
    assert!(!e.cancel(RequestId(99)));
}

#[test]
fn seeded_sampling_is_reproducible_and_seed_dependent() {
    let mut e = engine();
    let sampled = |seed| {
        req(1, 30).with_sampling(SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.9),
            seed,
            stop_ids: vec![],
            logprobs: None,
        })
    };
    let mut run = |r: Request| {
        let h = e.submit(r).unwrap();
        e.run_until_idle();
        h.try_collect().0
    };
    let a = run(sampled(7));
    assert_eq!(a, run(sampled(7)));
    assert_ne!(a, run(sampled(8)));
}

/// An engine that runs one request at a time, with request 1 running (one
/// token streamed) and request 2 waiting.
fn one_running_one_waiting() -> (Engine, RequestHandle, RequestHandle) {
    let m = model();
    let c = cfg(&m);
    let opts = EngineOptions {
        limits: BatchLimits {
            max_running: 1,
            max_prefill_tokens: 1024,
        },
        ..EngineOptions::default()
    };
    let mut e = Engine::with_options(m, c, opts).unwrap();
    let running = e.submit(req(1, 50)).unwrap();
    let waiting = e.submit(req(2, 50)).unwrap();
    let _ = e.step();
    (e, running, waiting)
}

#[test]
fn dropping_the_engine_tells_every_live_request() {
    let (e, running, waiting) = one_running_one_waiting();
    let pool = e.pool().clone();
    drop(e);
    assert_eq!(
        running.try_collect().1,
        Some(Outcome::Failed(EngineError::Shutdown))
    );
    assert!(matches!(
        waiting.try_collect().1,
        Some(Outcome::Rejected(Rejection::ShuttingDown { .. }))
    ));
    assert!(pool.stats().is_full());
}

#[test]
fn a_shut_down_engine_ends_live_requests_and_turns_later_ones_away() {
    let (mut e, running, waiting) = one_running_one_waiting();
    e.shutdown();
    let (tokens, outcome) = running.try_collect();
    assert_eq!(tokens.len(), 1);
    assert_eq!(outcome, Some(Outcome::Failed(EngineError::Shutdown)));
    assert!(matches!(
        waiting.try_collect(),
        (t, Some(Outcome::Rejected(Rejection::ShuttingDown { .. }))) if t.is_empty()
    ));
    assert!(e.is_idle());
    assert!(e.pool_stats().is_full());
    // The engine lives on for its stats; it admits nothing more.
    let late = e.submit(req(3, 4)).unwrap_err();
    assert!(matches!(late, Rejection::ShuttingDown { .. }));
    assert_eq!(late.http_status(), 503);
    assert_eq!(e.step(), Default::default());
    assert!(e.pool_stats().is_full());
}

#[test]
fn an_engine_refuses_a_configuration_that_does_not_fit_the_model() {
    let m = model();
    let wrong_geometry = EngineConfig::colocated(handoff::KvGeometry {
        n_layers: 2,
        ..m.kv_geometry(KvDtype::F32)
    })
    .max_context(128)
    .pool_tokens(1024)
    .build()
    .unwrap();
    assert!(matches!(
        Engine::new(model(), wrong_geometry),
        Err(EngineError::Geometry { .. })
    ));
    // A configuration built for another role does not compile here: see
    // the compile_fail examples in `handoff::config::role`.
    let too_long = EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(4096)
        .pool_tokens(8192)
        .build()
        .unwrap();
    assert!(matches!(
        Engine::new(m, too_long),
        Err(EngineError::ContextBeyondModel {
            max_context: 4096,
            model_max: 1024
        })
    ));
}

#[test]
fn an_engine_runs_on_its_own_thread_while_clients_wait() {
    fn assert_send<T: Send>() {}
    assert_send::<Engine>();
    let mut e = engine();
    let handles: Vec<_> = (0..4).map(|i| e.submit(req(i, 9)).unwrap()).collect();
    let worker = std::thread::spawn(move || {
        e.run_until_idle();
        e.pool_stats()
    });
    for h in handles {
        let (tokens, outcome) = h.wait();
        assert_eq!(tokens.len(), 9);
        assert_eq!(outcome, Outcome::Finished(FinishReason::Length));
    }
    assert!(worker.join().unwrap().is_full());
}

#[test]
fn a_full_queue_answers_429_and_admits_again_once_it_drains() {
    // The host's backpressure: at most `max_queue` requests wait at once.
    let m = model();
    let c = EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(128)
        .page_size(16)
        .pool_tokens(1024)
        .max_queue(2)
        .build()
        .unwrap();
    assert_eq!(c.max_queue(), 2);
    let mut e = Engine::new(m, c).unwrap();
    let a = e.submit(req(1, 4)).unwrap();
    let b = e.submit(req(2, 4)).unwrap();
    let full = e.submit(req(3, 4)).unwrap_err();
    assert_eq!(
        full,
        Rejection::QueueFull {
            id: RequestId(3),
            limit: 2
        }
    );
    assert_eq!(full.http_status(), 429);
    e.run_until_idle();
    for h in [a, b] {
        let outcome = h.wait().1;
        assert!(matches!(outcome, Outcome::Finished(_)));
        assert_eq!(outcome.http_status(), 200);
    }
    assert_eq!(Outcome::Rejected(full.clone()).http_status(), 429);
    let c = e.submit(req(3, 4)).unwrap();
    e.run_until_idle();
    assert!(matches!(c.wait().1, Outcome::Finished(_)));
    assert!(e.pool_stats().is_full());

    let refused = EngineConfig::colocated(model().kv_geometry(KvDtype::F32))
        .max_context(128)
        .pool_tokens(1024)
        .max_queue(0)
        .build();
    assert_eq!(
        refused.unwrap_err(),
        handoff::ConfigError::Zero { field: "max_queue" }
    );
}
