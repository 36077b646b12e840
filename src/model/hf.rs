//! Hugging Face checkpoints: a folder with `config.json` and one or more
//! `*.safetensors` files (sharded ones listed in
//! `model.safetensors.index.json`). Llama, Mistral and Qwen2 map onto the
//! Llama forward pass with rotate-half RoPE ([`RopeStyle::Half`]); f32, f16
//! and bf16 tensors are converted to f32.
//!
//! Every malformed input is a typed [`ModelError`] naming the file or tensor
//! and, for tensors, the expected shape: never a panic, never a partially
//! loaded model.
//!
//! [`RopeStyle::Half`]: crate::model::RopeStyle::Half

mod config;
mod folder;
mod gemma;
mod shard;
mod tensors;

use std::path::Path;

use crate::backend::Backend;
use crate::model::place::{Collect, Placer, WeightSink};
use crate::model::{LayerWeights, Model, ModelConfig, ModelError, ModelWeights};
use config::HfConfig;
use shard::Shard;
use tensors::TensorSet;

/// Loads a Hugging Face model folder (`config.json` + `*.safetensors`).
///
/// ```no_run
/// let weights = handoff::model::load_hf(std::path::Path::new("models/tiny-llama"))?;
/// println!("{} layers", weights.config.n_layers);
/// # Ok::<(), handoff::model::ModelError>(())
/// ```
pub fn load_hf(dir: &Path) -> Result<ModelWeights, ModelError> {
    folder::load(dir, |config| Ok(Collect::new(config)))
}

/// [`load_hf`], placing each layer on `backend` as it is read (see
/// [`Model::load`]).
pub(crate) fn load_hf_on<B: Backend>(backend: B, dir: &Path) -> Result<Model<B>, ModelError> {
    folder::load(dir, |config| Placer::new(backend, config))
}

/// Loads a checkpoint from in-memory parts: `config.json`'s bytes and each
/// safetensors file as `(file name, bytes)`. The same checks as [`load_hf`]
/// apply; this is the entry point for fuzzing and for hosts that fetch
/// weights themselves.
pub fn load_hf_bytes(
    config_json: &[u8],
    files: &[(&str, &[u8])],
) -> Result<ModelWeights, ModelError> {
    let shards = files
        .iter()
        .map(|(name, bytes)| Shard::parse(name, bytes))
        .collect::<Result<Vec<_>, _>>()?;
    let cfg = HfConfig::parse(config_json)?;
    let sink = Collect::new(cfg.model.clone());
    assemble(&cfg, TensorSet::new(shards, None)?, sink)
}

