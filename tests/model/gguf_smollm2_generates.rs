//! The real SmolLM2-135M-Instruct Q4_1 GGUF file loads, with its quantized
//! matrices kept quantized, and continues a prompt greedily with the tokens
//! an independent implementation gives: the committed fixture
//! tests/fixtures/smollm2_q4_1_greedy.txt, made by
//! scripts/gguf_greedy_reference.py (llama.cpp's gguf-py dequantizer and a
//! float64 numpy forward pass). Skips, saying so, when the file is absent
//! (scripts/fetch-models.sh fetches it).

use handoff::backend::CpuBackend;
use handoff::kv::{KvSeq, Ready};
use handoff::model::gguf::GgufFile;
use handoff::model::{Model, RopeStyle};
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId};

fn path() -> Option<std::path::PathBuf> {
    crate::support::fetched_model("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Token ids of space-separated words, looked up in the file's vocabulary
/// (GPT-2 byte-level: a leading space is "Ġ").
fn ids(f: &GgufFile, words: &[&str]) -> Vec<u32> {
    let vocab = f
        .metadata("tokenizer.ggml.tokens")
        .unwrap()
        .as_str_array()
        .unwrap();
    words
        .iter()
        .map(|w| {
            vocab
                .iter()
                .position(|t| t == w)
                .unwrap_or_else(|| panic!("{w} not in vocab")) as u32
        })
        .collect()
}

fn greedy(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let pool = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 16, 64)).unwrap();
    let mut scratch = m.scratch();
    let mut seq = pool.reserve(RequestId(1), prompt.len() + n).unwrap();
    let first = argmax(
        m.prefill(&mut scratch, &mut [&mut seq], &[prompt])
            .unwrap()
            .row(0),
    )
    .unwrap();
    let mut seq: KvSeq<Ready> = seq.seal(prompt.len()).unwrap();
    let mut out = vec![first];
    while out.len() < n {
        let t = *out.last().unwrap();
        let logits = m.decode(&mut scratch, &mut [&mut seq], &[t]).unwrap();
        out.push(argmax(logits.row(0)).unwrap());
    }
    out
}

#[test]
fn smollm2_continues_a_prompt_greedily() {
    let Some(p) = path() else { return };
    let f = GgufFile::open(&p).unwrap();
    let prompt = ids(&f, &["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]);
    let m = Model::load(CpuBackend::with_threads(2), &p).unwrap();
    assert_eq!(m.config().rope_style, RopeStyle::Interleaved);
    let out = greedy(&m, &prompt, 12);
    let vocab = f
        .metadata("tokenizer.ggml.tokens")
        .unwrap()
        .as_str_array()
        .unwrap();
    let text: String = out
        .iter()
        .map(|&t| vocab[t as usize].replace('Ġ', " "))
        .collect();
    eprintln!("prompt {prompt:?} -> {out:?} = {text:?}");
    assert!(text.contains("Paris"), "{text}");

    // The independent reference's greedy tokens for the same prompt.
    let fixture = include_str!("../fixtures/smollm2_q4_1_greedy.txt");
    let line = |tag: &str| -> Vec<u32> {
        let l = fixture.lines().find_map(|l| l.strip_prefix(tag)).unwrap();
        l.trim().split(',').map(|t| t.parse().unwrap()).collect()
    };
    assert_eq!(line("prompt "), prompt);
    assert_eq!(out, line("greedy "), "handoff vs the float64 reference");
}

fn prefill_logits(m: &Model, prompts: &[&[u32]]) -> Vec<Vec<u32>> {
    let pool = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 16, 64)).unwrap();
    let mut scratch = m.scratch();
    let mut seqs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| pool.reserve(RequestId(i as u64), p.len()).unwrap())
        .collect();
    let mut refs: Vec<_> = seqs.iter_mut().collect();
    let logits = m.prefill(&mut scratch, &mut refs, prompts).unwrap();
    (0..prompts.len())
        .map(|i| logits.row(i).iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn kept_quantized_the_model_computes_the_dequantized_models_bits_in_a_file_sized_footprint() {
    let Some(p) = path() else { return };
    let f = GgufFile::open(&p).unwrap();
    let a = ids(&f, &["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]);
    let b = ids(&f, &["Once", "Ġupon", "Ġa", "Ġtime"]);
    let kept = Model::load(CpuBackend::with_threads(2), &p).unwrap();
    let reference = Model::new(
        CpuBackend::with_threads(2),
        handoff::model::gguf::load_gguf(&p).unwrap(),
    )
    .unwrap();
    assert_eq!(kept.fingerprint(), reference.fingerprint());
    let together = prefill_logits(&kept, &[&a, &b]);
    assert_eq!(together, prefill_logits(&reference, &[&a, &b]));
    // Batch-invariant: each prompt alone gives its batched bits.
    assert_eq!(prefill_logits(&kept, &[&a])[0], together[0]);
    assert_eq!(prefill_logits(&kept, &[&b])[0], together[1]);

    let file = std::fs::metadata(&p).unwrap().len() as usize;
    let (q, r) = (kept.weight_bytes(), reference.weight_bytes());
    eprintln!("weights held: quantized {q} bytes, dequantized {r} bytes, file {file} bytes");
    assert!(
        q <= file && q * 10 >= file * 9,
        "quantized weights {q} vs file {file}"
    );
    assert!(r >= 3 * file);
}
