//! Story: an operator points handoff at a Hugging Face model folder that is
//! broken in one of the ways folders get broken in practice: a download cut
//! short, a shard missing, a config.json from another model, a weight file
//! from another architecture, a NaN from a bad fine-tune. Each must end in a
//! typed error that names what is wrong (the tensor and its expected shape
//! where there is one), never a panic and never a partially loaded model.
//!
//! Every case starts from the real, valid fixture written by
//! scripts/make_hf_fixture.py and damages one thing.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use handoff::HttpStatus;
use handoff::backend::CpuBackend;
use handoff::model::{Model, ModelError, ModelWeights, load_hf, load_hf_bytes};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf_tiny_llama");

/// One tensor as stored: dtype, shape, raw little-endian bytes.
type Stored = (Dtype, Vec<usize>, Vec<u8>);

fn fixture_tensors() -> BTreeMap<String, Stored> {
    let bytes = fs::read(Path::new(FIXTURE).join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn serialize(tensors: &BTreeMap<String, Stored>) -> Vec<u8> {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn fixture_config() -> serde_json::Value {
    serde_json::from_slice(&fs::read(Path::new(FIXTURE).join("config.json")).unwrap()).unwrap()
}

/// A model folder in a fresh temp dir: config.json and model.safetensors.
struct Folder {
    dir: tempfile::TempDir,
}

impl Folder {
    fn new(config: &serde_json::Value, weights: &[u8]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        fs::write(dir.path().join("model.safetensors"), weights).unwrap();
        Self { dir }
    }

    fn with_tensors(edit: impl FnOnce(&mut BTreeMap<String, Stored>)) -> Self {
        let mut t = fixture_tensors();
        edit(&mut t);
        Self::new(&fixture_config(), &serialize(&t))
    }

    fn with_config(edit: impl FnOnce(&mut serde_json::Value)) -> Self {
        let mut c = fixture_config();
        edit(&mut c);
        Self::new(
            &c,
            &fs::read(Path::new(FIXTURE).join("model.safetensors")).unwrap(),
        )
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Loads the folder both ways a host can: `load_hf` (whole, in f32)
    /// and `Model::load` (placed layer by layer as it is read). They must
    /// agree: the same error, or the same model.
    fn load(&self) -> Result<ModelWeights, ModelError> {
        let whole = load_hf(self.path());
        let placed = Model::load(CpuBackend::with_threads(1), self.path());
        match (&whole, placed) {
            (Ok(w), Ok(m)) => {
                let want = Model::new(CpuBackend::with_threads(1), w.clone()).unwrap();
                assert_eq!(
                    m.fingerprint(),
                    want.fingerprint(),
                    "placed as read: other weights"
                );
            }
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "placed as read"),
            // Weights that load whole but cannot be placed: Model::new
            // refuses them the same way.
            (Ok(w), Err(b)) => {
                let a = Model::new(CpuBackend::with_threads(1), w.clone()).unwrap_err();
                assert_eq!(a.to_string(), b.to_string(), "placed as read");
            }
            (Err(a), Ok(_)) => panic!("load_hf refused ({a}) what Model::load placed"),
        }
        whole
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn the_undamaged_copy_loads_so_every_failure_below_is_the_damage() {
    let w = Folder::with_tensors(|_| {}).load().unwrap();
    assert_eq!(w, load_hf(Path::new(FIXTURE)).unwrap());
}

#[test]
fn a_download_cut_short_names_the_tensor_it_cut() {
    let bytes = fs::read(Path::new(FIXTURE).join("model.safetensors")).unwrap();
    let st = SafeTensors::read_metadata(&bytes).unwrap();
    let header_end = 8 + st.0;
    // Cut in the middle of the tensor stored third.
    let third = &st.1.offset_keys()[2];
    let (start, end) = st.1.info(third).unwrap().data_offsets;
    let cut = header_end + start + (end - start) / 2;
    let folder = Folder::new(&fixture_config(), &bytes[..cut]);
    match folder.load().unwrap_err() {
        ModelError::Truncated {
            tensor,
            expected,
            available,
        } => {
            assert_eq!(tensor, format!("{third} in model.safetensors"));
            assert_eq!((expected, available), (end - start, (end - start) / 2));
        }
        other => panic!("expected Truncated, got {other}"),
    }
}

#[test]
fn no_prefix_of_a_real_checkpoint_panics_or_loads() {
    let config = fs::read(Path::new(FIXTURE).join("config.json")).unwrap();
    let bytes = fs::read(Path::new(FIXTURE).join("model.safetensors")).unwrap();
    // Every byte of the header and the first tensor, then a stride through the data.
    let mut cuts: Vec<usize> = (0..2048).collect();
    cuts.extend((2048..bytes.len()).step_by(997));
    for cut in cuts {
        let r = load_hf_bytes(&config, &[("model.safetensors", &bytes[..cut])]);
        assert!(r.is_err(), "a {cut}-byte prefix loaded");
    }
}

#[test]
fn a_missing_tensor_is_named_with_its_expected_shape() {
    let folder = Folder::with_tensors(|t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
    });
    match folder.load().unwrap_err() {
        ModelError::MissingTensor { tensor } => assert_eq!(
            tensor,
            "model.layers.1.mlp.up_proj.weight (expected shape [128, 64])"
        ),
        other => panic!("expected MissingTensor, got {other}"),
    }
}

#[test]
fn a_separate_lm_head_must_be_present_unless_tied() {
    let untied = Folder::with_tensors(|t| {
        t.remove("lm_head.weight");
    });
    assert!(matches!(
        untied.load().unwrap_err(),
        ModelError::MissingTensor { tensor } if tensor.starts_with("lm_head.weight")
    ));
    // Declared tied: transformers would use the embedding, and so do we.
    let tied = Folder::with_config(|c| c["tie_word_embeddings"] = true.into());
    let w = tied.load().unwrap();
    assert!(w.lm_head.is_none());
    assert_eq!(w.output(), w.embedding.as_slice());
}

#[test]
fn a_wrong_shape_names_tensor_expected_and_found() {
    let folder = Folder::with_tensors(|t| {
        // k_proj shaped like q_proj, as if the file were not GQA.
        let q = t["model.layers.0.self_attn.q_proj.weight"].clone();
        t.insert("model.layers.0.self_attn.k_proj.weight".into(), q);
    });
    match folder.load().unwrap_err() {
        ModelError::Shape {
            tensor,
            expected,
            got,
        } => {
            assert_eq!(tensor, "model.layers.0.self_attn.k_proj.weight");
            assert_eq!((expected, got), (vec![32, 64], vec![64, 64]));
        }
        other => panic!("expected Shape, got {other}"),
    }
}

#[test]
fn a_nan_weight_is_refused_with_its_position() {
    let folder = Folder::with_tensors(|t| {
        let (_, _, b) = t.get_mut("model.norm.weight").unwrap();
        b[4 * 5..4 * 6].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    assert!(matches!(
        folder.load().unwrap_err(),
        ModelError::NonFinite { tensor, index: 5 } if tensor == "model.norm.weight"
    ));
    let inf = Folder::with_tensors(|t| {
        let (_, _, b) = t.get_mut("lm_head.weight").unwrap();
        b[..4].copy_from_slice(&f32::NEG_INFINITY.to_le_bytes());
    });
    assert!(matches!(
        inf.load().unwrap_err(),
        ModelError::NonFinite { tensor, index: 0 } if tensor == "lm_head.weight"
    ));
}

#[test]
fn integer_or_f64_tensors_are_an_unsupported_dtype() {
    let folder = Folder::with_tensors(|t| {
        let (d, _, _) = t.get_mut("model.embed_tokens.weight").unwrap();
        *d = Dtype::I32;
    });
    assert!(matches!(
        folder.load().unwrap_err(),
        ModelError::Dtype { tensor, dtype } if tensor == "model.embed_tokens.weight" && dtype == "I32"
    ));
    let f64s = Folder::with_tensors(|t| {
        // Same bytes read as half as many f64 values.
        let (d, s, _) = t.get_mut("model.norm.weight").unwrap();
        *d = Dtype::F64;
        s[0] /= 2;
    });
    assert!(matches!(
        f64s.load().unwrap_err(),
        ModelError::Dtype { tensor, dtype } if tensor == "model.norm.weight" && dtype == "F64"
    ));
}

#[test]
fn bf16_and_f16_checkpoints_load_as_their_f32_values() {
    for half_kind in [Dtype::BF16, Dtype::F16] {
        let mut rounded: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        let folder = Folder::with_tensors(|t| {
            for (name, (d, _, b)) in t.iter_mut() {
                let vals: Vec<f32> = b
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let (bytes, back): (Vec<u8>, Vec<f32>) = match half_kind {
                    Dtype::BF16 => vals
                        .iter()
                        .map(|&x| half::bf16::from_f32(x))
                        .map(|h| (h.to_le_bytes(), h.to_f32()))
                        .fold((vec![], vec![]), |(mut b, mut v), (hb, f)| {
                            b.extend(hb);
                            v.push(f);
                            (b, v)
                        }),
                    _ => vals
                        .iter()
                        .map(|&x| half::f16::from_f32(x))
                        .map(|h| (h.to_le_bytes(), h.to_f32()))
                        .fold((vec![], vec![]), |(mut b, mut v), (hb, f)| {
                            b.extend(hb);
                            v.push(f);
                            (b, v)
                        }),
                };
                *d = half_kind;
                *b = bytes;
                rounded.insert(name.clone(), back);
            }
        });
        let w = folder.load().unwrap();
        assert_eq!(w.embedding, rounded["model.embed_tokens.weight"]);
        assert_eq!(
            w.layers[1].wv,
            rounded["model.layers.1.self_attn.v_proj.weight"]
        );
        assert_eq!(
            w.lm_head.as_deref(),
            Some(rounded["lm_head.weight"].as_slice())
        );
    }
}

#[test]
fn a_config_that_does_not_match_the_weights_is_refused() {
    // Config claims a third layer the file does not have.
    let more = Folder::with_config(|c| c["num_hidden_layers"] = 3.into());
    assert!(matches!(
        more.load().unwrap_err(),
        ModelError::MissingTensor { tensor } if tensor == "model.layers.2.input_layernorm.weight (expected shape [64])"
    ));
    // Config claims one layer: layer 1's weights would be silently dropped.
    let fewer = Folder::with_config(|c| c["num_hidden_layers"] = 1.into());
    let err = fewer.load().unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidConfig(m) if m.contains("model.layers.1.")),
        "{err}"
    );
    // Config says MHA, file is GQA: the first K projection has the wrong shape.
    let mha = Folder::with_config(|c| c["num_key_value_heads"] = 4.into());
    assert!(matches!(
        mha.load().unwrap_err(),
        ModelError::Shape { tensor, expected, got }
            if tensor == "model.layers.0.self_attn.k_proj.weight" && expected == [64, 64] && got == [32, 64]
    ));
    // A tensor the Llama forward pass would not apply (an o_proj bias).
    let biased = Folder::with_tensors(|t| {
        t.insert(
            "model.layers.0.self_attn.o_proj.bias".into(),
            (Dtype::F32, vec![64], f32_bytes(&[0.5; 64])),
        );
    });
    let err = biased.load().unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidConfig(m) if m.contains("o_proj.bias")),
        "{err}"
    );
}

#[test]
fn a_tensor_the_config_does_not_name_is_refused_before_any_weight_is_read() {
    // A checkpoint with more than the language model (a vision tower): the
    // refusal must come before gigabytes are read and placed. The first
    // tensor read (the embedding) is poisoned too: the error must be about
    // the extra tensor, so nothing was read.
    let multimodal = Folder::with_tensors(|t| {
        t.insert(
            "vision_tower.patch_embed.weight".into(),
            (Dtype::F32, vec![4], f32_bytes(&[1.0; 4])),
        );
        let (_, _, b) = t.get_mut("model.embed_tokens.weight").unwrap();
        b[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    let err = multimodal.load().unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidConfig(m) if m.contains("vision_tower.patch_embed.weight")),
        "{err}"
    );
}

#[test]
fn bad_config_json_is_invalid_config_naming_the_field() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|c| *c = serde_json::Value::String("llama".into())),
            "not an object",
        ),
        (
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("hidden_size");
            }),
            "hidden_size is missing",
        ),
        (
            Box::new(|c| c["num_key_value_heads"] = 3.into()),
            "does not divide",
        ),
        (
            Box::new(|c| c["vocab_size"] = (-5).into()),
            "vocab_size = -5",
        ),
        (
            Box::new(|c| c["rope_parameters"]["rope_type"] = "yarn".into()),
            "RoPE scaling \"yarn\"",
        ),
        (
            Box::new(|c| c["rope_parameters"]["rope_type"] = "llama3".into()),
            "rope_parameters.factor is missing",
        ),
        (
            Box::new(|c| c["partial_rotary_factor"] = 0.5.into()),
            "partial_rotary_factor",
        ),
        (Box::new(|c| c["hidden_act"] = "gelu".into()), "hidden_act"),
    ];
    for (edit, needle) in cases {
        let folder = Folder::with_config(edit);
        let err = folder.load().unwrap_err();
        assert!(
            matches!(&err, ModelError::InvalidConfig(m) if m.contains(needle)),
            "{err} lacks {needle:?}"
        );
        assert_eq!(err.http_status(), 500);
    }
    let folder = Folder::with_config(|_| {});
    fs::write(folder.path().join("config.json"), b"{\"architectures\": [").unwrap();
    assert!(
        matches!(folder.load().unwrap_err(), ModelError::InvalidConfig(m) if m.contains("JSON"))
    );
}

