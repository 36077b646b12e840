//! Seed inputs: small valid model files serialized from random weights of
//! tiny configs, and damaged variants of them. `fuzz/examples/seed_corpus.rs`
//! writes them into `fuzz/corpus/`; `tests/fuzz_regressions.rs` checks that
//! the valid ones load through the harness (so the harness is not refusing
//! everything) and the damaged ones are refused.
//!
//! A seed whose name starts with `valid-` must load; every other must be
//! refused.

use std::path::Path;

use handoff::model::{ModelConfig, ModelWeights, RopeStyle, random_weights, write_llama2c};

use super::HfInput;

pub type Seed = (String, Vec<u8>);

fn tiny(dim: usize, n_heads: usize, n_kv_heads: usize, n_layers: usize) -> ModelConfig {
    ModelConfig {
        dim,
        hidden_dim: dim + 2,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim: dim / n_heads,
        vocab_size: 5,
        max_seq_len: 3,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::Interleaved,
        rope_scaling: Default::default(),
        norm_eps: 1e-5,
        tied_embeddings: false,
        attention_bias: false,
        qk_norm: false,
        gemma: None,
    }
}

/// llama2.c files: tied and untied, MHA and GQA, one and two layers, then
/// truncations, a trailing word, a NaN weight and a versioned-format magic.
pub fn llama2c() -> Vec<Seed> {
    let configs = [
        (
            "tied-mha",
            ModelConfig {
                tied_embeddings: true,
                ..tiny(4, 2, 2, 1)
            },
        ),
        ("untied-gqa", tiny(8, 4, 2, 2)),
        ("untied-mqa", tiny(8, 2, 1, 1)),
    ];
    let mut out = Vec::new();
    for (i, (name, cfg)) in configs.into_iter().enumerate() {
        let bytes = write_llama2c(&random_weights(&cfg, i as u64)).unwrap();
        out.push((format!("valid-{name}"), bytes));
    }
    let base = out[1].1.clone();
    let n = base.len();
    for cut in [3, 28, 28 + 4 * 40, n / 2, n - 4, n - 1] {
        out.push((format!("cut-{cut}"), base[..cut].to_vec()));
    }
    let mut trailing = base.clone();
    trailing.extend_from_slice(&[0; 4]);
    out.push(("trailing".into(), trailing));
    let mut nan = base.clone();
    nan[28 + 4 * 41..28 + 4 * 42].copy_from_slice(&f32::NAN.to_le_bytes());
    out.push(("nan".into(), nan));
    let mut magic = base;
    magic[..4].copy_from_slice(&0x616b_3432i32.to_le_bytes());
    out.push(("versioned".into(), magic));
    out
}

#[derive(Clone, Copy)]
enum Dtype {
    F32,
    F16,
    BF16,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
        }
    }

    fn encode(self, v: &[f32]) -> Vec<u8> {
        match self {
            Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dtype::F16 => v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            Dtype::BF16 => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }
}

/// `(name, shape, values)` of every tensor, under Hugging Face names.
fn hf_tensors(w: &ModelWeights) -> Vec<(String, Vec<usize>, &[f32])> {
    let c = &w.config;
    let (d, h) = (c.dim, c.hidden_dim);
    let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![c.vocab_size, d],
        &w.embedding[..],
    )];
    for (i, l) in w.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        t.push((p("input_layernorm.weight"), vec![d], &l.attn_norm));
        t.push((p("self_attn.q_proj.weight"), vec![qd, d], &l.wq));
        t.push((p("self_attn.k_proj.weight"), vec![kvd, d], &l.wk));
        t.push((p("self_attn.v_proj.weight"), vec![kvd, d], &l.wv));
        t.push((p("self_attn.o_proj.weight"), vec![d, qd], &l.wo));
        for (name, b, n) in [("q", &l.bq, qd), ("k", &l.bk, kvd), ("v", &l.bv, kvd)] {
            if let Some(b) = b {
                t.push((p(&format!("self_attn.{name}_proj.bias")), vec![n], b));
            }
        }
        t.push((p("post_attention_layernorm.weight"), vec![d], &l.ffn_norm));
        t.push((p("mlp.gate_proj.weight"), vec![h, d], &l.w1));
        t.push((p("mlp.down_proj.weight"), vec![d, h], &l.w2));
        t.push((p("mlp.up_proj.weight"), vec![h, d], &l.w3));
    }
    t.push(("model.norm.weight".to_string(), vec![d], &w.final_norm));
    if let Some(head) = &w.lm_head {
        t.push(("lm_head.weight".to_string(), vec![c.vocab_size, d], head));
    }
    t
}

