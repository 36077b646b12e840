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

use handoff::backend::CpuBackend;
use handoff::model::gguf::{GgufError, GgufFile, GgufValue, GgufWriter, load_gguf_bytes};
use handoff::model::{Model, ModelError, load_hf_bytes};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

const QWEN2: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny_qwen2_gguf/model.gguf"
);
const QWEN3: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny_qwen3/model.gguf"
);
const QWEN3_HF: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny_qwen3/hf");

/// One tensor of a file being rewritten: name, GGUF dims, f32 values.
type Entry = (String, Vec<u64>, Vec<f32>);

/// The fixture at `path` rewritten: architecture `arch` (metadata keys
/// renamed to its prefix), each tensor through `edit` (`None` drops it),
/// then `extra` appended.
fn rewrite(
    path: &str,
    arch: &str,
    edit: impl Fn(Entry) -> Option<Entry>,
    extra: Vec<Entry>,
) -> Vec<u8> {
    let f = GgufFile::open(Path::new(path)).unwrap();
    let old = f.architecture().unwrap().to_string();
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata_entries() {
        let v = if k == "general.architecture" {
            GgufValue::String(arch.into())
        } else {
            v.clone()
        };
        let k = match k.strip_prefix(&format!("{old}.")) {
            Some(rest) => format!("{arch}.{rest}"),
            None => k.to_string(),
        };
        w = w.kv(&k, v);
    }
    let entries = f.tensors().iter().map(|t| {
        let values = f
            .tensor_bytes(t)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (t.name().to_string(), t.dims().to_vec(), values)
    });
    for (name, dims, values) in entries.filter_map(edit).chain(extra) {
        w = w.f32_tensor(&name, &dims, &values);
    }
    w.finish()
}

/// Loads the bytes both ways a host can; they must refuse alike.
fn refused(bytes: Vec<u8>) -> GgufError {
    let whole = load_gguf_bytes(bytes.clone()).expect_err("the damaged file loaded");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let placed = Model::load(CpuBackend::with_threads(1), &path).expect_err("placed");
    assert_eq!(whole.to_string(), placed.to_string(), "placed as read");
    match whole {
        ModelError::Gguf(g) => g,
        other => panic!("expected a GGUF error, got {other}"),
    }
}

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
    for len in [16u64, 64, 128] {
        let bytes = rewrite(
            QWEN3,
            "qwen3",
            |(n, d, v)| {
                if n == "blk.1.attn_q_norm.weight" {
                    Some((n, vec![len], vec![1.0; len as usize]))
                } else {
                    Some((n, d, v))
                }
            },
            vec![],
        );
        match refused(bytes) {
            GgufError::Shape {
                tensor,
                expected,
                got,
            } => {
                assert_eq!(tensor, "blk.1.attn_q_norm.weight");
                assert_eq!((expected, got), (vec![32], vec![len]));
            }
            other => panic!("{other}"),
        }
    }
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

/// The HF fixture's config and weights, with `edit` applied to each
/// tensor (`None` drops it) and `config` edited.
fn hf_refused(
    edit: impl Fn(&str, Vec<usize>, Vec<u8>) -> Option<(Vec<usize>, Vec<u8>)>,
    config: impl Fn(&mut serde_json::Value),
) -> ModelError {
    let dir = Path::new(QWEN3_HF);
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    config(&mut cfg);
    let cfg = serde_json::to_vec(&cfg).unwrap();
    let raw = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&raw).unwrap();
    let kept: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .filter_map(|(n, t)| {
            edit(&n, t.shape().to_vec(), t.data().to_vec()).map(|(s, d)| (n.clone(), s, d))
        })
        .collect();
    let views = kept.iter().map(|(n, s, d)| {
        (
            n.as_str(),
            TensorView::new(Dtype::F32, s.clone(), d).unwrap(),
        )
    });
    let bytes = safetensors::serialize(views, None).unwrap();
    load_hf_bytes(&cfg, &[("model.safetensors", &bytes)]).expect_err("the damaged folder loaded")
}

#[test]
fn a_hugging_face_qwen3_with_a_bad_or_missing_norm_is_refused_by_name() {
    let unchanged = |_: &mut serde_json::Value| {};
    let short = hf_refused(
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
        |_, s, d| Some((s, d)),
        |c| c["attention_bias"] = serde_json::Value::Bool(true),
    );
    assert!(
        matches!(&e, ModelError::InvalidConfig(m) if m.contains("attention_bias")),
        "{e}"
    );
    // Relabelled Qwen2, the same weights lack Qwen2's biases.
    let e = hf_refused(
        |_, s, d| Some((s, d)),
        |c| c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]),
    );
    assert!(matches!(&e, ModelError::MissingTensor { .. }), "{e}");
}