#[test]
fn an_unknown_architecture_is_refused_before_any_weight_is_read() {
    for arch in ["GPT2LMHeadModel", "MixtralForCausalLM", "Gemma2ForCausalLM"] {
        // Weights deliberately garbage: the architecture check comes first.
        let mut c = fixture_config();
        c["architectures"] = serde_json::json!([arch]);
        let folder = Folder::new(&c, b"not a safetensors file");
        match folder.load().unwrap_err() {
            ModelError::UnsupportedArchitecture(a) => assert_eq!(a, arch),
            other => panic!("{arch}: expected UnsupportedArchitecture, got {other}"),
        }
    }
}

#[test]
fn missing_or_empty_files_are_typed_errors() {
    let no_dir = PathBuf::from(FIXTURE).join("does-not-exist");
    assert!(matches!(
        load_hf(&no_dir).unwrap_err(),
        ModelError::Io { .. }
    ));

    let folder = Folder::with_config(|_| {});
    fs::remove_file(folder.path().join("model.safetensors")).unwrap();
    assert!(
        matches!(folder.load().unwrap_err(), ModelError::Io { path, .. } if path == folder.path().display().to_string())
    );

    let empty = Folder::new(&fixture_config(), b"");
    assert!(matches!(
        empty.load().unwrap_err(),
        ModelError::Truncated { .. }
    ));
    let garbage = Folder::new(&fixture_config(), &[0xff; 64]);
    assert!(matches!(
        garbage.load().unwrap_err(),
        ModelError::BadHeader(_)
    ));
}

