//! Engine internals that no public path reaches deterministically.

use super::*;
use crate::config::EngineConfig;
use crate::engine::FinishReason;
use crate::ids::TenantId;
use crate::kv::KvDtype;
use crate::model::{ModelConfig, random_weights};

/// An engine over 8 pages of 16 tokens.
fn engine() -> Engine {
    let m = Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 3)).unwrap();
    let cfg = EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(64)
        .page_size(16)
        .pool_tokens(128)
        .build()
        .unwrap();
    Engine::new(m, cfg).unwrap()
}

/// The plan admitted [A, B, C, D] but the pool, when asked, had room for A
/// only (the plan and the pool disagreed about free pages: here because
/// pages were taken between planning and prefill). B, C and D must go back
/// to the head of the queue as [B, C, D]: FIFO order is the scheduler's
/// promise against starvation, and a pool hiccup must not reorder it.
#[test]
fn requests_the_pool_cannot_take_go_back_in_queue_order() {
    let mut e = engine();
    let mut handles = Vec::new();
    // A and C, D need one page each (prompt + 1 token); B needs three.
    for (id, len) in [(1, 4), (2, 40), (3, 4), (4, 4)] {
        let req = Request::new(RequestId(id), TenantId(0), vec![5; len], 2);
        handles.push(e.submit(req).unwrap());
    }
    let admit: Vec<Request> = std::iter::from_fn(|| e.sched.pop_if(|_| true)).collect();
    // Five of the eight pages go elsewhere: A fits in what is left, B does not.
    let hog = e.pool.reserve(RequestId(99), 5 * 16).unwrap();

    e.start_filling(admit);
    let started = e.prefill();
    let started_ids: Vec<u64> = started.iter().map(|r| r.req.id.0).collect();
    assert_eq!(started_ids, [1]);
    let queued: Vec<Request> = std::iter::from_fn(|| e.sched.pop_if(|_| true)).collect();
    let queued_ids: Vec<u64> = queued.iter().map(|r| r.id.0).collect();
    assert_eq!(
        queued_ids,
        [2, 3, 4],
        "the unplaced requests keep queue order"
    );

    // Put everything back and let the engine finish: nothing was lost.
    for req in queued.into_iter().rev() {
        e.sched.requeue_front(req);
    }
    for r in started {
        e.core.start(r);
    }
    drop(hog);
    e.run_until_idle();
    for h in handles {
        let (tokens, outcome) = h.try_collect();
        assert_eq!(tokens.len(), 2);
        assert_eq!(outcome, Some(Outcome::Finished(FinishReason::Length)));
    }
    assert!(e.pool_stats().is_full());
}

/// Client records live in slots that a new request reuses once the old one
/// ends. Were a sequence still running after its request ended (a bug
/// elsewhere), its next token must not reach the request that took over
/// the slot: each record knows its own id, and the decode pass checks it.
#[test]
fn a_reused_client_slot_never_receives_another_requests_token() {
    let mut e = engine();
    let old = e
        .submit(Request::new(RequestId(1), TenantId(0), vec![5; 4], 8))
        .unwrap();
    e.step();
    assert_eq!(e.running(), 1);
    let slot = e.core.slot_of(RequestId(1)).unwrap();
    // The request ends but, unlike every real path, its sequence is left
    // running.
    assert!(e.core.end(RequestId(1), Outcome::Cancelled));
    e.sched.finish(RequestId(1));
    let new = e
        .submit(Request::new(RequestId(2), TenantId(0), vec![7; 4], 3))
        .unwrap();
    assert_eq!(
        e.core.slot_of(RequestId(2)),
        Some(slot),
        "the slot is reused"
    );
    // A decode pass of the stale sequence streams to nobody.
    let ended = e.core.decode().ok().unwrap();
    assert!(ended.is_empty());
    assert!(
        new.events().try_recv().is_err(),
        "request 2 got request 1's token"
    );
    assert!(e.core.stop_running(RequestId(1)).is_some());
    e.run_until_idle();
    let (tokens, outcome) = new.try_collect();
    assert_eq!(tokens.len(), 3, "request 2 streamed exactly its own tokens");
    assert_eq!(outcome, Some(Outcome::Finished(FinishReason::Length)));
    let (tokens, outcome) = old.try_collect();
    assert_eq!(tokens.len(), 1, "request 1 streamed its first token only");
    assert_eq!(outcome, Some(Outcome::Cancelled));
    assert!(e.pool_stats().is_full());
}

/// Many requests start and end in turn, so slots are freed and reused
/// while others run: each handle gets exactly its own count of tokens.
#[test]
fn requests_ending_and_starting_in_turn_each_stream_their_own_tokens() {
    let mut e = engine();
    let mut handles = Vec::new();
    for id in 0..12u64 {
        let max_new = 1 + (id as usize * 5) % 7;
        let req = Request::new(RequestId(id), TenantId(0), vec![3 + id as u32; 2], max_new);
        handles.push((max_new, e.submit(req).unwrap()));
        e.step();
    }
    e.run_until_idle();
    for (max_new, h) in handles {
        let (tokens, outcome) = h.try_collect();
        assert_eq!(tokens.len(), max_new);
        assert_eq!(outcome, Some(Outcome::Finished(FinishReason::Length)));
    }
    assert!(e.pool_stats().is_full());
}
