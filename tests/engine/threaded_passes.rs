//! A batch computed on several threads gives the numbers one thread gives,
//! bit for bit: whether the backend splits the batch into one whole pass
//! per thread (small models, weights in cache) or splits every op over the
//! threads (large models), every sequence's prefill and decode logits equal
//! those of a single-threaded pass. Threads are a speed knob, never a
//! change in what a request gets.

use handoff::backend::CpuBackend;
use handoff::kv::{KvSeq, Ready};
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId};

/// Prefill logits, then `steps` greedy decode steps' logits, for every
/// prompt, all in one batch.
fn run(m: &Model, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<f32>> {
    let pool = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 16, 256)).unwrap();
    let mut s = m.scratch();
    let mut out = Vec::new();
    let mut filling: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| pool.reserve(RequestId(i as u64), p.len() + steps).unwrap())
        .collect();
    let mut next: Vec<u32> = {
        let mut refs: Vec<_> = filling.iter_mut().collect();
        let ps: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let l = m.prefill(&mut s, &mut refs, &ps).unwrap();
        out.extend(l.to_vecs());
        l.rows().map(|r| argmax(r).unwrap()).collect()
    };
    let mut seqs: Vec<KvSeq<Ready>> = filling
        .into_iter()
        .zip(prompts)
        .map(|(f, p)| f.seal(p.len()).unwrap())
        .collect();
    for _ in 0..steps {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let l = m.decode(&mut s, &mut refs, &next).unwrap();
        out.extend(l.to_vecs());
        next = l.rows().map(|r| argmax(r).unwrap()).collect();
    }
    drop(seqs);
    assert!(pool.stats().is_full());
    out
}

fn prompts(n: usize, vocab: u32) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| {
            let len = 1 + (i * 29 % 40) as usize;
            (0..len as u32)
                .map(|j| (i * 131 + j * 17 + 3) % vocab)
                .collect()
        })
        .collect()
}

#[test]
fn a_batch_split_over_threads_gives_the_single_thread_numbers_bit_for_bit() {
    let w = random_weights(&ModelConfig::tiny_gqa(), 5);
    let ps = prompts(13, w.config.vocab_size as u32);
    let one = Model::new(CpuBackend::with_threads(1), w.clone()).unwrap();
    let reference = run(&one, &ps, 6);
    // One whole pass per thread (the model is far below the group limit),
    // with every op worth splitting so that nothing stays on one thread.
    let groups = CpuBackend::with_threads(3).min_parallel_work(1);
    // Every op split over the threads instead.
    let per_op = CpuBackend::with_threads(3)
        .min_parallel_work(1)
        .group_weight_bytes(0);
    for (name, backend) in [("groups", groups), ("per-op", per_op)] {
        let m = Model::new(backend, w.clone()).unwrap();
        let got = run(&m, &ps, 6);
        assert_eq!(got.len(), reference.len());
        for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name}: logits row {i} differ from the single-thread pass"
            );
        }
    }
}

#[test]
fn an_error_in_a_group_names_the_sequence_by_its_place_in_the_whole_batch() {
    let w = random_weights(&ModelConfig::tiny_gqa(), 5);
    let vocab = w.config.vocab_size as u32;
    let m = Model::new(CpuBackend::with_threads(2).min_parallel_work(1), w).unwrap();
    let pool = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 16, 64)).unwrap();
    let mut s = m.scratch();
    let mut seqs: Vec<_> = (0..10)
        .map(|i| pool.reserve(RequestId(i), 16).unwrap())
        .collect();
    // Sequence 7 (in the second group) asks for more than it reserved.
    let mut ps: Vec<Vec<u32>> = (0..10).map(|i| vec![(i * 7) % vocab; 4]).collect();
    ps[7] = vec![1; 17];
    let mut refs: Vec<_> = seqs.iter_mut().collect();
    let p: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
    let err = m.prefill(&mut s, &mut refs, &p).unwrap_err();
    assert_eq!(err.culprit(), Some(7), "{err}");
    // Nothing was appended for a batch refused before it ran.
    assert!(
        seqs.iter()
            .all(|q| q.written_per_layer().iter().all(|&n| n == 0))
    );
    drop(seqs);
    assert!(pool.stats().is_full());
}

/// Group passes hold KV locks while they run. Ops inside a group must not
/// wait on other threads (a waiting rayon worker may pick up another
/// group's pass, which then blocks on the lock its own thread holds): many
/// steps with every op eligible for splitting finish, and give the
/// single-thread numbers.
#[test]
fn group_passes_whose_ops_could_split_never_deadlock() {
    let w = random_weights(&ModelConfig::tiny_gqa(), 9);
    let ps = prompts(24, w.config.vocab_size as u32);
    let reference = run(
        &Model::new(CpuBackend::with_threads(1), w.clone()).unwrap(),
        &ps,
        40,
    );
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for threads in [2, 3, 4] {
            let b = CpuBackend::with_threads(threads).min_parallel_work(1);
            let m = Model::new(b, w.clone()).unwrap();
            let got = run(&m, &ps, 40);
            let _ = tx.send(got == reference);
        }
    });
    for threads in [2, 3, 4] {
        match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(same) => assert!(same, "{threads} threads: logits differ"),
            Err(_) => panic!("{threads} threads: group passes did not finish in 120 s (deadlock)"),
        }
    }
}

#[test]
fn log_probabilities_come_back_on_their_own_rows_from_a_group_pass() {
    use handoff::SamplingParams;
    use handoff::sampling::Draw;
    let w = random_weights(&ModelConfig::tiny_gqa(), 5);
    let ps = prompts(13, w.config.vocab_size as u32);
    // The first and last rows ask: the 3 groups (by prompt tokens: rows
    // 0-4, 5-9, 10-12) leave the middle one with none.
    let asks = |i: usize| i == 0 || i == ps.len() - 1;
    let asking = SamplingParams {
        logprobs: Some(3),
        ..SamplingParams::greedy()
    };
    let draws: Vec<Draw> = (0..ps.len())
        .map(|i| match asks(i) {
            true => Draw::new(&asking, 0).unwrap(),
            false => Draw::greedy(),
        })
        .collect();
    let sample = |backend: CpuBackend| {
        let m = Model::new(backend, w.clone()).unwrap();
        let pool = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 16, 256)).unwrap();
        let mut s = m.scratch();
        let mut seqs: Vec<_> = ps
            .iter()
            .enumerate()
            .map(|(i, p)| pool.reserve(RequestId(i as u64), p.len()).unwrap())
            .collect();
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let p: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
        let got = m.prefill_sampled(&mut s, &mut refs, &p, &draws).unwrap();
        (0..ps.len())
            .map(|i| (got[i].clone().unwrap(), got.logprobs(i).cloned()))
            .collect::<Vec<_>>()
    };
    let one = sample(CpuBackend::with_threads(1));
    let groups = sample(CpuBackend::with_threads(3).min_parallel_work(1));
    assert_eq!(
        groups, one,
        "the same tokens and log-probabilities on every row"
    );
    for (i, (token, lp)) in one.iter().enumerate() {
        match lp {
            Some(lp) => assert!(asks(i) && lp.token == *token && lp.top.len() == 3),
            None => assert!(!asks(i), "row {i} asked"),
        }
    }
}