/// Copies the sharded fixture into a temp dir, applying `edit` to the index.
fn sharded_copy(edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let src = Path::new(FIXTURE).join("sharded");
    let dir = tempfile::tempdir().unwrap();
    for e in fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let idx = dir.path().join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&idx).unwrap()).unwrap();
    edit(&mut v);
    fs::write(&idx, v.to_string()).unwrap();
    dir
}

#[test]
fn a_sharded_checkpoint_loads_the_same_weights_and_its_index_is_checked() {
    let whole = load_hf(Path::new(FIXTURE)).unwrap();
    assert_eq!(load_hf(&Path::new(FIXTURE).join("sharded")).unwrap(), whole);

    // A shard gone.
    let dir = sharded_copy(|_| {});
    fs::remove_file(dir.path().join("model-00002-of-00003.safetensors")).unwrap();
    let err = load_hf(dir.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::Io { path, .. } if path.ends_with("model-00002-of-00003.safetensors")),
        "{err}"
    );

    // The index points outside the folder.
    let dir = sharded_copy(|v| v["weight_map"]["lm_head.weight"] = "../../etc/passwd".into());
    let err = load_hf(dir.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::BadHeader(m) if m.contains("not a plain file name")),
        "{err}"
    );

    // The index places a tensor in the wrong shard.
    let dir = sharded_copy(|v| {
        v["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors".into()
    });
    let err = load_hf(dir.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::MissingTensor { tensor } if tensor.starts_with("lm_head.weight")),
        "{err}"
    );

    // The index lacks its weight_map.
    let dir = sharded_copy(|v| *v = serde_json::json!({"metadata": {}}));
    assert!(
        matches!(load_hf(dir.path()).unwrap_err(), ModelError::BadHeader(m) if m.contains("weight_map"))
    );
}

