//! Story: a Gemma 3 checkpoint written wrong (a sliding window larger than
//! the context, a post norm of the wrong length or missing, a head_dim that
//! does not match the tensors, attention soft-capping the pass lacks, a
//! layer pattern it cannot serve, another architecture's tensors) is a typed
//! error naming the key or tensor, found from the metadata, config.json or
//! the file's directory before any weight is converted or placed; never a
//! model that computes something else.
//!
//! Every case damages one thing of the valid fixture written by
//! scripts/make_gemma_fixtures.py (tests/model/gemma_reference.rs shows it
//! loads and conforms).

use std::path::Path;

use handoff::model::ModelError;
use handoff::model::gguf::{GgufError, GgufValue, load_gguf_bytes};
use serde_json::json;

use crate::support::damaged::{
    assert_norm_length_refused, hf_refused, refused, rewrite, rewrite_kv,
};

const GEMMA: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny_gemma3/model.gguf"
);
const GEMMA_HF: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny_gemma3/hf");
const QWEN3: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny_qwen3/model.gguf"
);

/// The fixture with metadata key `key` set to `value`.
fn with_key(key: &'static str, value: GgufValue) -> Vec<u8> {
    rewrite_kv(
        GEMMA,
        "gemma3",
        move |k, v| Some(if k == key { value.clone() } else { v }),
        Some,
        vec![],
    )
}

/// The GGUF refusal is an invalid config whose message has `needle`.
fn invalid_config(e: GgufError, needle: &str) {
    match e {
        GgufError::InvalidConfig(m) => assert!(m.contains(needle), "{m} lacks {needle:?}"),
        other => panic!("expected an invalid config, got {other}"),
    }
}

/// The Hugging Face refusal is an invalid config whose message has
/// `needle`.
fn hf_invalid(e: ModelError, needle: &str) {
    match e {
        ModelError::InvalidConfig(m) => assert!(m.contains(needle), "{m} lacks {needle:?}"),
        other => panic!("expected an invalid config, got {other}"),
    }
}

fn keep(_: &str, s: Vec<usize>, d: Vec<u8>) -> Option<(Vec<usize>, Vec<u8>)> {
    Some((s, d))
}

#[test]
fn the_rewritten_fixture_loads_so_every_failure_below_is_the_damage() {
    let w = load_gguf_bytes(rewrite(GEMMA, "gemma3", Some, vec![])).unwrap();
    let want = handoff::model::gguf::load_gguf(Path::new(GEMMA)).unwrap();
    assert_eq!(w, want);
}

#[test]
fn a_window_larger_than_the_context_is_refused_before_anything_is_built() {
    // The context is 128; a window of 129, or one of 2^40 positions a
    // pool would be sized by, is refused from the metadata alone.
    for window in [129u64, 1 << 40] {
        let e = refused(with_key(
            "gemma3.attention.sliding_window",
            GgufValue::U64(window),
        ));
        invalid_config(e, "larger than the context");
    }
    invalid_config(
        refused(with_key(
            "gemma3.attention.sliding_window",
            GgufValue::U32(0),
        )),
        "must be positive",
    );
    let e = refused(rewrite_kv(
        GEMMA,
        "gemma3",
        |k, v| (k != "gemma3.attention.sliding_window").then_some(v),
        Some,
        vec![],
    ));
    assert!(
        matches!(&e, GgufError::MissingKey(k) if k == "gemma3.attention.sliding_window"),
        "{e}"
    );
    let e = hf_refused(GEMMA_HF, keep, |c| c["sliding_window"] = json!(1000));
    hf_invalid(e, "larger than the context");
}

#[test]
fn a_post_norm_of_the_wrong_length_or_missing_is_refused_by_name() {
    assert_norm_length_refused(
        GEMMA,
        "gemma3",
        "blk.2.post_ffw_norm.weight",
        64,
        &[32, 63, 128],
    );
    let bytes = rewrite(
        GEMMA,
        "gemma3",
        |e| (e.0 != "blk.4.post_attention_norm.weight").then_some(e),
        vec![],
    );
    match refused(bytes) {
        GgufError::MissingTensor(t) => assert_eq!(t, "blk.4.post_attention_norm.weight"),
        other => panic!("{other}"),
    }
    let short = hf_refused(
        GEMMA_HF,
        |n, s, d| {
            if n == "model.layers.3.post_feedforward_layernorm.weight" {
                Some((vec![32], d[..128].to_vec()))
            } else {
                Some((s, d))
            }
        },
        |_| {},
    );
    match short {
        ModelError::Shape {
            tensor,
            expected,
            got,
        } => {
            assert!(
                tensor.contains("layers.3.post_feedforward_layernorm"),
                "{tensor}"
            );
            assert_eq!((expected, got), (vec![64], vec![32]));
        }
        other => panic!("{other}"),
    }
    let missing = hf_refused(
        GEMMA_HF,
        |n, s, d| (n != "model.layers.0.pre_feedforward_layernorm.weight").then_some((s, d)),
        |_| {},
    );
    match missing {
        ModelError::MissingTensor { tensor } => {
            assert!(
                tensor.contains("layers.0.pre_feedforward_layernorm"),
                "{tensor}"
            )
        }
        other => panic!("{other}"),
    }
}

