//! Story: clients retry, and a request id is only the client's name for a
//! request.
//!
//! A client that cancels (or times out) and retries under the same id, or
//! sends a second request under an id still generating, must never see
//! another transfer's message applied to its own, nor its tokens go to
//! another handle. A transfer is named by its nonce; an ended transfer's
//! late messages are ignored and counted; an id stays taken on a decode
//! worker until its request has ended.

use crate::support;
use crate::support::pd;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use handoff::transfer::{
    Answer, CancelOutcome, DecodeLink, Nonce, PrefillLink, Receipt, ToDecode, ToPrefill, Transfer,
    TransferConfig, Verdict, synthetic,
};
use handoff::{
    AdmissionLimits, HttpStatus, KvDtype, KvPool, Outcome, PoolConfig, Rejection, Request,
    RequestId, TenantId,
};
use support::{RigSpec, outcome_of, request, rig};

const TARGET: RequestId = RequestId(10);
const PROMPT: usize = 40;

/// The client cancels while prefill computes and retries at once under the
/// same id. Prefill, not yet aware of the cancel, sends the first
/// transfer's KV and receipt: they land nowhere, and the retry verifies.
fn late_receipt_of_a_cancelled_transfer_spares_its_retry<T: Transfer>(t: T) {
    let mut rig = rig(&t, TransferConfig::default(), RigSpec::default());
    let _ = rig.decode.submit(request(TARGET.0, 1, PROMPT)).unwrap();
    let mut first = rig.prefill.next_job_within(Duration::from_secs(5)).unwrap();
    assert_eq!(rig.decode.cancel(TARGET), CancelOutcome::Fenced);
    let _ = rig
        .decode
        .submit(request(TARGET.0, 1, PROMPT))
        .expect("the id is free again once its transfer ended");
    synthetic::fill(first.seq_mut(), TARGET, PROMPT).unwrap();
    rig.prefill.complete(first, None).unwrap();
    // Prefill then serves the retry's plan.
    assert_eq!(rig.serve_one().unwrap(), TARGET);
    let (retry, rest) = outcome_of(rig.outcomes(1), TARGET);
    assert!(rest.is_empty(), "{rest:?}");
    let verified = retry
        .result
        .expect("the retry verifies: the late receipt was not applied to it");
    assert_eq!(
        synthetic::check(&rig.decode_pool, verified.seq(), TARGET).unwrap(),
        Ok(())
    );
    drop(verified);
    let stats = rig.decode.stats();
    assert_eq!(stats.ignored_receipts, 1, "the late receipt is counted");
    assert_eq!(stats.integrity_failures, 0);
    assert_eq!((stats.verified, stats.cancelled), (1, 1));
    rig.assert_clean();
}

/// Limits written for a larger pool than the one decode was given: a
/// request this pool can never hold is still rejected at once (413), not
/// queued forever in front of everyone else.
fn limits_cannot_admit_past_the_real_pool<T: Transfer>(t: T) {
    let cfg = TransferConfig::default();
    let (_prefill_link, decode_link) = t.connect(&cfg).unwrap();
    let pool = KvPool::new(PoolConfig::new(support::geometry(KvDtype::BF16), 16, 4)).unwrap();
    let mut decode = handoff::transfer::DecodeSide::new(
        decode_link,
        pool.clone(),
        AdmissionLimits::new(256, 32, 16),
        cfg,
    );
    let err = decode
        .submit(request(1, 1, 100))
        .expect_err("104 tokens never fit 4 pages of 16");
    assert!(matches!(err, Rejection::ExceedsPool { .. }), "{err:?}");
    assert_eq!(err.http_status(), 413);
    assert_eq!(decode.waiting(), 0);
    assert!(pool.stats().is_full());
}

/// Messages a flooding peer sends.
const FLOOD: u64 = 100_000;