#[test]
fn the_same_tensor_in_two_shards_is_refused() {
    let t = fixture_tensors();
    let bytes = serialize(&t);
    let norm: BTreeMap<String, Stored> = t
        .iter()
        .filter(|(n, _)| *n == "model.norm.weight")
        .map(|(n, s)| (n.clone(), s.clone()))
        .collect();
    let extra = serialize(&norm);
    let config = fs::read(Path::new(FIXTURE).join("config.json")).unwrap();
    let err = load_hf_bytes(
        &config,
        &[("a.safetensors", &bytes), ("b.safetensors", &extra)],
    )
    .unwrap_err();
    assert!(
        matches!(&err, ModelError::BadHeader(m) if m.contains("model.norm.weight") && m.contains("both")),
        "{err}"
    );
}

#[test]
fn random_corruption_of_header_or_config_never_panics() {
    let config = fs::read(Path::new(FIXTURE).join("config.json")).unwrap();
    let weights = fs::read(Path::new(FIXTURE).join("model.safetensors")).unwrap();
    let header_end = 8 + SafeTensors::read_metadata(&weights).unwrap().0;
    // xorshift64: deterministic, no extra dependency.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut loaded, mut refused) = (0, 0);
    for _ in 0..400 {
        let (mut c, mut w) = (config.clone(), weights.clone());
        for _ in 0..1 + next() % 4 {
            let r = next();
            // Mostly the header (where structure lives), sometimes config.json.
            let (buf, len) = if r % 4 == 0 {
                (&mut c, config.len())
            } else {
                (&mut w, header_end)
            };
            buf[(r >> 8) as usize % len] = (r >> 40) as u8;
        }
        match load_hf_bytes(&c, &[("model.safetensors", &w)]) {
            Ok(_) => loaded += 1,
            Err(e) => {
                match &e {
                    // Bytes in memory: no file was opened, so no file error.
                    ModelError::Io { .. } => panic!("in-memory load blamed a file: {e}"),
                    // A shape refusal names two different shapes.
                    ModelError::Shape { expected, got, .. } => assert_ne!(expected, got, "{e}"),
                    _ => {}
                }
                refused += 1;
            }
        }
    }
    // Most single-byte damage to structure is caught.
    assert!(refused > loaded, "refused {refused}, loaded {loaded}");
}