#[test]
fn a_head_dim_that_does_not_match_the_tensors_is_refused_by_name() {
    let bytes = rewrite_kv(
        GEMMA,
        "gemma3",
        |k, v| match k {
            "gemma3.attention.key_length" | "gemma3.attention.value_length" => {
                Some(GgufValue::U32(16))
            }
            _ => Some(v),
        },
        Some,
        vec![],
    );
    match refused(bytes) {
        GgufError::Shape {
            tensor, expected, ..
        } => {
            assert!(tensor.starts_with("blk.0."), "{tensor}");
            assert!(
                expected.contains(&16) || expected.contains(&64),
                "{expected:?}"
            );
        }
        other => panic!("{other}"),
    }
    // Keys that disagree with each other are refused from the metadata.
    invalid_config(
        refused(with_key(
            "gemma3.attention.value_length",
            GgufValue::U32(16),
        )),
        "differ from key heads",
    );
    let e = hf_refused(GEMMA_HF, keep, |c| c["head_dim"] = json!(16));
    assert!(
        matches!(&e, ModelError::Shape { tensor, .. } if tensor.contains("layers.0.self_attn")),
        "{e}"
    );
}

#[test]
fn what_the_pass_would_compute_differently_is_refused_not_ignored() {
    // Attention soft-capping (Gemma 2's) has no kernel.
    let e = hf_refused(GEMMA_HF, keep, |c| {
        c["attn_logit_softcapping"] = json!(50.0)
    });
    hf_invalid(e, "attn_logit_softcapping");
    // Another activation, bidirectional attention, RoPE scaling on the
    // local layers, a layer pattern that is not periodic.
    let e = hf_refused(GEMMA_HF, keep, |c| c["hidden_activation"] = json!("gelu"));
    hf_invalid(e, "hidden_activation");
    let e = hf_refused(GEMMA_HF, keep, |c| {
        c["use_bidirectional_attention"] = json!(true)
    });
    hf_invalid(e, "bidirectional");
    let e = hf_refused(GEMMA_HF, keep, |c| {
        c["rope_parameters"] = json!({
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        })
    });
    hf_invalid(e, "local layers rotate plainly");
    let e = hf_refused(GEMMA_HF, keep, |c| {
        c["layer_types"] = json!([
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention"
        ])
    });
    hf_invalid(e, "breaks the pattern");
    let e = hf_refused(GEMMA_HF, keep, |c| {
        c["layer_types"] = json!(["full_attention", "sliding_attention"])
    });
    hf_invalid(e, "names 2 layers");
    // The multimodal class is not the text model.
    let e = hf_refused(GEMMA_HF, keep, |c| {
        c["architectures"] = json!(["Gemma3ForConditionalGeneration"])
    });
    assert!(matches!(&e, ModelError::UnsupportedArchitecture(_)), "{e}");
}

#[test]
fn tensors_of_another_architecture_are_refused_not_ignored() {
    // A Qwen3 file relabelled gemma3 lacks Gemma's norms: its directory
    // is too short for the layers it claims.
    let e = refused(rewrite(QWEN3, "gemma3", Some, vec![]));
    invalid_config(e, "says 2 layers but the file holds 25 tensors");
    // A Gemma file relabelled qwen3: post norms a Qwen3 pass would skip.
    match refused(rewrite(GEMMA, "qwen3", Some, vec![])) {
        GgufError::UnexpectedTensor(t) => assert!(t.contains("post_"), "{t}"),
        other => panic!("{other}"),
    }
    // Relabelled Qwen3, the same Hugging Face weights have norms Qwen3
    // does not.
    let e = hf_refused(GEMMA_HF, keep, |c| {
        c["architectures"] = json!(["Qwen3ForCausalLM"]);
        c["hidden_act"] = json!("silu");
    });
    assert!(
        matches!(&e, ModelError::InvalidConfig(m) if m.contains("is not part of")),
        "{e}"
    );
}
