//! A GGUF file's metadata and tensor directory read back as they were
//! written, and the real SmolLM2 file's as llama.cpp's converter wrote them.

use handoff::model::gguf::{GgmlType, GgufArray, GgufFile, GgufValue, GgufWriter};

#[test]
fn a_written_file_reads_back_key_by_key_and_tensor_by_tensor() {
    let bytes = GgufWriter::new()
        .kv("general.architecture", GgufValue::String("llama".into()))
        .kv("llama.block_count", GgufValue::U32(2))
        .kv("llama.rope.freq_base", GgufValue::F32(10000.0))
        .kv("flag", GgufValue::Bool(true))
        .kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(GgufArray::String(vec!["<s>".into(), "é".into()])),
        )
        .kv(
            "tokenizer.ggml.scores",
            GgufValue::Array(GgufArray::F32(vec![0.0, -1.5])),
        )
        .kv(
            "nested",
            GgufValue::Array(GgufArray::Array(vec![GgufArray::I64(vec![-3])])),
        )
        .f32_tensor("a", &[3], &[1.0, 2.0, 3.0])
        .f32_tensor("b", &[2, 2], &[4.0, 5.0, 6.0, 7.0])
        .finish();
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.u64("llama.block_count").unwrap(), 2);
    assert_eq!(f.f32("llama.rope.freq_base").unwrap(), 10000.0);
    assert_eq!(f.metadata("flag").and_then(GgufValue::as_bool), Some(true));
    let tokens = f.metadata("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.as_str_array().unwrap(), ["<s>", "é"]);
    let scores = f.metadata("tokenizer.ggml.scores").unwrap();
    assert_eq!(scores.as_f32_array().unwrap(), [0.0, -1.5]);
    assert!(f.metadata("missing").is_none());
    assert_eq!(f.metadata_entries().count(), 7);

    let b = f.tensor("b").unwrap();
    assert_eq!(
        (b.dims(), b.ggml_type(), b.byte_len()),
        (&[2u64, 2][..], GgmlType::F32, 16)
    );
    let vals: Vec<f32> = f
        .tensor_bytes(b)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(vals, [4.0, 5.0, 6.0, 7.0]);
    assert_eq!(
        f.tensors().iter().map(|t| t.name()).collect::<Vec<_>>(),
        ["a", "b"]
    );
}

fn smollm2() -> Option<std::path::PathBuf> {
    crate::support::fetched_model("SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn smollm2_metadata_describes_the_published_model() {
    let Some(path) = smollm2() else { return };
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.u64("llama.block_count").unwrap(), 30);
    assert_eq!(f.u64("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.u64("llama.attention.head_count").unwrap(), 9);
    assert_eq!(f.u64("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(f.f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(f.str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.str("tokenizer.ggml.pre").unwrap(), "smollm");
    let tokens = f.metadata("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.as_str_array().unwrap().len(), 49152);
    let merges = f.metadata("tokenizer.ggml.merges").unwrap();
    assert_eq!(merges.as_str_array().unwrap().len(), 48900);
    assert!(
        f.str("tokenizer.chat_template")
            .unwrap()
            .contains("<|im_start|>")
    );
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.ggml_type(), GgmlType::Q8_0);
    assert_eq!(embd.dims(), [576, 49152]);
    assert_eq!(
        f.tensor("blk.0.attn_q.weight").unwrap().ggml_type(),
        GgmlType::Q4_1
    );
    assert_eq!(
        f.tensor("output_norm.weight").unwrap().ggml_type(),
        GgmlType::F32
    );
}
