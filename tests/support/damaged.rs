//! Model files damaged on purpose: a GGUF fixture rewritten tensor by
//! tensor, a Hugging Face folder with its config or tensors edited, and the
//! typed error each load gives (the malformed-file stories of each family).

use std::path::Path;

use handoff::backend::CpuBackend;
use handoff::model::gguf::{GgufError, GgufFile, GgufValue, GgufWriter, load_gguf_bytes};
use handoff::model::{Model, ModelError, load_hf_bytes};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

/// One tensor of a file being rewritten: name, GGUF dims, f32 values.
pub type Entry = (String, Vec<u64>, Vec<f32>);

/// The fixture at `path` rewritten: architecture `arch` (metadata keys
/// renamed to its prefix), each tensor through `edit` (`None` drops it),
/// then `extra` appended.
pub fn rewrite(
    path: &str,
    arch: &str,
    edit: impl Fn(Entry) -> Option<Entry>,
    extra: Vec<Entry>,
) -> Vec<u8> {
    rewrite_kv(path, arch, |_, v| Some(v), edit, extra)
}

/// [`rewrite`], each metadata value (by its renamed key) through `kv`
/// first (`None` drops it).
pub fn rewrite_kv(
    path: &str,
    arch: &str,
    kv: impl Fn(&str, GgufValue) -> Option<GgufValue>,
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
        if let Some(v) = kv(&k, v) {
            w = w.kv(&k, v);
        }
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
pub fn refused(bytes: Vec<u8>) -> GgufError {
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

/// The HF fixture folder `dir`'s config and weights, with `edit` applied
/// to each tensor (`None` drops it) and `config` edited, loaded: the error.
pub fn hf_refused(
    dir: &str,
    edit: impl Fn(&str, Vec<usize>, Vec<u8>) -> Option<(Vec<usize>, Vec<u8>)>,
    config: impl Fn(&mut serde_json::Value),
) -> ModelError {
    let dir = Path::new(dir);
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

/// The GGUF file at `path` (architecture `arch`) with tensor `tensor`
/// rewritten to each of `lens` values is refused, naming that tensor and
/// its expected `[want]` against what it got.
pub fn assert_norm_length_refused(path: &str, arch: &str, tensor: &str, want: u64, lens: &[u64]) {
    for &len in lens {
        let bytes = rewrite(
            path,
            arch,
            |(n, d, v)| {
                if n == tensor {
                    Some((n, vec![len], vec![1.0; len as usize]))
                } else {
                    Some((n, d, v))
                }
            },
            vec![],
        );
        match refused(bytes) {
            GgufError::Shape {
                tensor: named,
                expected,
                got,
            } => {
                assert_eq!(named, tensor);
                assert_eq!((expected, got), (vec![want], vec![len]));
            }
            other => panic!("{other}"),
        }
    }
}