/// A safetensors file: u64 header length, JSON header padded to 8 bytes,
/// then the data.
fn safetensors(tensors: &[(String, Vec<usize>, &[f32])], dtype: Dtype, meta: bool) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut data = Vec::new();
    if meta {
        entries.push(r#""__metadata__":{"format":"pt"}"#.to_string());
    }
    for (name, shape, v) in tensors {
        let start = data.len();
        data.extend(dtype.encode(v));
        entries.push(format!(
            r#""{name}":{{"dtype":"{}","shape":{shape:?},"data_offsets":[{start},{}]}}"#,
            dtype.name(),
            data.len()
        ));
    }
    let mut header = format!("{{{}}}", entries.join(","));
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

fn hf_config(c: &ModelConfig, arch: &str, extra: &str) -> String {
    format!(
        r#"{{"architectures":["{arch}"],"hidden_size":{},"intermediate_size":{},"num_hidden_layers":{},"num_attention_heads":{},"num_key_value_heads":{},"head_dim":{},"vocab_size":{},"max_position_embeddings":{},"rms_norm_eps":1e-05,"rope_theta":10000.0,"tie_word_embeddings":{},"hidden_act":"silu"{extra}}}"#,
        c.dim,
        c.hidden_dim,
        c.n_layers,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.max_seq_len,
        c.tied_embeddings
    )
}

fn hf_seed(
    config: &str,
    tensors: &[(String, Vec<usize>, &[f32])],
    dtype: Dtype,
    two: bool,
) -> Vec<u8> {
    if two {
        let (a, b) = tensors.split_at(tensors.len() / 2);
        HfInput::join(
            config.as_bytes(),
            &[&safetensors(a, dtype, true), &safetensors(b, dtype, false)],
        )
    } else {
        HfInput::join(config.as_bytes(), &[&safetensors(tensors, dtype, false)])
    }
}

/// Fixture `config.json` values replaced by tiny ones (same keys and
/// spelling as transformers writes them).
const SHRINK: [(&str, &str); 8] = [
    (r#""head_dim": 16"#, r#""head_dim": 4"#),
    (r#""hidden_size": 64"#, r#""hidden_size": 8"#),
    (r#""intermediate_size": 128"#, r#""intermediate_size": 6"#),
    (
        r#""max_position_embeddings": 128"#,
        r#""max_position_embeddings": 16"#,
    ),
    (r#""num_attention_heads": 4"#, r#""num_attention_heads": 2"#),
    (r#""num_hidden_layers": 2"#, r#""num_hidden_layers": 1"#),
    (r#""num_key_value_heads": 2"#, r#""num_key_value_heads": 1"#),
    (r#""vocab_size": 128"#, r#""vocab_size": 5"#),
];

/// Hugging Face inputs: the fixture's config.json shrunk with weights to
/// match, Llama/Mistral/Qwen2 configs in f32, f16 and bf16 over one and two
/// shards, and the real fixture's config and header with its data cut short.
pub fn hf(fixture_dir: &Path) -> Vec<Seed> {
    let fixture_cfg = std::fs::read_to_string(fixture_dir.join("config.json")).unwrap();
    let mut small_cfg = fixture_cfg.clone();
    for (from, to) in SHRINK {
        assert!(small_cfg.contains(from), "fixture config.json lacks {from}");
        small_cfg = small_cfg.replace(from, to);
    }
    let llama = ModelConfig {
        dim: 8,
        hidden_dim: 6,
        n_layers: 1,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 4,
        vocab_size: 5,
        max_seq_len: 16,
        rope_theta: 1000.0,
        rope_style: RopeStyle::Half,
        rope_scaling: Default::default(),
        norm_eps: 1e-5,
        tied_embeddings: false,
        attention_bias: false,
        qk_norm: false,
        gemma: None,
    };
    let mut out = Vec::new();
    let w = random_weights(&llama, 1);
    let t = hf_tensors(&w);
    out.push((
        "valid-fixture-shrunk".into(),
        hf_seed(&small_cfg, &t, Dtype::F32, false),
    ));
    out.push((
        "valid-fixture-shrunk-f16-2".into(),
        hf_seed(&small_cfg, &t, Dtype::F16, true),
    ));

    let qwen = ModelConfig {
        attention_bias: true,
        qk_norm: false,
        gemma: None,
        tied_embeddings: true,
        ..tiny(4, 2, 1, 2)
    };
    let w = random_weights(&qwen, 2);
    let cfg = hf_config(&qwen, "Qwen2ForCausalLM", r#","use_sliding_window":false"#);
    out.push((
        "valid-qwen2-bf16".into(),
        hf_seed(&cfg, &hf_tensors(&w), Dtype::BF16, false),
    ));

    // Llama 3's scaled RoPE, in the transformers 4 spelling.
    let llama3 = ModelConfig {
        rope_scaling: handoff::model::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8,
        },
        ..tiny(4, 2, 1, 2)
    };
    let w = random_weights(&llama3, 4);
    let cfg = hf_config(
        &llama3,
        "LlamaForCausalLM",
        r#","rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8}"#,
    );
    out.push((
        "valid-llama3-rope".into(),
        hf_seed(&cfg, &hf_tensors(&w), Dtype::BF16, false),
    ));

    let mistral = tiny(4, 2, 2, 1);
    let w = random_weights(&mistral, 3);
    let cfg = hf_config(&mistral, "MistralForCausalLM", r#","sliding_window":2"#);
    out.push((
        "valid-mistral-2".into(),
        hf_seed(&cfg, &hf_tensors(&w), Dtype::F32, true),
    ));

    // Tied, named by model_type only, with the tensors transformers may
    // store but never uses.
    let tied = ModelConfig {
        tied_embeddings: true,
        ..tiny(4, 2, 1, 1)
    };
    let w = random_weights(&tied, 4);
    let cfg = hf_config(&tied, "LlamaForCausalLM", "").replace(
        r#""architectures":["LlamaForCausalLM"],"#,
        r#""model_type":"llama","#,
    );
    let mut t = hf_tensors(&w);
    t.push((
        "lm_head.weight".into(),
        vec![tied.vocab_size, tied.dim],
        &w.embedding,
    ));
    let inv_freq = [1.0f32, 0.5];
    t.push((
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        vec![2],
        &inv_freq,
    ));
    out.push((
        "valid-llama-tied-extras".into(),
        hf_seed(&cfg, &t, Dtype::F16, false),
    ));

    // The real fixture, its data cut to 1 KiB past the header.
    let real = std::fs::read(fixture_dir.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(real[..8].try_into().unwrap()) as usize;
    let cut = &real[..8 + header_len + 1024];
    out.push((
        "fixture-truncated".into(),
        HfInput::join(fixture_cfg.as_bytes(), &[cut]),
    ));

    // One valid file, damaged: a wrong config, a missing tensor, a NaN.
    let w = random_weights(&llama, 1);
    let t = hf_tensors(&w);
    let st = safetensors(&t, Dtype::F32, false);
    let wrong = small_cfg.replace(r#""vocab_size": 5"#, r#""vocab_size": 6"#);
    out.push((
        "config-disagrees".into(),
        HfInput::join(wrong.as_bytes(), &[&st]),
    ));
    let missing = safetensors(&t[..t.len() - 1], Dtype::F32, false);
    out.push((
        "missing-tensor".into(),
        HfInput::join(small_cfg.as_bytes(), &[&missing]),
    ));
    let mut nan = st;
    let at = nan.len() - 4;
    nan[at..].copy_from_slice(&f32::NAN.to_le_bytes());
    out.push(("nan".into(), HfInput::join(small_cfg.as_bytes(), &[&nan])));
    out
}

/// A plan as decode really sends it (two layers, three pages).
fn real_plan() -> handoff::transfer::Plan {
    use handoff::transfer::{DecodeSide, InProcess, PrefillLink, ToPrefill, Transfer};
    use handoff::{
        AdmissionLimits, KvDtype, KvGeometry, KvPool, PoolConfig, Request, RequestId, TenantId,
    };
    let g = KvGeometry {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 2,
        dtype: KvDtype::BF16,
    };
    let pool = KvPool::new(PoolConfig::new(g, 4, 4)).unwrap();
    let cfg = handoff::transfer::TransferConfig::default();
    let (mut p, d) = InProcess.connect(&cfg).unwrap();
    let mut decode = DecodeSide::new(d, pool, AdmissionLimits::new(16, 4, 4), cfg);
    let _ticket = decode
        .submit(Request::new(
            RequestId(7),
            TenantId(3),
            vec![5, 6, 7, 8, 9, 10, 11, 12, 13],
            2,
        ))
        .unwrap();
    match p.recv(std::time::Duration::from_secs(5)).unwrap() {
        Some(ToPrefill::Plan(plan)) => plan,
        other => panic!("expected a plan, got {other:?}"),
    }
}

/// TCP streams: each frame kind alone, then all of them in one stream.
/// Every seed is a whole, valid stream.
pub fn tcp_frames() -> Vec<Seed> {
    use handoff::transfer::tcp::frame::{Frame, Role, encode_frame};
    use handoff::transfer::{
        Abort, AbortReason, Answer, FailReason, Receipt, ToDecode, ToPrefill, Verdict, WriteBatch,
        WriterRun,
    };
    let plan = real_plan();
    let receipt = Receipt {
        request: plan.request,
        nonce: plan.nonce,
        layer_tokens: vec![plan.tokens; 2],
        pages: plan.pages.clone(),
        page_checksums: vec![0x1234_5678_9abc_def0; plan.pages.len()],
        writers: (0..2)
            .map(|layer| WriterRun {
                layer,
                start: 0,
                len: plan.tokens,
                writer: plan.request,
            })
            .collect(),
        first_token: Some(42),
        first_logprobs: None,
    };
    let kv = [7u8; 16];
    let frames: Vec<(&str, Frame<'_>)> = vec![
        ("hello", Frame::Hello(Role::Decode)),
        ("plan", Frame::ToPrefill(ToPrefill::Plan(plan.clone()))),
        (
            "answer",
            Frame::ToPrefill(ToPrefill::Answer(Answer {
                request: plan.request,
                nonce: plan.nonce,
                verdict: Verdict::Fail(FailReason::Integrity),
            })),
        ),
        ("credit", Frame::Credit(4096)),
        (
            "write",
            Frame::Write(
                WriteBatch {
                    request: plan.request,
                    nonce: plan.nonce,
                    layer: 1,
                    start: 4,
                    tokens: 2,
                },
                &kv,
            ),
        ),
        ("receipt", Frame::ToDecode(ToDecode::Receipt(receipt))),
        (
            "abort",
            Frame::ToDecode(ToDecode::Abort(Abort {
                request: plan.request,
                nonce: plan.nonce,
                reason: AbortReason::InvalidToken {
                    index: 3,
                    token: 99_999,
                    vocab: 32_000,
                },
            })),
        ),
    ];
    let mut out = Vec::new();
    let mut stream = Vec::new();
    for (seq, (name, frame)) in frames.iter().enumerate() {
        let mut one = Vec::new();
        encode_frame(&mut one, 0, frame);
        out.push((format!("valid-{name}"), one));
        encode_frame(&mut stream, seq as u32, frame);
    }
    out.push(("valid-stream".into(), stream));
    out
}

/// receipt_verify programs: the honest transfer in each dtype and a few
/// shapes, then one of each receipt edit and one write from each source.
/// Byte order is the harness's: dtype, layers, kv heads, head_dim, page
/// size, source page size, tokens, bystander tokens, bystander first,
/// changed position, write ops, (ops), skip rest, edits, (edits), duplicate.
pub fn receipt_verify() -> Vec<Seed> {
    let mut out = Vec::new();
    for dtype in 0..3u8 {
        out.push((
            format!("honest-{dtype}"),
            vec![dtype, 2, 1, 1, 3, 2, 9, 5, dtype & 1],
        ));
    }
    for kind in 0..12u8 {
        out.push((
            format!("edit-{kind}"),
            vec![0, 1, 0, 0, 1, 2, 6, 4, 1, 2, 0, 0, 1, kind, 1, 1, 1],
        ));
    }
    for src in 0..3u8 {
        // One write op: layer 0, from the landed position (0), 4 tokens
        // from `src`, right request and nonce; then the rest honestly.
        out.push((
            format!("write-from-{src}"),
            vec![2, 1, 1, 0, 2, 3, 7, 3, 0, 4, 1, src, 0, 1, 3, 1, 2, 0, 0, 0],
        ));
    }
    out
}

/// `w` as a GGUF file of architecture `llama`: matrices as f32, or as Q8_0
/// blocks (dims must then be multiples of 32), norms f32.
fn gguf_of(w: &ModelWeights, q8: bool) -> Vec<u8> {
    use handoff::model::gguf::{GgmlType, GgufValue, GgufWriter};
    let c = &w.config;
    let u = |v: usize| GgufValue::U64(v as u64);
    let mut out = GgufWriter::new()
        .kv("general.architecture", GgufValue::String("llama".into()))
        .kv("llama.block_count", u(c.n_layers))
        .kv("llama.embedding_length", u(c.dim))
        .kv("llama.feed_forward_length", u(c.hidden_dim))
        .kv("llama.attention.head_count", u(c.n_heads))
        .kv("llama.attention.head_count_kv", u(c.n_kv_heads))
        .kv("llama.context_length", u(c.max_seq_len))
        .kv("llama.rope.freq_base", GgufValue::F32(c.rope_theta))
        .kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(c.norm_eps),
        );
    let mat = |out: GgufWriter, name: &str, v: &[f32], rows: usize, cols: usize| {
        let dims = [cols as u64, rows as u64];
        if !q8 {
            return out.f32_tensor(name, &dims, v);
        }
        let bytes = v
            .chunks(32)
            .flat_map(|b| {
                let d = b.iter().fold(0f32, |a, x| a.max(x.abs())) / 127.0;
                let mut blk = half::f16::from_f32(d).to_bits().to_le_bytes().to_vec();
                blk.extend(
                    b.iter()
                        .map(|x| (if d > 0.0 { (x / d).round() } else { 0.0 }) as i8 as u8),
                );
                blk
            })
            .collect();
        out.tensor(name, &dims, GgmlType::Q8_0, bytes)
    };
    let (d, h) = (c.dim, c.hidden_dim);
    let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    out = mat(out, "token_embd.weight", &w.embedding, c.vocab_size, d);
    for (i, l) in w.layers.iter().enumerate() {
        let n = |t: &str| format!("blk.{i}.{t}.weight");
        out = out.f32_tensor(&n("attn_norm"), &[d as u64], &l.attn_norm);
        out = mat(out, &n("attn_q"), &l.wq, qd, d);
        out = mat(out, &n("attn_k"), &l.wk, kvd, d);
        out = mat(out, &n("attn_v"), &l.wv, kvd, d);
        out = mat(out, &n("attn_output"), &l.wo, d, qd);
        out = out.f32_tensor(&n("ffn_norm"), &[d as u64], &l.ffn_norm);
        out = mat(out, &n("ffn_gate"), &l.w1, h, d);
        out = mat(out, &n("ffn_down"), &l.w2, d, h);
        out = mat(out, &n("ffn_up"), &l.w3, h, d);
    }
    out = out.f32_tensor("output_norm.weight", &[d as u64], &w.final_norm);
    if let Some(head) = &w.lm_head {
        out = mat(out, "output.weight", head, c.vocab_size, d);
    }
    out.finish()
}

/// GGUF files: f32 and Q8_0, tied and untied, then truncations, a lying
/// tensor count, a NaN norm and another architecture.
pub fn gguf() -> Vec<Seed> {
    let f32_cfg = ModelConfig {
        tied_embeddings: true,
        ..tiny(8, 4, 2, 1)
    };
    let q8_cfg = ModelConfig {
        hidden_dim: 64,
        ..tiny(32, 4, 2, 2)
    };
    let mut out = vec![
        (
            "valid-f32-tied".to_string(),
            gguf_of(&random_weights(&f32_cfg, 1), false),
        ),
        (
            "valid-f32-untied".to_string(),
            gguf_of(&random_weights(&tiny(8, 2, 1, 2), 2), false),
        ),
        (
            "valid-q8".to_string(),
            gguf_of(&random_weights(&q8_cfg, 3), true),
        ),
    ];
    let base = out[2].1.clone();
    let n = base.len();
    for cut in [3, 20, 100, n / 2, n - 1] {
        out.push((format!("cut-{cut}"), base[..cut].to_vec()));
    }
    let mut lying = base.clone();
    lying[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    out.push(("lying-tensor-count".into(), lying));
    let mut other = base.clone();
    let at = other.windows(5).position(|w| w == b"llama").unwrap_or(0);
    other[at..at + 5].copy_from_slice(b"gpt2x");
    out.push(("other-architecture".into(), other));
    let mut nan = gguf_of(&random_weights(&f32_cfg, 1), false);
    let len = nan.len();
    nan[len - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    out.push(("nan-norm".into(), nan));
    out
}
