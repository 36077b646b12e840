//! Incident-style check of sampled speculative decoding. A seeded request
//! that drafts must give the same tokens run after run, and drafting must
//! not bend the distribution: over a fixed set of seeds, the frequencies
//! of the token at a position where drafts are in play match those of
//! undrafted sampling on a two-sample chi-square test (the seed sets are
//! disjoint, so the samples are independent).

use std::collections::BTreeMap;

use handoff::model::{Model, ModelConfig, random_weights};
use handoff::request::SpecConfig;
use handoff::{
    Engine, EngineConfig, EngineOptions, KvDtype, Request, RequestId, SamplingParams, TenantId,
};

const NEW: usize = 8;

fn engine(spec: Option<SpecConfig>) -> Engine {
    let model = Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 21)).unwrap();
    let cfg = EngineConfig::colocated(model.kv_geometry(KvDtype::F32))
        .max_context(64)
        .page_size(4)
        .pool_tokens(64 * 128)
        .build()
        .unwrap();
    // The engine's default drafts for every request.
    let opts = EngineOptions {
        prefix_cache: false,
        speculative: spec,
        ..EngineOptions::default()
    };
    Engine::with_options(model, cfg, opts).unwrap()
}

/// A prompt that repeats, so prompt lookup always has a guess.
const PROMPT: [u32; 12] = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8];

fn sampling(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: Some(6),
        seed,
        ..SamplingParams::greedy()
    }
}

fn run(e: &mut Engine, seeds: std::ops::Range<u64>) -> Vec<Vec<u32>> {
    let handles: Vec<_> = seeds
        .map(|s| {
            let r = Request::new(RequestId(s), TenantId(0), PROMPT.to_vec(), NEW)
                .with_sampling(sampling(s));
            e.submit(r).unwrap()
        })
        .collect();
    e.run_until_idle();
    let outs = handles.iter().map(|h| h.try_collect().0).collect();
    let stats = e.pool_stats();
    assert!(stats.is_full(), "{stats:?}");
    assert_eq!(stats.isolation_violations, 0);
    outs
}

#[test]
fn a_seed_fixes_drafted_sampling_run_to_run() {
    let spec = Some(SpecConfig::prompt_lookup(1, 2, 4));
    let a = run(&mut engine(spec), 0..24);
    let mut e = engine(spec);
    let b = run(&mut e, 0..24);
    assert_eq!(a, b);
    assert!(a.iter().all(|t| t.len() == NEW));
    let t = e.tally();
    assert!(t.drafted > 0 && t.accepted > 0, "{t:?}");
    // Alone or in a batch of 24: the same tokens.
    let alone = run(&mut engine(spec), 5..6);
    assert_eq!(alone[0], a[5]);
}

/// Upper 99.9% point of chi-square with `df` degrees of freedom
/// (Wilson-Hilferty).
fn chi2_999(df: usize) -> f64 {
    let d = df as f64;
    let z = 3.090_232;
    let h = 2.0 / (9.0 * d);
    d * (1.0 - h + z * h.sqrt()).powi(3)
}

/// Two-sample chi-square of equal-size samples `a` and `b` of tokens:
/// cells with fewer than 10 in both together pooled into one.
fn two_sample(a: &[u32], b: &[u32]) -> (f64, usize) {
    let mut cells: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
    for &t in a {
        cells.entry(t).or_default().0 += 1.0;
    }
    for &t in b {
        cells.entry(t).or_default().1 += 1.0;
    }
    let (mut big, mut rest) = (Vec::new(), (0.0, 0.0));
    for (_, (x, y)) in cells {
        if x + y >= 10.0 {
            big.push((x, y));
        } else {
            rest.0 += x;
            rest.1 += y;
        }
    }
    if rest.0 + rest.1 > 0.0 {
        big.push(rest);
    }
    let stat = big.iter().map(|(x, y)| (x - y) * (x - y) / (x + y)).sum();
    (stat, big.len() - 1)
}

#[test]
fn drafted_sampling_has_the_undrafted_distribution() {
    let n = 600u64;
    let mut drafted = engine(Some(SpecConfig::prompt_lookup(1, 2, 4)));
    let with = run(&mut drafted, 0..n);
    let without = run(&mut engine(None), n..2 * n);
    let t = drafted.tally();
    assert!(t.accepted > 0 && t.accepted < t.drafted, "{t:?}");
    // Positions 2 and 5: drafts are kept and rejected before both.
    for pos in [2, 5] {
        let a: Vec<u32> = with.iter().map(|t| t[pos]).collect();
        let b: Vec<u32> = without.iter().map(|t| t[pos]).collect();
        let (stat, df) = two_sample(&a, &b);
        assert!(df >= 3, "position {pos}: too few cells ({df})");
        assert!(
            stat < chi2_999(df),
            "position {pos}: chi2 {stat:.1} over {df} df (limit {:.1})",
            chi2_999(df)
        );
    }
}
