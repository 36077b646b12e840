//! The side of a conformance test that goes through handoff's serving path,
//! shared by the tests that compare it with an independent reference.

use handoff::kv::{KvSeq, Ready};
use handoff::model::Model;
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId};

use crate::support::hf_fixture::Case;

/// Greedy decoding through handoff's serving path: paged prefill of the
/// prompt (pages of `page_size` tokens), then one paged decode step per
/// token. Asserts that every page is back in the pool afterwards.
pub fn handoff_greedy(model: &Model, prompt: &[u32], n: usize, page_size: usize) -> Vec<u32> {
    let pool = KvPool::new(PoolConfig::new(
        model.kv_geometry(KvDtype::F32),
        page_size,
        (prompt.len() + n).div_ceil(page_size),
    ))
    .unwrap();
    let mut scratch = model.scratch();
    let mut seq = pool.reserve(RequestId(1), prompt.len() + n).unwrap();
    let logits = model
        .prefill(&mut scratch, &mut [&mut seq], &[prompt])
        .unwrap();
    let mut out = vec![argmax(logits.row(0)).unwrap()];
    let mut seq: KvSeq<Ready> = seq.seal(prompt.len()).unwrap();
    while out.len() < n {
        let last = *out.last().unwrap();
        let logits = model
            .decode(&mut scratch, &mut [&mut seq], &[last])
            .unwrap();
        out.push(argmax(logits.row(0)).unwrap());
    }
    drop(seq);
    assert!(pool.stats().is_full(), "pages back after generation");
    out
}

/// Every position's logits within `rel_tol` of the reference's, relative to
/// the row's largest magnitude.
pub fn assert_logits(model: &Model, cases: &[Case], rel_tol: f64, what: &str) {
    for case in cases {
        let ours = model.logits_for_prompt(&case.prompt).unwrap();
        assert_eq!(ours.len(), case.logits.len(), "{what}: positions");
        for (p, (row, want)) in ours.iter().zip(&case.logits).enumerate() {
            let scale = want.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            for (i, (&a, &b)) in row.iter().zip(want).enumerate() {
                let d = (f64::from(a) - b).abs();
                assert!(
                    d <= rel_tol * scale,
                    "{what}, prompt {:?}: logit {i} at position {p} is {a}, the reference's \
                     {b} (|diff| {d:e} > {rel_tol} x {scale})",
                    case.prompt
                );
            }
        }
    }
}

/// Greedy decoding of every case at once: one prefill batch of prompts of
/// different lengths, then decode steps of the whole batch, in pages of
/// `page_size` tokens. Every page comes back.
pub fn batch_greedy(model: &Model, cases: &[Case], page_size: usize) -> Vec<Vec<u32>> {
    let n = cases[0].greedy.len();
    let pages: usize = cases
        .iter()
        .map(|c| (c.prompt.len() + n).div_ceil(page_size))
        .sum();
    let pool = KvPool::new(PoolConfig::new(
        model.kv_geometry(KvDtype::F32),
        page_size,
        pages,
    ))
    .unwrap();
    let mut scratch = model.scratch();
    let mut filling: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            pool.reserve(RequestId(i as u64), c.prompt.len() + n)
                .unwrap()
        })
        .collect();
    let prompts: Vec<&[u32]> = cases.iter().map(|c| c.prompt.as_slice()).collect();
    let logits = model
        .prefill(
            &mut scratch,
            &mut filling.iter_mut().collect::<Vec<_>>(),
            &prompts,
        )
        .unwrap();
    let mut out: Vec<Vec<u32>> = logits.rows().map(|r| vec![argmax(r).unwrap()]).collect();
    let mut seqs: Vec<KvSeq<Ready>> = filling
        .into_iter()
        .zip(cases)
        .map(|(s, c)| s.seal(c.prompt.len()).unwrap())
        .collect();
    while out[0].len() < n {
        let last: Vec<u32> = out.iter().map(|o| *o.last().unwrap()).collect();
        let logits = model
            .decode(
                &mut scratch,
                &mut seqs.iter_mut().collect::<Vec<_>>(),
                &last,
            )
            .unwrap();
        for (o, r) in out.iter_mut().zip(logits.rows()) {
            o.push(argmax(r).unwrap());
        }
    }
    drop(seqs);
    assert!(pool.stats().is_full(), "pages back after generation");
    out
}
