//! A request whose prompt begins with a system prompt its tenant already
//! sent prefills only the rest, reading the cached pages through the same
//! validated views, and gets bit for bit the logits and greedy tokens it
//! gets computing everything itself, in f32 and bf16 KV and at page sizes
//! 1, 4 and 16. Another tenant with the same prompt reuses nothing.

use handoff::kv::{CacheSecret, Filling, KvSeq, PrefixCache};
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::{KvDtype, KvPool, PoolConfig, RequestId, TenantId};

const NEW_TOKENS: usize = 6;

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Prefills what `seq` has not reused of `prompt`, then decodes greedily;
/// returns every logit row (as bits) and the tokens.
fn generate(model: &Model, mut seq: KvSeq<Filling>, prompt: &[u32]) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut scratch = model.scratch();
    let rest = &prompt[seq.written(0)..];
    let first = model
        .prefill(&mut scratch, &mut [&mut seq], &[rest])
        .unwrap()
        .row(0)
        .to_vec();
    let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut rows = vec![bits(&first)];
    let mut tokens = vec![argmax(&first)];
    let mut seq = seq.seal(prompt.len()).unwrap();
    while tokens.len() < NEW_TOKENS {
        let last = *tokens.last().unwrap();
        let logits = model
            .decode(&mut scratch, &mut [&mut seq], &[last])
            .unwrap();
        rows.push(bits(logits.row(0)));
        tokens.push(argmax(logits.row(0)));
    }
    (rows, tokens)
}

#[test]
fn a_cache_hit_generates_bit_for_bit_what_a_full_prefill_generates() {
    let cfg = ModelConfig::tiny_gqa();
    let model = Model::cpu(random_weights(&cfg, 7)).unwrap();
    let vocab = cfg.vocab_size as u32;
    let system: Vec<u32> = (0..32).map(|i| (i * 7 + 3) % vocab).collect();
    let mut prompt = system.clone();
    prompt.extend([5 % vocab, 9 % vocab, 11 % vocab]);
    let total = prompt.len() + NEW_TOKENS;
    for dtype in [KvDtype::F32, KvDtype::BF16] {
        for page_size in [1, 4, 16] {
            let pool = KvPool::new(PoolConfig::new(
                model.kv_geometry(dtype),
                page_size,
                4 * total.div_ceil(page_size),
            ))
            .unwrap();
            let cache = PrefixCache::new(
                &pool,
                model.fingerprint().to_u64(),
                CacheSecret::from_bytes([1; 32]),
            );
            let case = format!("{dtype:?} page {page_size}");
            // Without the cache.
            let alone = generate(&model, pool.reserve(RequestId(1), total).unwrap(), &prompt);
            // The tenant's first request computes the prompt and publishes it.
            let tenant = TenantId(4);
            let keys = cache.keys(tenant, &prompt);
            let mut first = cache.reserve(RequestId(2), &keys, total).unwrap();
            let mut scratch = model.scratch();
            model
                .prefill(&mut scratch, &mut [&mut first], &[&prompt])
                .unwrap();
            assert!(cache.publish(&mut first, &keys).unwrap() > 0, "{case}");
            drop(first);
            // Its second request reuses every full page before the last token.
            let hit = cache.reserve(RequestId(3), &keys, total).unwrap();
            let reusable = (prompt.len() - 1) / page_size * page_size;
            assert_eq!(hit.reused_tokens(), reusable, "{case}");
            let with_hit = generate(&model, hit, &prompt);
            assert_eq!(with_hit.1, alone.1, "{case}: tokens");
            assert!(with_hit.0 == alone.0, "{case}: logits differ in some bit");
            // Another tenant, the same prompt: nothing reused.
            let other = cache.keys(TenantId(5), &prompt);
            let miss = cache.reserve(RequestId(4), &other, total).unwrap();
            assert_eq!(miss.reused_tokens(), 0, "{case}");
            assert_eq!(generate(&model, miss, &prompt).1, alone.1, "{case}");
            let st = pool.stats();
            assert!(
                st.is_full() && st.isolation_violations == 0,
                "{case}: {st:?}"
            );
        }
    }
}
