//! The real Gemma 3 270M Q4_K_M GGUF file loads (quantized matrices kept
//! quantized; sliding window 512, a global layer every sixth, one KV head
//! of 256), tokenizes "Once upon a time" as its SentencePiece vocabulary
//! does (BOS added, no space prefix), and continues it greedily with the
//! tokens an independent implementation gives: the committed fixture
//! tests/fixtures/gemma3_270m_greedy.txt, made by
//! `scripts/make_gemma_fixtures.py --real` (llama.cpp's gguf-py
//! dequantizer and the float64 Gemma 3 forward pass that script writes from
//! the architecture). Skips, saying so, when the file is absent
//! (scripts/fetch-models.sh fetches it; CI runs that script first).

use handoff::backend::CpuBackend;
use handoff::model::{Model, RopeStyle};
use handoff::text::TextModel;

use crate::support::serving_path::handoff_greedy;

fn path() -> Option<std::path::PathBuf> {
    crate::support::fetched_model("gemma-3-270m-q4_k_m.gguf")
}

/// The fixture's line `tag ...` as ids.
fn line(tag: &str) -> Vec<u32> {
    let fixture = include_str!("../fixtures/gemma3_270m_greedy.txt");
    let l = fixture.lines().find_map(|l| l.strip_prefix(tag)).unwrap();
    l.trim().split(',').map(|t| t.parse().unwrap()).collect()
}

#[test]
fn gemma3_270m_continues_once_upon_a_time_with_the_references_tokens() {
    let Some(p) = path() else { return };
    let text = TextModel::load(&p).unwrap();
    let tok = text.tokenizer();
    let prompt = tok.encode("Once upon a time").unwrap();
    assert_eq!(prompt, line("prompt "), "BOS, then Once ▁upon ▁a ▁time");

    let m = Model::load(CpuBackend::with_threads(2), &p).unwrap();
    let c = m.config();
    assert_eq!((c.dim, c.n_layers, c.vocab_size), (640, 18, 262_144));
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (4, 1, 256));
    assert_eq!(c.rope_style, RopeStyle::Half);
    let g = c.gemma.expect("a Gemma config");
    assert_eq!((g.sliding_window, g.global_every), (512, 6));
    assert_eq!((c.rope_theta, g.local_rope_theta), (1e6, 1e4));
    assert!(c.tied_embeddings && c.qk_norm);

    let want = line("greedy ");
    let out = handoff_greedy(&m, &prompt, want.len(), 16);
    let said = tok.decode(&out, true).unwrap();
    eprintln!("{prompt:?} -> {out:?} = {said:?}");
    assert_eq!(out, want, "handoff vs the float64 reference: {said:?}");
    assert!(said.starts_with(", there was a"), "{said}");
}