#[test]
fn qwen2_needs_its_attention_biases_and_mistral_reads_like_llama() {
    let qwen =
        |c: &mut serde_json::Value| c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    // The Llama fixture has no q/k/v biases: as a Qwen2 it is incomplete.
    let missing = Folder::with_config(qwen);
    assert!(matches!(
        missing.load().unwrap_err(),
        ModelError::MissingTensor { tensor } if tensor == "model.layers.0.self_attn.q_proj.bias (expected shape [64])"
    ));
    // With them it loads, and each bias lands on its own projection.
    let mut t = fixture_tensors();
    for l in 0..2 {
        for (proj, n, v) in [
            ("q_proj", 64, 0.25f32),
            ("k_proj", 32, 0.5),
            ("v_proj", 32, 0.75),
        ] {
            t.insert(
                format!("model.layers.{l}.self_attn.{proj}.bias"),
                (Dtype::F32, vec![n], f32_bytes(&vec![v + l as f32; n])),
            );
        }
    }
    let mut c = fixture_config();
    qwen(&mut c);
    let w = Folder::new(&c, &serialize(&t)).load().unwrap();
    assert!(w.config.attention_bias);
    assert_eq!(w.layers[1].bq.as_deref(), Some(&[1.25f32; 64][..]));
    assert_eq!(w.layers[1].bk.as_deref(), Some(&[1.5f32; 32][..]));
    assert_eq!(w.layers[0].bv.as_deref(), Some(&[0.75f32; 32][..]));
    // The same biases in a Llama folder are weights the config does not explain.
    let err = Folder::new(&fixture_config(), &serialize(&t))
        .load()
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidConfig(m) if m.contains(".bias")),
        "{err}"
    );

    let mut c = fixture_config();
    c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    c["sliding_window"] = 64.into();
    let m = Folder::with_config(|x| *x = c).load().unwrap();
    assert_eq!(
        m.config.max_seq_len, 64,
        "context capped at the sliding window"
    );
    assert_eq!(m.layers, load_hf(Path::new(FIXTURE)).unwrap().layers);
}

#[test]
fn a_config_with_a_million_or_2_to_the_40_layers_is_refused_at_once_by_the_file() {
    // The file holds two layers. Before the check, a million cost 22 s and
    // 1 GiB building names for every layer, and 2^40 aborted on allocation.
    for layers in [1_000_000u64, 1 << 40] {
        let started = std::time::Instant::now();
        let folder = Folder::with_config(|c| c["num_hidden_layers"] = layers.into());
        let err = folder.load().unwrap_err();
        assert!(
            matches!(&err, ModelError::MissingTensor { tensor }
                if tensor == "model.layers.2.input_layernorm.weight (expected shape [64])"),
            "{layers}: {err}"
        );
        // Generous for a loaded CI machine; the bound is the point, not speed.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{layers}: {:?}",
            started.elapsed()
        );
    }
}
