//! A batched pass handed inconsistent input refuses it before computing:
//! a typed error names the sequence at fault (so the engine fails only that
//! request), and no sequence of the batch has been written.

use handoff::model::{ForwardError, Model, ModelConfig, random_weights};
use handoff::{KvDtype, KvGeometry, KvPool, PoolConfig, RequestId};

fn setup() -> (Model, KvPool) {
    let m = Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 2)).unwrap();
    let pool = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 8, 32)).unwrap();
    (m, pool)
}

#[test]
fn the_sequence_at_fault_is_named_and_nobody_is_written() {
    let (m, pool) = setup();
    let mut s = m.scratch();
    let mut a = pool.reserve(RequestId(1), 8).unwrap();
    let mut b = pool.reserve(RequestId(2), 8).unwrap();

    // b's prompt does not fit its reservation.
    let err = m
        .prefill(&mut s, &mut [&mut a, &mut b], &[&[1, 2], &[1; 9]])
        .unwrap_err();
    assert!(matches!(
        err,
        ForwardError::Reservation {
            index: 1,
            needed: 9,
            reserved: 8,
            ..
        }
    ));
    assert_eq!(err.culprit(), Some(1));
    // A token outside the vocabulary.
    let err = m
        .prefill(&mut s, &mut [&mut a, &mut b], &[&[1, 384], &[1]])
        .unwrap_err();
    assert!(matches!(
        err,
        ForwardError::TokenOutOfRange {
            index: 0,
            token: 384,
            ..
        }
    ));
    // An empty input.
    let err = m
        .prefill(&mut s, &mut [&mut a, &mut b], &[&[1], &[]])
        .unwrap_err();
    assert_eq!(err, ForwardError::NoTokens { index: 1 });
    // One input per sequence.
    let err = m
        .prefill(&mut s, &mut [&mut a, &mut b], &[&[1]])
        .unwrap_err();
    assert!(matches!(
        err,
        ForwardError::BatchMismatch { seqs: 2, inputs: 1 }
    ));
    assert_eq!(
        m.prefill(&mut s, &mut [], &[]).unwrap_err(),
        ForwardError::EmptyBatch
    );

    assert_eq!(a.written_per_layer(), [0, 0, 0]);
    assert_eq!(b.written_per_layer(), [0, 0, 0]);
}

#[test]
fn incomplete_kv_and_foreign_pools_are_refused() {
    let (m, pool) = setup();
    let mut s = m.scratch();
    let mut a = pool.reserve(RequestId(1), 8).unwrap();
    // Only layer 0 written: the KV is incomplete.
    let kvd = 2 * 16;
    a.append(0, &vec![0.5; kvd], &vec![0.5; kvd]).unwrap();
    let err = m.prefill(&mut s, &mut [&mut a], &[&[1]]).unwrap_err();
    assert!(matches!(err, ForwardError::IncompleteKv { index: 0, .. }));

    let other = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 8, 4)).unwrap();
    let mut b = pool.reserve(RequestId(2), 8).unwrap();
    let mut c = other.reserve(RequestId(3), 8).unwrap();
    let err = m
        .prefill(&mut s, &mut [&mut b, &mut c], &[&[1], &[1]])
        .unwrap_err();
    assert_eq!(err, ForwardError::ForeignPool { index: 1 });

    let wrong = KvPool::new(PoolConfig::new(
        KvGeometry {
            n_layers: 2,
            ..m.kv_geometry(KvDtype::F32)
        },
        8,
        4,
    ))
    .unwrap();
    let mut d = wrong.reserve(RequestId(4), 8).unwrap();
    assert!(matches!(
        m.prefill(&mut s, &mut [&mut d], &[&[1]]),
        Err(ForwardError::Geometry {
            pool_layers: 2,
            model_layers: 3,
            ..
        })
    ));
}

#[test]
fn in_a_larger_batch_the_culprit_keeps_its_position_and_nobody_is_written() {
    let (m, pool) = setup();
    let mut s = m.scratch();
    let mut seqs: Vec<_> = (0..8)
        .map(|i| pool.reserve(RequestId(i), 8).unwrap())
        .collect();
    let mut refs: Vec<_> = seqs.iter_mut().collect();
    let long = [1u32; 9];
    let prompts: Vec<&[u32]> = (0..8)
        .map(|i| if i == 6 { &long[..] } else { &long[..2] })
        .collect();
    let err = m.prefill(&mut s, &mut refs, &prompts).unwrap_err();
    assert!(
        matches!(err, ForwardError::Reservation { index: 6, .. }),
        "{err:?}"
    );
    assert!(seqs.iter().all(|q| q.written_per_layer() == [0, 0, 0]));
}