/// A peer thread that sends [`FLOOD`] messages (`send(n)`, false once the
/// link is gone), then keeps its link open until dropped. Returns once the
/// whole flood is queued at the other end (over TCP, in the link's reader
/// thread by then).
struct Flooder {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Flooder {
    fn start(mut send: impl FnMut(u64) -> bool + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (sent_tx, sent) = crossbeam_channel::bounded(1);
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                for n in 1..=FLOOD {
                    if !send(n) {
                        break;
                    }
                }
                let _ = sent_tx.send(());
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        sent.recv_timeout(Duration::from_secs(60)).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        Flooder {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Flooder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `poll_1ms()` polls once for 1 ms and returns how many flood messages
/// have been counted so far: the first poll that reads any must return
/// with most of the flood unread, and later polls read all of it.
fn read_the_flood(mut poll_1ms: impl FnMut() -> u64) {
    let until = Instant::now() + Duration::from_secs(60);
    let mut seen = 0;
    while seen == 0 && Instant::now() < until {
        seen = poll_1ms();
    }
    assert!(
        seen > 0 && seen < FLOOD,
        "poll(1 ms) read {seen} of {FLOOD} messages in one call"
    );
    while seen < FLOOD && Instant::now() < until {
        seen = poll_1ms();
    }
    assert_eq!(seen, FLOOD, "every stray message counted");
}

/// A peer that sends without pause (stray receipts) does not keep decode's
/// `poll` past its timeout: it returns with most of the flood still unread,
/// and reads the rest on later calls.
fn a_flooding_peer_does_not_hold_poll<T: Transfer>(t: T)
where
    T::Prefill: Send + 'static,
{
    let cfg = TransferConfig::default();
    let (mut prefill_link, decode_link) = t.connect(&cfg).unwrap();
    let pool = KvPool::new(PoolConfig::new(support::geometry(KvDtype::BF16), 16, 8)).unwrap();
    let mut decode = handoff::transfer::DecodeSide::new(
        decode_link,
        pool.clone(),
        AdmissionLimits::new(64, 8, 16),
        cfg,
    );
    let flooder = Flooder::start(move |n| {
        let stray = Receipt {
            request: RequestId(1_000_000 + n),
            nonce: Nonce(n),
            layer_tokens: vec![1; 3],
            pages: vec![],
            page_checksums: vec![],
            writers: vec![],
            first_token: None,
            first_logprobs: None,
        };
        prefill_link.send(ToDecode::Receipt(stray)).is_ok()
    });
    read_the_flood(|| {
        let _ = decode.poll(Duration::from_millis(1));
        decode.stats().ignored_receipts
    });
    drop(flooder);
    drop(decode);
    assert!(pool.stats().is_full());
}

/// The same at the prefill end: a decode peer flooding it with stray
/// answers does not keep `poll` past its timeout.
fn a_flooding_peer_does_not_hold_prefill<T: Transfer>(t: T)
where
    T::Decode: Send + 'static,
{
    let cfg = TransferConfig::default();
    let (prefill_link, mut decode_link) = t.connect(&cfg).unwrap();
    let pool = KvPool::new(PoolConfig::new(support::geometry(KvDtype::BF16), 16, 8)).unwrap();
    let mut prefill = handoff::transfer::PrefillSide::new(
        prefill_link,
        pool.clone(),
        AdmissionLimits::new(64, 8, 16),
        cfg,
    );
    let flooder = Flooder::start(move |n| {
        let stray = Answer {
            request: RequestId(1_000_000 + n),
            nonce: Nonce(n),
            verdict: Verdict::Ack,
        };
        decode_link.send(ToPrefill::Answer(stray)).is_ok()
    });
    read_the_flood(|| {
        prefill.poll(Duration::from_millis(1)).unwrap();
        prefill.stats().ignored_answers
    });
    drop(flooder);
    assert!(pool.stats().is_full());
}

/// On a decode worker, a second request under the id of one still
/// generating is refused (409); the first finishes with its own tokens,
/// and once it has ended the id can be used again.
fn a_live_id_is_refused_until_its_request_ends<T: Transfer>(t: T) {
    let w = pd::weights();
    let mut pair = pd::Pair::start(&t, TransferConfig::default(), &w);
    let id = RequestId(1);
    let first = Request::new(id, TenantId(1), vec![3, 5, 7, 9], 40);
    let other = Request::new(id, TenantId(2), vec![11, 13], 8);
    // Each alone (the reference engine, too, refuses a duplicate id).
    let want = [
        pd::reference(&w, std::slice::from_ref(&first)).remove(0),
        pd::reference(&w, std::slice::from_ref(&other)).remove(0),
    ];
    let mut a = pair.submit(first);
    let deadline = Instant::now() + Duration::from_secs(30);
    while a.tokens.is_empty() {
        assert!(Instant::now() < deadline, "no token within 30 s");
        pair.decode.step();
        a.drain();
    }
    // The first request generates on verified KV; its transfer has ended.
    let b = pair.submit(other.clone());
    match &b.outcome {
        Some(Outcome::Rejected(r @ Rejection::DuplicateId { .. })) => {
            assert_eq!(r.http_status(), 409)
        }
        o => panic!("a second request under a live id must be refused, got {o:?}"),
    }
    // Every refusal is tallied, whatever refused it.
    let mut bad = Request::new(RequestId(2), TenantId(2), vec![11], 4);
    bad.sampling.temperature = f32::NAN;
    assert!(matches!(
        pair.submit(bad).outcome,
        Some(Outcome::Rejected(Rejection::InvalidSampling { .. }))
    ));
    assert_eq!(pair.decode.tally().rejected, 2);
    let mut reqs = [a];
    assert!(pair.run_until(&mut reqs, Instant::now() + Duration::from_secs(30)));
    let [a] = reqs;
    assert_eq!(a.judge(&want[0]), Ok("ok".to_string()));
    // Ended: the id is free again.
    let mut reqs = [pair.submit(other)];
    assert!(pair.run_until(&mut reqs, Instant::now() + Duration::from_secs(30)));
    assert_eq!(reqs[0].judge(&want[1]), Ok("ok".to_string()));
    pair.pools_return_to_full(Duration::from_secs(10)).unwrap();
    pair.stop().unwrap();
}

/// Prefill's queue of plans waiting for pages is bounded (its admission
/// limits' queue limit): a plan beyond it is aborted with a typed reason
/// that decode reports as 429, and prefill holds nothing for it.
fn plans_beyond_prefill_queue_are_turned_away_busy<T: Transfer>(t: T) {
    let cfg = TransferConfig::default();
    let (pl, dl) = t.connect(&cfg).unwrap();
    let g = support::geometry(KvDtype::BF16);
    // Prefill: two pages, so one 32-token plan at a time; one may wait.
    let prefill_pool = KvPool::new(PoolConfig::new(g, 16, 2)).unwrap();
    let decode_pool = KvPool::new(PoolConfig::new(g, 16, 32)).unwrap();
    let mut prefill = handoff::transfer::PrefillSide::new(
        pl,
        prefill_pool.clone(),
        AdmissionLimits::new(64, 2, 16).max_queue(1),
        cfg.clone(),
    );
    let mut decode = handoff::transfer::DecodeSide::new(
        dl,
        decode_pool.clone(),
        AdmissionLimits::new(64, 32, 16),
        cfg,
    );
    for id in 1..=3 {
        let _ = decode.submit(request(id, 1, 32)).unwrap();
    }
    // Prefill reads all three plans without starting any: the first
    // waits, the two behind it exceed the queue.
    let until = Instant::now() + Duration::from_secs(5);
    while prefill.stats().plans < 3 && Instant::now() < until {
        prefill.poll(Duration::from_millis(20)).unwrap();
    }
    let mut outcomes = Vec::new();
    while outcomes.len() < 2 && Instant::now() < until {
        outcomes.extend(decode.poll(Duration::from_millis(20)));
    }
    assert_eq!(outcomes.len(), 2, "{outcomes:?}");
    for o in &outcomes {
        let err = o.result.as_ref().expect_err("turned away");
        assert!(
            matches!(
                err,
                handoff::transfer::TransferError::Aborted {
                    reason: handoff::transfer::AbortReason::Busy { pending: 1 },
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(err.http_status(), 429);
    }
    // The first is served as usual.
    let mut job = prefill.next_job_within(Duration::from_secs(5)).unwrap();
    assert_eq!(job.request(), RequestId(1));
    synthetic::fill(job.seq_mut(), RequestId(1), 32).unwrap();
    prefill.complete(job, None).unwrap();
    let mut done = Vec::new();
    while done.is_empty() && Instant::now() < until + Duration::from_secs(5) {
        done = decode.poll(Duration::from_millis(20));
    }
    let (first, _) = outcome_of(done, RequestId(1));
    drop(first.result.expect("verified"));
    support::wait_until("prefill releasing the first request's source pages", || {
        let _ = prefill.poll(Duration::from_millis(20));
        prefill.held_transfers() == 0 && prefill_pool.stats().is_full()
    });
    assert!(decode_pool.stats().is_full());
}

on_both_transports! {
    late_receipt_of_a_cancelled_transfer_does_not_fail_the_retry_under_its_id =>
        late_receipt_of_a_cancelled_transfer_spares_its_retry;
    admission_is_bounded_by_the_pool_it_admits_into => limits_cannot_admit_past_the_real_pool;
    poll_returns_on_time_while_a_peer_floods_it => a_flooding_peer_does_not_hold_poll;
    prefill_poll_returns_on_time_while_a_peer_floods_it => a_flooding_peer_does_not_hold_prefill;
    a_decode_worker_refuses_a_second_request_under_a_live_id =>
        a_live_id_is_refused_until_its_request_ends;
    a_plan_beyond_prefill_queue_is_turned_away_busy => plans_beyond_prefill_queue_are_turned_away_busy;
}
