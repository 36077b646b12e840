//! Incident-style check of a verify pass's rollback. A request drafts four
//! tokens the target will not produce; the verify pass writes their KV
//! (five rows: the last accepted token and the drafts, across a page
//! boundary), keeps one row, and must leave the other four unreadable:
//! a read of a rejected position is a typed error, never data; the pages
//! the drafts grew into are back on the free list, scrubbed (poison) with
//! no writer in the audit trail; the pool's counts add up at every step;
//! and the next decode overwrites the rolled-back slots, after which the
//! sequence's output is exactly an undrafted sequence's.

use handoff::engine::verify::{Proposal, verify};
use handoff::kv::{KvError, KvPool, KvSeq, PoolConfig, Ready};
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::sampling::{Draw, argmax};
use handoff::{KvDtype, RequestId, ScrubPolicy};

const PAGE: usize = 4;

fn sealed(model: &Model, pool: &KvPool, id: u64, prompt: &[u32]) -> (KvSeq<Ready>, u32) {
    let mut seq = pool.reserve(RequestId(id), prompt.len()).unwrap();
    let mut scratch = model.scratch();
    let logits = model
        .prefill(&mut scratch, &mut [&mut seq], &[prompt])
        .unwrap();
    let first = argmax(logits.row(0)).unwrap();
    (seq.seal(prompt.len()).unwrap(), first)
}

fn accounted(pool: &KvPool) {
    let s = pool.stats();
    assert_eq!(s.free + s.in_use + s.held + s.cached, s.capacity, "{s:?}");
}

/// The next `n` greedy tokens of `seq` after `next`, one decode at a time.
fn decode(model: &Model, seq: &mut KvSeq<Ready>, mut next: u32, n: usize) -> Vec<u32> {
    let mut scratch = model.scratch();
    let mut out = Vec::new();
    for _ in 0..n {
        let len = seq.complete_len().unwrap();
        seq.ensure_capacity(len + 1).unwrap();
        let logits = model
            .decode(&mut scratch, &mut [&mut *seq], &[next])
            .unwrap();
        next = argmax(logits.row(0)).unwrap();
        out.push(next);
    }
    out
}

#[test]
fn rejected_draft_rows_are_unreadable_and_their_pages_come_back_scrubbed() {
    let cfg = ModelConfig::tiny_gqa();
    let model = Model::cpu(random_weights(&cfg, 9)).unwrap();
    let geometry = model.kv_geometry(KvDtype::F32);
    let pool = KvPool::new(
        PoolConfig::new(geometry, PAGE, 32)
            .audit(true)
            .scrub(ScrubPolicy::Poison),
    )
    .unwrap();
    // Seven prompt tokens: the pass writes positions 7..12, pages 1 to 2.
    let prompt = [3u32, 14, 15, 92, 65, 35, 89];
    let (mut seq, next) = sealed(&model, &pool, 1, &prompt);
    let (mut twin, twin_next) = sealed(&model, &pool, 2, &prompt);
    assert_eq!(next, twin_next);
    let pages_before = seq.pages().len();
    accounted(&pool);

    // What the target says after `next`: draft anything else.
    let truth = decode(&model, &mut twin, twin_next, 6);
    let vocab = cfg.vocab_size as u32;
    let drafts: Vec<u32> = truth[..4].iter().map(|&t| (t + 1) % vocab).collect();
    let verdicts = {
        let mut props = [Proposal {
            seq: &mut seq,
            next,
            drafts,
        }];
        verify(&model, &mut model.scratch(), &mut props, |_| Draw::greedy()).unwrap()
    };
    let v = &verdicts[0];
    // The first draft is wrong: the target's own token replaces it, and
    // only the row of `next` stays.
    assert_eq!(v.tokens, [Ok(truth[0])]);
    assert_eq!(v.drafted, 4);
    assert_eq!((v.settled.kept, v.settled.rolled_back), (1, 4));
    assert_eq!(seq.complete_len(), Some(prompt.len() + 1));
    // Positions 8..12 grew the sequence by a page it no longer needs.
    assert_eq!(
        v.settled.pages_returned,
        seq.pages().len() + 1 - pages_before
    );
    assert!(v.settled.pages_returned >= 1);
    assert_eq!(seq.pages().len(), pages_before);
    accounted(&pool);
    assert_eq!(pool.stats().in_use, seq.pages().len() + twin.pages().len());
    // Every free page, the returned one included, holds poison and no writer.
    for index in 0..pool.capacity() as u32 {
        if !seq
            .pages()
            .iter()
            .chain(twin.pages())
            .any(|p| p.index() == index)
        {
            assert!(pool.audit_page_matches_scrub(index), "page {index}");
        }
    }

    // A read of a rejected position is refused, typed, in every layer.
    {
        let reader = pool.reader();
        let view = reader.seq(&seq).unwrap();
        let mut row = vec![0f32; geometry.kv_dim()];
        for layer in 0..geometry.n_layers {
            let l = view.layer(layer).unwrap();
            assert_eq!(l.len(), prompt.len() + 1);
            for pos in prompt.len() + 1..prompt.len() + 5 {
                assert!(l.key(pos).is_none());
                assert!(matches!(
                    l.copy_key_f32(pos, &mut row),
                    Err(KvError::Incomplete { .. })
                ));
                assert!(matches!(
                    l.copy_value_f32(pos, &mut row),
                    Err(KvError::Incomplete { .. })
                ));
            }
        }
    }

    // The next steps write over the rolled-back slots; the output is the
    // undrafted twin's, and the audit trail sees only the owner's writes.
    let after = decode(&model, &mut seq, truth[0], 5);
    assert_eq!(after, truth[1..]);
    {
        let reader = pool.reader();
        let view = reader.seq(&seq).unwrap();
        for layer in 0..geometry.n_layers {
            assert_eq!(view.layer(layer).unwrap().len(), prompt.len() + 6);
        }
    }
    assert_eq!(pool.stats().isolation_violations, 0);
    seq.release();
    twin.release();
    assert!(pool.stats().is_full());
}

#[test]
fn a_failed_verify_pass_leaves_the_sequence_where_it_stood() {
    let cfg = ModelConfig::tiny_gqa();
    let model = Model::cpu(random_weights(&cfg, 4)).unwrap();
    let pool = KvPool::new(PoolConfig::new(model.kv_geometry(KvDtype::F32), PAGE, 16)).unwrap();
    let (mut seq, next) = sealed(&model, &pool, 1, &[1, 2, 3]);
    let pages = seq.pages().len();
    // A draft outside the vocabulary fails the pass, typed, before a row
    // counts: nothing it wrote is readable, and no page it grew stays.
    let bad = cfg.vocab_size as u32 + 5;
    let err = {
        let mut props = [Proposal {
            seq: &mut seq,
            next,
            drafts: vec![1, bad, 2, 3, 4, 5],
        }];
        verify(&model, &mut model.scratch(), &mut props, |_| Draw::greedy()).unwrap_err()
    };
    assert_eq!(err.culprit(), Some(0));
    assert_eq!(seq.complete_len(), Some(3));
    assert_eq!(seq.pages().len(), pages);
    accounted(&pool);
    seq.release();
    assert!(pool.stats().is_full());
}
