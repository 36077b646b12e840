//! The real SmolLM2-135M-Instruct Q4_1 GGUF file loads, with its quantized
//! matrices kept quantized, and continues a prompt greedily with the tokens
//! llama.cpp's own greedy decoding gives (fixtures made by
//! tools/llamacpp_greedy.sh from llama.cpp's binary). Skips, saying so,
//! when the file is absent (scripts/fetch-models.sh fetches it).

use std::path::{Path, PathBuf};

use handoff::backend::CpuBackend;
use handoff::kv::{KvSeq, Ready};
use handoff::model::gguf::GgufFile;
use handoff::model::{Model, RopeStyle};
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId};

fn path() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "SKIP: {} is absent; run scripts/fetch-models.sh",
            p.display()
        );
        None
    }
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
}
