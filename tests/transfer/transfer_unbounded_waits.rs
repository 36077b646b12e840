//! A host writes "no timeout" the way std's timeouts accept it,
//! `Duration::MAX`: in `DecodeWorker::step`, `PrefillWorker::step`, and in
//! the transfer config's receipt, ack and write timeouts. Before, each of
//! them panicked with "overflow when adding duration to instant" the first
//! time a deadline was computed, taking the worker's thread (and every
//! request on it) down. Now they wait as long as it takes, and a link that
//! ends still ends the wait with its typed error.

use crate::support;

use handoff::{Decode, DecodeWorker, Prefill, PrefillWorker, RoleKind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use handoff::model::Model;
use handoff::transfer::{InProcess, LinkError, Transfer, TransferConfig, TransferError};
use handoff::{EngineConfig, FinishReason, Outcome, Request, RequestId, TenantId};

fn model() -> Model {
    support::tiny_model(9)
}

fn cfg<R: RoleKind>(pool: usize) -> EngineConfig<R> {
    support::tiny_worker_config::<R>(pool)
}

/// Runs `f` on its own thread; fails on a panic or past 60 s.
fn bounded<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => t.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match t.join() {
            Ok(r) => r,
            Err(p) => panic!("the worker panicked: {p:?}"),
        },
        Err(e) => panic!("still waiting after 60 s: {e}"),
    }
}

#[test]
fn duration_max_timeouts_serve_a_request_to_the_end() {
    let t = TransferConfig::default()
        .with_receipt_timeout(Duration::MAX)
        .with_ack_timeout(Duration::MAX)
        .with_write_timeout(Duration::MAX);
    let (p, d) = InProcess.connect(&t).unwrap();
    let mut prefill = PrefillWorker::new(p, model(), cfg::<Prefill>(128), t.clone()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let prefill_thread = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let r = prefill.run(&stop);
            prefill.shutdown();
            (r, prefill.pool().stats())
        })
    };
    let (outcome, tokens, decode_pool) = bounded(move || {
        let mut decode = DecodeWorker::new(d, model(), cfg::<Decode>(256), t).unwrap();
        let h = decode
            .submit(Request::new(RequestId(1), TenantId(1), vec![2; 40], 6))
            .unwrap();
        decode.run_until_idle();
        let (tokens, outcome) = h.try_collect();
        (outcome, tokens, decode.pool().stats())
    });
    assert_eq!(outcome, Some(Outcome::Finished(FinishReason::Length)));
    assert_eq!(tokens.len(), 6);
    assert!(decode_pool.is_full());
    stop.store(true, Ordering::Release);
    let (run, prefill_pool) = prefill_thread.join().unwrap();
    // The decode worker was dropped first: prefill's link ended under it.
    assert!(matches!(
        run,
        Ok(()) | Err(TransferError::Link(LinkError::Disconnected))
    ));
    assert!(prefill_pool.is_full(), "{prefill_pool:?}");
}

#[test]
fn a_step_told_to_wait_forever_returns_when_the_link_ends() {
    let t = TransferConfig::default();
    let (p, d) = InProcess.connect(&t).unwrap();
    let mut decode = DecodeWorker::new(d, model(), cfg::<Decode>(256), t.clone())
        .unwrap()
        .with_idle_wait(Duration::MAX);
    let mut prefill = PrefillWorker::new(p, model(), cfg::<Prefill>(128), t).unwrap();

    // Decode waits for a receipt that will never come: its peer goes away.
    let h = decode
        .submit(Request::new(RequestId(1), TenantId(1), vec![2; 10], 3))
        .unwrap();
    prefill.shutdown();
    let (decode, outcome) = bounded(move || {
        decode.step();
        let (_, o) = h.try_collect();
        (decode, o)
    });
    assert!(
        matches!(
            outcome,
            Some(Outcome::Failed(handoff::EngineError::Transfer(
                TransferError::Link(LinkError::Disconnected)
            )))
        ),
        "{outcome:?}"
    );
    assert!(decode.pool().stats().is_full());
    drop(decode);

    // Prefill waits for a plan from a decode worker that is gone.
    let t = TransferConfig::default();
    let (p, d) = InProcess.connect(&t).unwrap();
    drop(d);
    let mut prefill = PrefillWorker::new(p, model(), cfg::<Prefill>(128), t).unwrap();
    let r = bounded(move || prefill.step(Duration::MAX));
    assert!(
        matches!(r, Err(TransferError::Link(LinkError::Disconnected))),
        "{r:?}"
    );
}

#[test]
fn a_bounded_run_until_idle_returns_while_a_silent_peer_holds_a_request() {
    // The prefill worker is never stepped: the request's plan is never
    // answered and, with no receipt timeout, would wait for ever.
    let t = TransferConfig::default().with_receipt_timeout(Duration::MAX);
    let (p, d) = InProcess.connect(&t).unwrap();
    let _silent = PrefillWorker::new(p, model(), cfg::<Prefill>(256), t.clone()).unwrap();
    let mut decode = DecodeWorker::new(d, model(), cfg::<Decode>(256), t).unwrap();
    let h = decode
        .submit(Request::new(RequestId(1), TenantId(1), vec![1, 2, 3], 4))
        .unwrap();
    let start = std::time::Instant::now();
    assert!(!decode.run_until_idle_within(Duration::from_millis(200)));
    assert!(start.elapsed() < Duration::from_secs(5), "the bound held");
    // The request is still live, and ends typed when the worker shuts down.
    decode.shutdown();
    assert!(matches!(h.wait().1, Outcome::Rejected(_)));
    assert!(decode.pool().stats().is_full());
}