/// Reads every tensor `cfg` names, in load order, into `sink`: the
/// embedding, each layer as soon as it is complete, then the final norm and
/// the output projection. A tensor the config does not name is refused
/// before the sink finishes.
fn assemble<S: WeightSink>(
    cfg: &HfConfig,
    mut t: TensorSet<'_>,
    mut sink: S,
) -> Result<S::Out, ModelError> {
    let c = &cfg.model;
    let dim = c.dim;

    let tied = c.tied_embeddings;
    let ignorable =
        |n: &str| n.ends_with(".rotary_emb.inv_freq") || (tied && n == "lm_head.weight");
    let extra = |name: &str| {
        ModelError::InvalidConfig(format!(
            "tensor {name} is not part of a {} with this config.json: \
             config and weights disagree (or the checkpoint has weights handoff would ignore)",
            cfg.arch.class_name()
        ))
    };
    // The work below is bounded by the file, not by config.json: a config
    // naming more tensors than the checkpoint holds is refused before
    // anything proportional to it is built, naming the first layer missing.
    let per_layer = 9
        + if c.attention_bias { 3 } else { 0 }
        + if c.qk_norm { 2 } else { 0 }
        + if c.gemma.is_some() { 2 } else { 0 };
    let needed = c.n_layers.checked_mul(per_layer);
    if needed.is_none_or(|n| n > t.len()) {
        // Complete layers are at most len / 9: the search is that short.
        let (name, shape) = (0..c.n_layers)
            .flat_map(|l| {
                layer_tensors(c, l)
                    .into_iter()
                    .chain(layer_biases(c, l).into_iter().flatten())
                    .chain(layer_qk_norms(c, l).into_iter().flatten())
                    .chain(layer_post_norms(c, l).into_iter().flatten())
            })
            .find(|(name, _)| !t.has(name))
            .unwrap_or_else(|| ("model.norm.weight".to_string(), vec![dim]));
        return Err(ModelError::MissingTensor {
            tensor: format!("{name} (expected shape {shape:?})"),
        });
    }
    // A tensor the config does not name is refused before any data is read
    // or placed (a vision tower, a layer too many). When an expected tensor
    // is missing, reading names it below, as the more useful error.
    let expected = expected_names(c);
    if expected.iter().all(|n| t.has(n))
        && let Some(name) = t.first_unwanted(|n| expected.contains(n) || ignorable(n))
    {
        return Err(extra(name));
    }

    // Gemma's checkpoints store each norm's gains as `w` in `x̂ · (1 + w)`.
    let gain = |mut v: Vec<f32>| {
        if c.gemma.is_some() {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        v
    };
    sink.embedding(t.take("model.embed_tokens.weight", &[c.vocab_size, dim])?)?;
    for l in 0..c.n_layers {
        let (bq, bk, bv) = match layer_biases(c, l) {
            Some([q, k, v]) => (
                Some(t.take(&q.0, &q.1)?),
                Some(t.take(&k.0, &k.1)?),
                Some(t.take(&v.0, &v.1)?),
            ),
            None => (None, None, None),
        };
        let (q_norm, k_norm) = match layer_qk_norms(c, l) {
            Some([q, k]) => (
                Some(gain(t.take(&q.0, &q.1)?)),
                Some(gain(t.take(&k.0, &k.1)?)),
            ),
            None => (None, None),
        };
        let (post_attn_norm, post_ffn_norm) = match layer_post_norms(c, l) {
            Some([a, f]) => (
                Some(gain(t.take(&a.0, &a.1)?)),
                Some(gain(t.take(&f.0, &f.1)?)),
            ),
            None => (None, None),
        };
        let mut take = |(name, shape): (String, Vec<usize>)| t.take(&name, &shape);
        let [attn_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3] = layer_tensors(c, l);
        sink.layer(LayerWeights {
            attn_norm: gain(take(attn_norm)?),
            wq: take(wq)?,
            wk: take(wk)?,
            wv: take(wv)?,
            wo: take(wo)?,
            bq,
            bk,
            bv,
            q_norm,
            k_norm,
            post_attn_norm,
            ffn_norm: gain(take(ffn_norm)?),
            post_ffn_norm,
            w1: take(w1)?,
            w2: take(w2)?,
            w3: take(w3)?,
        })?;
    }
    let final_norm = gain(t.take("model.norm.weight", &[dim])?);
    // transformers ties by pointing lm_head at the embedding, so a stored
    // lm_head of a tied checkpoint is never used.
    let lm_head = if c.tied_embeddings {
        None
    } else {
        Some(t.take("lm_head.weight", &[c.vocab_size, dim])?)
    };

    if let Some(name) = t.first_unused(ignorable) {
        return Err(extra(name));
    }
    sink.finish(final_norm, lm_head)
}

/// Layer `l`'s tensors, with their shapes, in `LayerWeights` order:
/// attn_norm, wq, wk, wv, wo, ffn_norm, w1 (gate), w2 (down), w3 (up).
fn layer_tensors(c: &ModelConfig, l: usize) -> [(String, Vec<usize>); 9] {
    // Products were checked for overflow when the config was parsed.
    let (d, h) = (c.dim, c.hidden_dim);
    let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let n = |t: &str| format!("model.layers.{l}.{t}");
    // Gemma's post_attention_layernorm norms the attention output (see
    // `layer_post_norms`); its feed-forward input has a norm of its own.
    let ffn_norm = if c.gemma.is_some() {
        "pre_feedforward_layernorm.weight"
    } else {
        "post_attention_layernorm.weight"
    };
    [
        (n("input_layernorm.weight"), vec![d]),
        (n("self_attn.q_proj.weight"), vec![qd, d]),
        (n("self_attn.k_proj.weight"), vec![kvd, d]),
        (n("self_attn.v_proj.weight"), vec![kvd, d]),
        (n("self_attn.o_proj.weight"), vec![d, qd]),
        (n(ffn_norm), vec![d]),
        (n("mlp.gate_proj.weight"), vec![h, d]),
        (n("mlp.down_proj.weight"), vec![d, h]),
        (n("mlp.up_proj.weight"), vec![h, d]),
    ]
}

/// Layer `l`'s q, k and v biases, when the model has attention biases.
fn layer_biases(c: &ModelConfig, l: usize) -> Option<[(String, Vec<usize>); 3]> {
    let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let n = |t: &str| format!("model.layers.{l}.self_attn.{t}.bias");
    c.attention_bias.then(|| {
        [
            (n("q_proj"), vec![qd]),
            (n("k_proj"), vec![kvd]),
            (n("v_proj"), vec![kvd]),
        ]
    })
}

/// Layer `l`'s per-head q and k RMS gains, when the model has them.
fn layer_qk_norms(c: &ModelConfig, l: usize) -> Option<[(String, Vec<usize>); 2]> {
    let n = |t: &str| format!("model.layers.{l}.self_attn.{t}.weight");
    c.qk_norm.then(|| {
        [
            (n("q_norm"), vec![c.head_dim]),
            (n("k_norm"), vec![c.head_dim]),
        ]
    })
}

/// Layer `l`'s norms of the attention and feed-forward outputs, when the
/// model is a Gemma.
fn layer_post_norms(c: &ModelConfig, l: usize) -> Option<[(String, Vec<usize>); 2]> {
    let n = |t: &str| (format!("model.layers.{l}.{t}.weight"), vec![c.dim]);
    c.gemma.is_some().then(|| {
        [
            n("post_attention_layernorm"),
            n("post_feedforward_layernorm"),
        ]
    })
}

/// Every tensor name `assemble` reads for a model of `c`.
fn expected_names(c: &ModelConfig) -> std::collections::HashSet<String> {
    let mut names: std::collections::HashSet<String> =
        ["model.embed_tokens.weight", "model.norm.weight"]
            .map(String::from)
            .into();
    if !c.tied_embeddings {
        names.insert("lm_head.weight".to_string());
    }
    for l in 0..c.n_layers {
        names.extend(layer_tensors(c, l).into_iter().map(|(n, _)| n));
        names.extend(layer_biases(c, l).into_iter().flatten().map(|(n, _)| n));
        names.extend(layer_qk_norms(c, l).into_iter().flatten().map(|(n, _)| n));
        names.extend(layer_post_norms(c, l).into_iter().flatten().map(|(n, _)| n));
    }
    names
}
