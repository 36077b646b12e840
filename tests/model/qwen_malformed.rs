//! Story: a Qwen2 or Qwen3 checkpoint written wrong (a q/k norm of the
//! wrong length or missing, a bias missing, a tensor of another
//! architecture, an o_proj bias the pass lacks) is a typed error naming the
//! tensor or key, found from the file's directory before any weight is
//! converted or placed; never a model that computes something else.
//!
//! Every case damages one thing of the valid fixtures written by
//! scripts/make_qwen_fixtures.py (tests/model/qwen_reference.rs shows them
//! load and conform).

use std::path::Path;

use handoff::model::ModelError;
use handoff::model::gguf::{GgufError, load_gguf_bytes};

use crate::support::damaged::{assert_norm_length_refused, hf_refused, refused, rewrite};

const QWEN2: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny_qwen2_gguf/model.gguf"
);
const QWEN3: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny_qwen3/model.gguf"
);
const QWEN3_HF: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny_qwen3/hf");

#[test]
fn the_rewritten_fixtures_load_so_every_failure_below_is_the_damage() {
    for (path, arch) in [(QWEN2, "qwen2"), (QWEN3, "qwen3")] {
        let w = load_gguf_bytes(rewrite(path, arch, Some, vec![])).unwrap();
        let want = handoff::model::gguf::load_gguf(Path::new(path)).unwrap();
        assert_eq!(w, want, "{arch}");
    }
}

#[test]
fn a_qwen3_q_norm_of_the_wrong_length_is_refused_by_name() {
    // One gain per head element: 32. A converter that wrote one per q
    // element (128), or the stream width (64), is caught.
    assert_norm_length_refused(
        QWEN3,
        "qwen3",
        "blk.1.attn_q_norm.weight",
        32,
        &[16, 64, 128],
    );
}

#[test]
fn a_qwen3_without_a_k_norm_is_refused_by_name() {
    let bytes = rewrite(
        QWEN3,
        "qwen3",
        |e| (e.0 != "blk.0.attn_k_norm.weight").then_some(e),
        vec![],
    );
    match refused(bytes) {
        GgufError::MissingTensor(t) => assert_eq!(t, "blk.0.attn_k_norm.weight"),
        other => panic!("{other}"),
    }
}

#[test]
fn a_qwen2_without_a_bias_is_refused_by_name() {
    let bytes = rewrite(
        QWEN2,
        "qwen2",
        |e| (e.0 != "blk.1.attn_v.bias").then_some(e),
        vec![],
    );
    match refused(bytes) {
        GgufError::MissingTensor(t) => assert_eq!(t, "blk.1.attn_v.bias"),
        other => panic!("{other}"),
    }
}

#[test]
fn tensors_of_another_architecture_are_refused_not_ignored() {
    // A q norm in a Qwen2 file would be silently skipped by a Qwen2 pass.
    let bytes = rewrite(
        QWEN2,
        "qwen2",
        Some,
        vec![("blk.0.attn_q_norm.weight".into(), vec![16], vec![1.0; 16])],
    );
    match refused(bytes) {
        GgufError::UnexpectedTensor(t) => assert_eq!(t, "blk.0.attn_q_norm.weight"),
        other => panic!("{other}"),
    }
    // A Qwen3 file relabelled llama: its norms are not llama's.
    match refused(rewrite(QWEN3, "llama", Some, vec![])) {
        GgufError::UnexpectedTensor(t) => assert!(t.contains("_norm.weight"), "{t}"),
        other => panic!("{other}"),
    }
    // A Qwen2 file relabelled qwen3: biases it does not have a use for,
    // norms it lacks.
    match refused(rewrite(QWEN2, "qwen3", Some, vec![])) {
        GgufError::MissingTensor(t) => assert_eq!(t, "blk.0.attn_q_norm.weight"),
        other => panic!("{other}"),
    }
}

#[test]
fn a_hugging_face_qwen3_with_a_bad_or_missing_norm_is_refused_by_name() {
    let unchanged = |_: &mut serde_json::Value| {};
    let short = hf_refused(
        QWEN3_HF,
        |n, s, d| {
            if n == "model.layers.1.self_attn.k_norm.weight" {
                Some((vec![16], d[..64].to_vec()))
            } else {
                Some((s, d))
            }
        },
        unchanged,
    );
    match short {
        ModelError::Shape {
            tensor,
            expected,
            got,
        } => {
            assert!(tensor.contains("layers.1.self_attn.k_norm"), "{tensor}");
            assert_eq!((expected, got), (vec![32], vec![16]));
        }
        other => panic!("{other}"),
    }
    let missing = hf_refused(
        QWEN3_HF,
        |n, s, d| (n != "model.layers.0.self_attn.q_norm.weight").then_some((s, d)),
        unchanged,
    );
    match missing {
        ModelError::MissingTensor { tensor } => {
            assert!(tensor.contains("layers.0.self_attn.q_norm"), "{tensor}")
        }
        other => panic!("{other}"),
    }
}

#[test]
fn a_hugging_face_qwen3_asking_for_attention_biases_is_refused() {
    // Qwen3's attention_bias adds an o_proj bias the pass does not have.
    let e = hf_refused(
        QWEN3_HF,
        |_, s, d| Some((s, d)),
        |c| c["attention_bias"] = serde_json::Value::Bool(true),
    );
    assert!(
        matches!(&e, ModelError::InvalidConfig(m) if m.contains("attention_bias")),
        "{e}"
    );
    // Relabelled Qwen2, the same weights lack Qwen2's biases.
    let e = hf_refused(
        QWEN3_HF,
        |_, s, d| Some((s, d)),
        |c| c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]),
    );
    assert!(matches!(&e, ModelError::MissingTensor { .. }), "{e}");
}
