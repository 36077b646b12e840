//! FP8 KV: a deployment that wants twice the context in the same memory
//! stores K and V as E4M3 bytes (`KvDtype::F8E4M3`), half of bf16's. The
//! window check counts those bytes, so a budget that holds the window in
//! FP8 builds and the same budget in bf16 is refused; the values lose
//! precision (3 mantissa bits), never isolation: decode output is the same
//! alone and in a batch, the pool returns to full, and the logits stay near
//! those of f32 KV within the bound stated here.

use handoff::backend::CpuBackend;
use handoff::kv::{KvPool, PoolConfig};
use handoff::model::{Model, ModelConfig, RopeStyle, random_weights};
use handoff::{ConfigError, Engine, EngineConfig, KvDtype, RequestId};

fn config() -> ModelConfig {
    ModelConfig {
        dim: 128,
        hidden_dim: 256,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 32,
        vocab_size: 256,
        max_seq_len: 128,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::Half,
        rope_scaling: Default::default(),
        norm_eps: 1e-5,
        tied_embeddings: true,
        attention_bias: false,
        qk_norm: false,
        gemma: None,
    }
}

fn model() -> Model {
    Model::new(CpuBackend::with_threads(2), random_weights(&config(), 21)).unwrap()
}

#[test]
fn a_budget_that_holds_the_window_in_fp8_is_refused_in_bf16() {
    let m = model();
    let fp8 = m.kv_geometry(KvDtype::F8E4M3);
    let bf16 = m.kv_geometry(KvDtype::BF16);
    assert_eq!(fp8.bytes_per_token() * 2, bf16.bytes_per_token());
    // Exactly the window twice over (the default headroom) in FP8 pages.
    let budget = (2 * 128 * fp8.bytes_per_token()) as u64;
    let built = EngineConfig::colocated(fp8)
        .max_context(128)
        .pool_memory(budget)
        .build()
        .unwrap();
    assert_eq!(built.pool_tokens(), 256);
    let refused = EngineConfig::colocated(bf16)
        .max_context(128)
        .pool_memory(budget)
        .build();
    assert!(
        matches!(refused, Err(ConfigError::BudgetCannotHoldWindow { .. })),
        "{refused:?}"
    );
}

/// Prefill of `prompt`, then a decode step for each of `forced` (the same
/// tokens for every dtype, so each step's logits compare like with like) on
/// a pool of `dtype`; every step's logits.
fn logits_with(m: &Model, dtype: KvDtype, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    let pool = KvPool::new(PoolConfig::new(m.kv_geometry(dtype), 16, 16)).unwrap();
    let mut seq = pool
        .reserve(RequestId(1), prompt.len() + forced.len())
        .unwrap();
    let mut scratch = m.scratch();
    let first = m.prefill(&mut scratch, &mut [&mut seq], &[prompt]).unwrap();
    let mut all = vec![first.row(0).to_vec()];
    let mut seq = seq.seal(prompt.len()).unwrap();
    for &token in forced {
        let out = m.decode(&mut scratch, &mut [&mut seq], &[token]).unwrap();
        all.push(out.row(0).to_vec());
    }
    drop(seq);
    assert!(pool.stats().is_full());
    all
}

fn rms(v: impl Iterator<Item = f64>) -> f64 {
    let (mut s, mut n) = (0.0, 0usize);
    for x in v {
        s += x * x;
        n += 1;
    }
    (s / n.max(1) as f64).sqrt()
}

#[test]
fn fp8_kv_logits_stay_within_the_stated_bound_of_f32_kv() {
    let m = model();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 256).collect();
    let forced: Vec<u32> = (0..8).map(|i| (i * 53 + 11) % 256).collect();
    let exact = logits_with(&m, KvDtype::F32, &prompt, &forced);
    let bf16 = logits_with(&m, KvDtype::BF16, &prompt, &forced);
    let fp8 = logits_with(&m, KvDtype::F8E4M3, &prompt, &forced);
    for (step, ((e, b), f)) in exact.iter().zip(&bf16).zip(&fp8).enumerate() {
        assert!(f.iter().all(|x| x.is_finite()), "step {step}");
        let scale = rms(e.iter().map(|&x| f64::from(x)));
        let err = |o: &[f32]| rms(o.iter().zip(e).map(|(&a, &b)| f64::from(a - b))) / scale;
        let (eb, ef) = (err(b), err(f));
        // The stated bound: FP8 KV moves the logits by at most 6% of their
        // RMS (this model: 3.0% to 4.3%). With 3 mantissa bits against
        // bf16's 8 its error is an order of magnitude above bf16's (here
        // 10 to 18 times), which shows the pages really hold E4M3 values.
        assert!(
            ef <= 0.06,
            "step {step}: FP8 KV error {ef:.4} of the logits' RMS"
        );
        assert!(
            ef > 5.0 * eb,
            "step {step}: FP8 {ef:.2e} against bf16 {eb:.2e}"
        );
        eprintln!("step {step}: relative RMS error bf16 {eb:.2e}, FP8 {ef:.2e}");
    }
}

fn generate(prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let m = model();
    let cfg = EngineConfig::colocated(m.kv_geometry(KvDtype::F8E4M3))
        .max_context(128)
        .page_size(16)
        .pool_tokens(1024)
        .build()
        .unwrap();
    let mut e = Engine::new(m, cfg).unwrap();
    let requests = crate::support::prompt_requests(prompts, 10);
    crate::support::finished_tokens(&mut e, requests)
}

#[test]
fn generation_on_fp8_kv_is_the_same_alone_and_in_a_batch() {
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|p| {
            (0..(4 + 11 * p))
                .map(|i| (i * 29 + p * 3 + 2) % 256)
                .collect()
        })
        .collect();
    let batched = generate(&prompts);
    for (p, want) in prompts.iter().zip(&batched) {
        assert_eq!(want.len(), 10);
        assert_eq!(&generate(std::slice::from_ref(p))[0], want);
    }
}
