//! The side of a conformance test that goes through handoff's serving path,
//! shared by the tests that compare it with an independent reference.

use handoff::kv::{KvSeq, Ready};
use handoff::model::Model;
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId};

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
