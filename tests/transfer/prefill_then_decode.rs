//! Prefilling n prompt tokens and then decoding gives exactly what feeding
//! the same tokens one decode step at a time from an empty sequence gives:
//! same logits bit for bit, same greedy continuation, whatever the page
//! size. A decode node that receives prefilled KV therefore continues
//! exactly where a colocated engine would.

use handoff::backend::{CpuBackend, Isa};
use handoff::kv::{KvSeq, Ready};
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId};

fn model() -> Model {
    Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 11)).unwrap()
}

/// The model on every instruction set this CPU has.
fn models() -> Vec<Model> {
    Isa::available()
        .into_iter()
        .map(|isa| {
            let b = CpuBackend::with_isa(2, isa).unwrap();
            Model::new(b, random_weights(&ModelConfig::tiny_gqa(), 11)).unwrap()
        })
        .collect()
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 5) % 384)
        .collect()
}

/// Greedy continuation of `n_new` tokens from a prefill of `p`.
fn via_prefill(m: &Model, pool: &KvPool, p: &[u32], n_new: usize) -> (Vec<f32>, Vec<u32>) {
    let mut s = m.scratch();
    let mut seq = pool.reserve(RequestId(1), p.len() + n_new).unwrap();
    let logits = m
        .prefill(&mut s, &mut [&mut seq], &[p])
        .unwrap()
        .row(0)
        .to_vec();
    let mut seq: KvSeq<Ready> = seq.seal(p.len()).unwrap();
    let mut out = vec![argmax(&logits).unwrap()];
    while out.len() < n_new {
        let l = m
            .decode(&mut s, &mut [&mut seq], &[*out.last().unwrap()])
            .unwrap();
        out.push(argmax(l.row(0)).unwrap());
    }
    (logits, out)
}

/// The same, but the prompt goes in one decode step per token.
fn token_by_token(m: &Model, pool: &KvPool, p: &[u32], n_new: usize) -> (Vec<f32>, Vec<u32>) {
    let mut s = m.scratch();
    let seq = pool.reserve(RequestId(2), p.len() + n_new).unwrap();
    let mut seq: KvSeq<Ready> = seq.seal(0).unwrap();
    let mut last = Vec::new();
    for &t in p {
        last = m
            .decode(&mut s, &mut [&mut seq], &[t])
            .unwrap()
            .row(0)
            .to_vec();
    }
    let mut out = vec![argmax(&last).unwrap()];
    while out.len() < n_new {
        let l = m
            .decode(&mut s, &mut [&mut seq], &[*out.last().unwrap()])
            .unwrap();
        out.push(argmax(l.row(0)).unwrap());
    }
    (last, out)
}

#[test]
fn prefill_then_decode_equals_token_by_token_decode() {
    for m in models() {
        for page_size in [1, 16, 64] {
            let pool = KvPool::new(PoolConfig::new(
                m.kv_geometry(KvDtype::F32),
                page_size,
                4096 / page_size,
            ))
            .unwrap();
            for (n, salt) in [(1, 0), (7, 1), (33, 2), (100, 3)] {
                let p = prompt(n, salt);
                let (la, a) = via_prefill(&m, &pool, &p, 24);
                let (lb, b) = token_by_token(&m, &pool, &p, 24);
                assert_eq!(
                    la, lb,
                    "page {page_size}, prompt {n}: last-position logits differ"
                );
                assert_eq!(a, b, "page {page_size}, prompt {n}: continuations differ");
                assert!(pool.stats().is_full());
            }
        }
    }
}

#[test]
fn chunked_prefill_equals_one_prefill_and_logits_for_prompt_matches() {
    let m = model();
    let pool = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 16, 64)).unwrap();
    let p = prompt(50, 4);
    let mut s = m.scratch();
    let mut seq = pool.reserve(RequestId(3), 50).unwrap();
    m.prefill(&mut s, &mut [&mut seq], &[&p[..20]]).unwrap();
    let chunked = m
        .prefill(&mut s, &mut [&mut seq], &[&p[20..]])
        .unwrap()
        .row(0)
        .to_vec();
    let all = m.logits_for_prompt(&p).unwrap();
    assert_eq!(all.len(), 50);
    assert_eq!(all[49], chunked);
    let (whole, _) = via_prefill(&m, &pool, &p, 1);
    assert_eq!(whole, chunked);
    // Every position's logits equal those of a prompt that stops there.
    let prefix = m.logits_for_prompt(&p[..13]).unwrap();
    assert_eq!(prefix[12], all[12]);
    drop(seq);
    assert!(pool.stats().is_full());
}
