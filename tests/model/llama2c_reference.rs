//! Story: handoff claims to serve llama2.c models exactly. This file checks
//! that claim against a second, independent derivation of the llama2.c
//! convention, written only from ../shared/models/README.md: its own file
//! reader (below) and a naive f64 forward pass with adjacent-pair RoPE and
//! grouped-query attention (tests/support/naive_llama.rs). Nothing on the reference side
//! goes through handoff's loader or math.
//!
//! Uses ../shared/models/stories260K.bin, a real trained model (GQA 8:4);
//! those tests skip with a message when it is absent. One test always runs:
//! seeded random weights written as a llama2.c file by handoff's writer,
//! read back by both sides.

use crate::support::naive_llama;
use crate::support::serving_path;

use std::io::Write;
use std::path::Path;

use handoff::model::{
    Model, ModelConfig, load_llama2c, parse_llama2c, random_weights, write_llama2c,
};
use naive_llama::{NaiveFreqScale, NaiveLayer, NaiveModel, NaiveRope};
use serving_path::handoff_greedy;

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/models/stories260K.bin"
);

fn model_bytes() -> Option<Vec<u8>> {
    match std::fs::read(Path::new(MODEL)) {
        Ok(b) => Some(b),
        Err(e) => {
            // Written with writeln! on stderr so the skip shows under the test harness.
            let mut err = std::io::stderr();
            let _ = writeln!(
                err,
                "skipping: {MODEL} is not readable ({e}); see ../shared/models/README.md"
            );
            None
        }
    }
}

/// The file, read the way README.md describes it.
struct Llama2c {
    model: NaiveModel,
    seq_len: usize,
    /// `freq_cis_real` and `freq_cis_imag`, `[seq_len][head_dim/2]` each.
    freq_cis: (Vec<f64>, Vec<f64>),
}

/// A cursor over little-endian int32/float32 values.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn i32(&mut self) -> i32 {
        let v = i32::from_le_bytes(self.bytes[self.at..self.at + 4].try_into().unwrap());
        self.at += 4;
        v
    }

    fn f32s(&mut self, n: usize) -> Vec<f64> {
        let end = self.at + 4 * n;
        let v = self.bytes[self.at..end]
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes(b.try_into().unwrap())))
            .collect();
        self.at = end;
        v
    }

    /// `[n_layers][n]` as one `Vec` per layer.
    fn per_layer(&mut self, n_layers: usize, n: usize) -> Vec<Vec<f64>> {
        (0..n_layers).map(|_| self.f32s(n)).collect()
    }
}

fn parse(bytes: &[u8]) -> Llama2c {
    let mut r = Reader { bytes, at: 0 };
    // 1. Header: seven int32.
    let h: Vec<i32> = (0..7).map(|_| r.i32()).collect();
    let [dim, hidden_dim, n_layers, n_heads, n_kv_heads] =
        [h[0], h[1], h[2], h[3], h[4]].map(|v| usize::try_from(v).unwrap());
    // A negative vocab_size means a separate classifier follows at the end.
    let shared = h[5] > 0;
    let vocab_size = h[5].unsigned_abs() as usize;
    let seq_len = usize::try_from(h[6]).unwrap();
    let head_dim = dim / n_heads;
    let (q_dim, kv_dim) = (n_heads * head_dim, n_kv_heads * head_dim);

    // 2. Tensors, in README order.
    let embedding = r.f32s(vocab_size * dim);
    let rms_att = r.per_layer(n_layers, dim);
    let wq = r.per_layer(n_layers, q_dim * dim);
    let wk = r.per_layer(n_layers, kv_dim * dim);
    let wv = r.per_layer(n_layers, kv_dim * dim);
    let wo = r.per_layer(n_layers, dim * q_dim);
    let rms_ffn = r.per_layer(n_layers, dim);
    let w1 = r.per_layer(n_layers, hidden_dim * dim);
    let w2 = r.per_layer(n_layers, dim * hidden_dim);
    let w3 = r.per_layer(n_layers, hidden_dim * dim);
    let final_norm = r.f32s(dim);
    let freq_real = r.f32s(seq_len * head_dim / 2);
    let freq_imag = r.f32s(seq_len * head_dim / 2);
    let output = if shared {
        embedding.clone()
    } else {
        r.f32s(vocab_size * dim)
    };
    assert_eq!(r.at, bytes.len(), "README layout accounts for every byte");

    let mut layers = Vec::new();
    for l in 0..n_layers {
        layers.push(NaiveLayer {
            attn_norm: rms_att[l].clone(),
            wq: wq[l].clone(),
            wk: wk[l].clone(),
            wv: wv[l].clone(),
            wo: wo[l].clone(),
            bq: None,
            bk: None,
            bv: None,
            ffn_norm: rms_ffn[l].clone(),
            w_gate: w1[l].clone(),
            w_down: w2[l].clone(),
            w_up: w3[l].clone(),
        });
    }
    Llama2c {
        model: NaiveModel {
            dim,
            hidden_dim,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            // README: "RMSNorm eps 1e-5", "RoPE base 10000", adjacent pairs.
            norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope: NaiveRope::AdjacentPairs,
            freq_scale: NaiveFreqScale::Plain,
            embedding,
            layers,
            final_norm,
            output,
        },
        seq_len,
        freq_cis: (freq_real, freq_imag),
    }
}

