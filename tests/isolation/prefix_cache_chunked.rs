//! A prompt prefilled over several steps, in the chunks the step planner
//! gives it beside running decodes, ends with the KV and logits of an
//! unchunked prefill, bit for bit, and then decodes the same tokens; so does
//! a prompt that starts from its tenant's cached prefix and is chunked after
//! it.

use handoff::kv::{CacheSecret, Filling, KvSeq, PrefixCache};
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::sched::{ChunkBudget, PartialPrefill, plan_chunks};
use handoff::{KvDtype, KvPool, PoolConfig, RequestId, TenantId};

fn bits(r: &[f32]) -> Vec<u32> {
    r.iter().map(|x| x.to_bits()).collect()
}

/// Prefills `prompt` into `seq` (after what it already holds) in the chunks
/// `budget` plans beside `decodes` running sequences; returns the last
/// chunk's logits and how many passes it took.
fn chunked(
    model: &Model,
    seq: &mut KvSeq<Filling>,
    prompt: &[u32],
    budget: ChunkBudget,
    decodes: usize,
) -> (Vec<u32>, usize) {
    let mut scratch = model.scratch();
    let mut p = PartialPrefill {
        id: seq.owner(),
        done: seq.written(0),
        total: prompt.len(),
    };
    let (mut last, mut passes) = (Vec::new(), 0);
    while p.remaining() > 0 {
        let c = plan_chunks(budget, decodes, &[p]);
        let chunk = &prompt[c[0].start..c[0].start + c[0].len];
        let logits = model
            .prefill(&mut scratch, &mut [&mut *seq], &[chunk])
            .unwrap();
        last = bits(logits.row(0));
        p.done += c[0].len;
        passes += 1;
    }
    (last, passes)
}

#[test]
fn chunked_prefill_is_bit_identical_to_unchunked_with_and_without_a_cache_hit() {
    let cfg = ModelConfig::tiny_gqa();
    let model = Model::cpu(random_weights(&cfg, 11)).unwrap();
    let vocab = cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..150).map(|i| (i * 13 + 1) % vocab).collect();
    let pool = KvPool::new(PoolConfig::new(model.kv_geometry(KvDtype::F32), 8, 128)).unwrap();
    let mut scratch = model.scratch();
    let mut whole = pool.reserve(RequestId(1), prompt.len() + 1).unwrap();
    let reference = bits(
        model
            .prefill(&mut scratch, &mut [&mut whole], &[&prompt])
            .unwrap()
            .row(0),
    );
    for (step_tokens, min_chunk, decodes) in [(40, 1, 32), (64, 16, 100), (7, 1, 0), (1000, 1, 5)] {
        let budget = ChunkBudget {
            step_tokens,
            min_chunk,
        };
        let mut seq = pool.reserve(RequestId(2), prompt.len() + 1).unwrap();
        let (logits, passes) = chunked(&model, &mut seq, &prompt, budget, decodes);
        assert_eq!(
            logits, reference,
            "budget {budget:?} beside {decodes} decodes"
        );
        let expected = prompt
            .len()
            .div_ceil(step_tokens.saturating_sub(decodes).max(min_chunk));
        assert_eq!(passes, expected, "budget {budget:?}");
        // Same KV: one decode step from each gives the same logits.
        let (mut a, mut b) = (
            seq.seal(prompt.len()).unwrap(),
            pool.reserve(RequestId(3), prompt.len() + 1).unwrap(),
        );
        model
            .prefill(&mut scratch, &mut [&mut b], &[&prompt])
            .unwrap();
        let mut b = b.seal(prompt.len()).unwrap();
        let la = bits(
            model
                .decode(&mut scratch, &mut [&mut a], &[3])
                .unwrap()
                .row(0),
        );
        let lb = bits(
            model
                .decode(&mut scratch, &mut [&mut b], &[3])
                .unwrap()
                .row(0),
        );
        assert_eq!(la, lb, "budget {budget:?}");
    }
    // A cache hit, then the rest in chunks.
    let cache = PrefixCache::new(
        &pool,
        model.fingerprint().to_u64(),
        CacheSecret::from_bytes([2; 32]),
    );
    let keys = cache.keys(TenantId(1), &prompt);
    let mut first = cache
        .reserve(RequestId(4), &keys, prompt.len() + 1)
        .unwrap();
    let budget = ChunkBudget {
        step_tokens: 48,
        min_chunk: 1,
    };
    assert_eq!(
        chunked(&model, &mut first, &prompt, budget, 16).0,
        reference
    );
    assert_eq!(cache.publish(&mut first, &keys).unwrap(), 150 / 8);
    drop(first);
    let mut hit = cache
        .reserve(RequestId(5), &keys, prompt.len() + 1)
        .unwrap();
    assert_eq!(hit.reused_tokens(), 144);
    let (logits, passes) = chunked(&model, &mut hit, &prompt, budget, 16);
    assert_eq!((logits, passes), (reference, 1));
    drop((hit, whole));
    assert!(pool.stats().is_full());
}
