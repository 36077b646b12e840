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
    // Products were checked for overflow when the config was parsed.
    let (dim, hidden) = (c.dim, c.hidden_dim);
    let q_dim = c.n_heads * c.head_dim;
    let kv_dim = c.n_kv_heads * c.head_dim;

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
    // A tensor the config does not name is refused before any data is read
    // or placed (a vision tower, a layer too many). When an expected tensor
    // is missing, reading names it below, as the more useful error.
    let expected = expected_names(c);
    if expected.iter().all(|n| t.has(n))
        && let Some(name) = t.first_unwanted(|n| expected.contains(n) || ignorable(n))
    {
        return Err(extra(name));
    }

    sink.embedding(t.take("model.embed_tokens.weight", &[c.vocab_size, dim])?)?;
    for l in 0..c.n_layers {
        let p = format!("model.layers.{l}");
        let mut bias = |name: &str, n: usize| -> Result<Option<Vec<f32>>, ModelError> {
            if c.attention_bias {
                t.take(&format!("{p}.self_attn.{name}.bias"), &[n])
                    .map(Some)
            } else {
                Ok(None)
            }
        };
        let (bq, bk, bv) = (
            bias("q_proj", q_dim)?,
            bias("k_proj", kv_dim)?,
            bias("v_proj", kv_dim)?,
        );
        sink.layer(LayerWeights {
            attn_norm: t.take(&format!("{p}.input_layernorm.weight"), &[dim])?,
            wq: t.take(&format!("{p}.self_attn.q_proj.weight"), &[q_dim, dim])?,
            wk: t.take(&format!("{p}.self_attn.k_proj.weight"), &[kv_dim, dim])?,
            wv: t.take(&format!("{p}.self_attn.v_proj.weight"), &[kv_dim, dim])?,
            wo: t.take(&format!("{p}.self_attn.o_proj.weight"), &[dim, q_dim])?,
            bq,
            bk,
            bv,
            ffn_norm: t.take(&format!("{p}.post_attention_layernorm.weight"), &[dim])?,
            w1: t.take(&format!("{p}.mlp.gate_proj.weight"), &[hidden, dim])?,
            w2: t.take(&format!("{p}.mlp.down_proj.weight"), &[dim, hidden])?,
            w3: t.take(&format!("{p}.mlp.up_proj.weight"), &[hidden, dim])?,
        })?;
    }
    let final_norm = t.take("model.norm.weight", &[dim])?;
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

/// Every tensor name `assemble` reads for a model of `c`.
fn expected_names(c: &ModelConfig) -> std::collections::HashSet<String> {
    let mut names = std::collections::HashSet::new();
    names.insert("model.embed_tokens.weight".to_string());
    names.insert("model.norm.weight".to_string());
    if !c.tied_embeddings {
        names.insert("lm_head.weight".to_string());
    }
    for l in 0..c.n_layers {
        let p = format!("model.layers.{l}");
        for t in [
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.down_proj.weight",
            "mlp.up_proj.weight",
        ] {
            names.insert(format!("{p}.{t}"));
        }
        if c.attention_bias {
            for t in ["q_proj", "k_proj", "v_proj"] {
                names.insert(format!("{p}.self_attn.{t}.bias"));
            }
        }
    }
    names
}