#[test]
fn the_reference_reads_the_readme_hyper_parameters() {
    let Some(bytes) = model_bytes() else { return };
    let f = parse(&bytes);
    let m = &f.model;
    assert_eq!((m.dim, m.hidden_dim, m.layers.len()), (64, 172, 5));
    assert_eq!((m.n_heads, m.n_kv_heads, m.head_dim), (8, 4, 8));
    assert_eq!((m.vocab_size, f.seq_len), (512, 512));
}

/// The largest difference between the RoPE tables stored in the file and
/// the reference's angles (pos * 10000^(-2i/head_dim) for pair i).
fn rope_table_error(f: &Llama2c) -> f64 {
    let half = f.model.head_dim / 2;
    let mut worst: f64 = 0.0;
    for pos in 0..f.seq_len {
        for i in 0..half {
            let freq = 10_000f64.powf(-((2 * i) as f64) / f.model.head_dim as f64);
            let (s, c) = (pos as f64 * freq).sin_cos();
            worst = worst
                .max((c - f.freq_cis.0[pos * half + i]).abs())
                .max((s - f.freq_cis.1[pos * half + i]).abs());
        }
    }
    worst
}

/// The file carries the RoPE tables it was trained with. The reference's
/// angles must reproduce them: this pins the base and each pair's
/// frequency independently of any forward pass.
#[test]
fn the_reference_rope_angles_match_the_tables_stored_in_the_file() {
    let Some(bytes) = model_bytes() else { return };
    let worst = rope_table_error(&parse(&bytes));
    // The tables are f32 (measured worst 2.3e-6, from f32 angles); a wrong
    // base or exponent is off by O(1) within a few positions.
    assert!(worst < 1e-5, "RoPE tables differ by {worst}");
}

/// handoff (f32, its own loader, paged batched kernels) against the f64
/// reference, as the largest absolute logit difference.
///
/// The bound. Both sides compute the same function, so the
/// difference is f32 rounding in handoff. Measured on stories260K (AVX2+FMA
/// kernels; the portable kernels do a little better): 1.4e-5 at position 0,
/// 5.2e-5 over 41 positions. A convention error costs far more (checked
/// below: the rotate-half convention moves logits by more than 1000x it).
const TOL: f64 = 1e-4;

/// The bound for stories260K's 301-token prompt, where f32 rounding does
/// not stay under [`TOL`]: measured worst 1.25e-4 with the AVX2+FMA kernels
/// (7.6e-5 with the portable ones), at position 53 (the first 54 positions
/// alone give the same figure: it is one sensitive position, not drift
/// growing with length). 2x the measurement, still 4000x below a
/// convention error.
const LONG_TOL: f64 = 2.5e-4;

/// A deterministic prompt: BOS then `n` pseudo-random token ids of
/// stories260K's vocabulary.
fn prompt(n: usize, seed: u64) -> Vec<u32> {
    prompt_in(n, seed, 512)
}

/// BOS then `n` pseudo-random token ids below `vocab`.
fn prompt_in(n: usize, seed: u64, vocab: u64) -> Vec<u32> {
    let mut s = seed;
    let mut out = vec![1];
    for _ in 0..n {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        out.push(((s >> 33) % vocab) as u32);
    }
    out
}

fn max_abs_diff(reference: &[Vec<f64>], ours: &[Vec<f32>]) -> (f64, usize) {
    assert_eq!(reference.len(), ours.len(), "positions");
    let mut worst = (0.0, 0);
    for (p, (r, o)) in reference.iter().zip(ours).enumerate() {
        assert_eq!(r.len(), o.len(), "vocab at position {p}");
        for (a, b) in r.iter().zip(o) {
            let d = (a - f64::from(*b)).abs();
            if d.is_nan() || d > worst.0 {
                worst = (d, p);
            }
        }
    }
    worst
}

fn handoff_model() -> Model {
    Model::cpu(load_llama2c(Path::new(MODEL)).unwrap()).unwrap()
}

#[test]
fn handoff_logits_match_the_reference_at_every_position() {
    let Some(bytes) = model_bytes() else { return };
    let reference = parse(&bytes).model;
    let model = handoff_model();
    for (n, seed) in [(0, 0), (40, 7), (300, 12345)] {
        let p = prompt(n, seed);
        let (d, pos) = max_abs_diff(
            &reference.logits_for_prompt(&p),
            &model.logits_for_prompt(&p).unwrap(),
        );
        let _ = writeln!(
            std::io::stderr(),
            "{} tokens: max |logit diff| {d:e} (at position {pos})",
            p.len()
        );
        let tol = if p.len() > 100 { LONG_TOL } else { TOL };
        assert!(
            d <= tol,
            "{} tokens: differs by {d:e} at position {pos}",
            p.len()
        );
    }
}

#[test]
fn the_tolerance_tells_rope_conventions_apart() {
    let Some(bytes) = model_bytes() else { return };
    let mut wrong = parse(&bytes).model;
    wrong.rope = NaiveRope::RotateHalf;
    let p = prompt(40, 7);
    let (d, _) = max_abs_diff(
        &wrong.logits_for_prompt(&p),
        &handoff_model().logits_for_prompt(&p).unwrap(),
    );
    assert!(d > 1000.0 * TOL, "rotate-half differs by only {d:e}");
}

#[test]
fn handoff_greedy_tokens_equal_the_reference() {
    let Some(bytes) = model_bytes() else { return };
    let reference = parse(&bytes).model;
    let model = handoff_model();
    // Prompts whose greedy paths stay clear of near-ties (this small model has
    // many: e.g. prompt(40, 7) meets a 1.7e-4 gap, below what rounding allows).
    for (p, n) in [(prompt(0, 0), 64), (prompt(40, 1), 32), (prompt(40, 3), 32)] {
        let (expected, gaps) = reference.greedy(&p, n);
        // Equality is only meaningful where no choice is within rounding of a tie.
        let min_gap = gaps.iter().cloned().fold(f64::INFINITY, f64::min);
        assert!(
            min_gap > 2.0 * TOL,
            "prompt of {}: top-2 gap {min_gap:e}",
            p.len()
        );
        assert_eq!(
            handoff_greedy(&model, &p, n, 16),
            expected,
            "prompt of {}",
            p.len()
        );
    }
}

/// Always runs, with or without stories260K: seeded random weights in the
/// llama2.c convention (adjacent-pair RoPE, base 10000, eps 1e-5), written
/// by handoff's llama2.c writer, untied and tied. The reference reads the
/// bytes with its own parser and its own forward pass; handoff reads them
/// with its loader and runs its model. Logits within the 1e-4 at
/// every position, greedy tokens exactly, and the bound still tells the
/// RoPE conventions apart.
#[test]
fn seeded_random_weights_in_a_llama2c_file_match_the_reference() {
    for tied in [false, true] {
        let cfg = ModelConfig {
            tied_embeddings: tied,
            max_seq_len: 128,
            ..ModelConfig::tiny_gqa()
        };
        let bytes = write_llama2c(&random_weights(&cfg, 260)).unwrap();
        let file = parse(&bytes);
        assert!(rope_table_error(&file) < 1e-5, "tied {tied}: RoPE tables");
        let reference = file.model;
        assert_eq!(reference.rope, NaiveRope::AdjacentPairs);
        let vocab = reference.vocab_size as u64;
        let model = Model::cpu(parse_llama2c(&bytes).unwrap()).unwrap();

        for (n, seed) in [(0, 0), (40, 7), (100, 12345)] {
            let p = prompt_in(n, seed, vocab);
            let (d, pos) = max_abs_diff(
                &reference.logits_for_prompt(&p),
                &model.logits_for_prompt(&p).unwrap(),
            );
            assert!(
                d <= TOL,
                "tied {tied}, {} tokens: differs by {d:e} at position {pos}",
                p.len()
            );
        }

        let mut wrong = parse(&bytes).model;
        wrong.rope = NaiveRope::RotateHalf;
        let p = prompt_in(40, 7, vocab);
        let (d, _) = max_abs_diff(
            &wrong.logits_for_prompt(&p),
            &model.logits_for_prompt(&p).unwrap(),
        );
        assert!(
            d > 1000.0 * TOL,
            "tied {tied}: rotate-half differs by only {d:e}"
        );

        for (p, new) in [(prompt_in(0, 0, vocab), 24), (prompt_in(40, 3, vocab), 24)] {
            let (expected, gaps) = reference.greedy(&p, new);
            let min_gap = gaps.iter().cloned().fold(f64::INFINITY, f64::min);
            assert!(
                min_gap > 2.0 * TOL,
                "tied {tied}, prompt of {}: top-2 gap {min_gap:e}",
                p.len()
            );
            assert_eq!(
                handoff_greedy(&model, &p, new, 16),
                expected,
                "tied {tied}, prompt of {}",
                p.len()
            );
        }
    }
}
