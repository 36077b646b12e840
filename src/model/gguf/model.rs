//! A GGUF file as a Llama-family model: its metadata as a [`ModelConfig`],
//! its tensors checked against that config and handed to a sink layer by
//! layer (quantized matrices stay quantized where the sink keeps them).
//!
//! llama.cpp's converter permutes the rows of each Llama head's Q and K
//! projections so that its RoPE rotates adjacent pairs; those files are
//! served with [`RopeStyle::Interleaved`], which rotates the same pairs, so
//! no rows are moved and the attention scores equal the Hugging Face
//! model's. Qwen2, Qwen3 and Gemma 3 files are not permuted and keep
//! rotate-half.
//!
//! Gemma 3 (`gemma3`) files store every norm's gains as the multiplier
//! (llama.cpp's converter adds Hugging Face's `1 +`), so they are read as
//! they are.

use std::collections::HashSet;

use crate::model::gguf::{GgmlType, GgufError, GgufFile, QuantMatrix, TensorInfo};
use crate::model::place::{LayerTensors, Tensor, TensorSink};
use crate::model::{Gemma, ModelConfig, ModelError, RopeScaling, RopeStyle};

/// What an architecture adds to the Llama block.
#[derive(Clone, Copy)]
struct Arch {
    rope_style: RopeStyle,
    /// q, k and v biases (`blk.N.attn_{q,k,v}.bias`).
    attention_bias: bool,
    /// Per-head q and k RMS gains (`blk.N.attn_{q,k}_norm.weight`).
    qk_norm: bool,
    /// Gemma 3's block: post-attention and post-feed-forward norms
    /// (`blk.N.post_attention_norm.weight`, `blk.N.post_ffw_norm.weight`).
    gemma: bool,
}

/// The architectures served.
fn arch(name: &str) -> Option<Arch> {
    let (rope_style, attention_bias, qk_norm, gemma) = match name {
        "llama" | "mistral" => (RopeStyle::Interleaved, false, false, false),
        "qwen2" => (RopeStyle::Half, true, false, false),
        "qwen3" => (RopeStyle::Half, false, true, false),
        "gemma3" => (RopeStyle::Half, false, true, true),
        _ => return None,
    };
    Some(Arch {
        rope_style,
        attention_bias,
        qk_norm,
        gemma,
    })
}

/// The model configuration a GGUF file's metadata describes, checked
/// against its tensor directory before anything is sized by it.
pub(crate) fn config(f: &GgufFile) -> Result<ModelConfig, GgufError> {
    let a = f.architecture()?;
    let Arch {
        rope_style,
        attention_bias,
        qk_norm,
        gemma,
    } = arch(a).ok_or_else(|| GgufError::UnknownArchitecture(a.to_string()))?;
    let key = |k: &str| format!("{a}.{k}");
    let size = |k: &str| -> Result<usize, GgufError> {
        let v = f.u64(&key(k))?;
        usize::try_from(v).map_err(|_| GgufError::InvalidConfig(format!("{} is {v}", key(k))))
    };
    let opt_size = |k: &str| -> Result<Option<usize>, GgufError> {
        if f.metadata(&key(k)).is_some() {
            size(k).map(Some)
        } else {
            Ok(None)
        }
    };
    let dim = size("embedding_length")?;
    let n_layers = size("block_count")?;
    let n_heads = size("attention.head_count")?;
    let n_kv_heads = opt_size("attention.head_count_kv")?.unwrap_or(n_heads);
    let head_dim = match opt_size("attention.key_length")? {
        Some(h) => h,
        None if n_heads > 0 => dim / n_heads,
        None => 0,
    };
    if let Some(v) = opt_size("attention.value_length")?
        && v != head_dim
    {
        return Err(GgufError::InvalidConfig(format!(
            "value heads of {v} elements differ from key heads of {head_dim}"
        )));
    }
    if let Some(r) = opt_size("rope.dimension_count")?
        && r != head_dim
    {
        return Err(GgufError::InvalidConfig(format!(
            "RoPE rotates {r} of each head's {head_dim} elements: partial rotary embeddings are not supported"
        )));
    }
    let rope_theta = match f.metadata(&key("rope.freq_base")) {
        Some(_) => f.f32(&key("rope.freq_base"))?,
        None => 10000.0,
    };
    let norm_eps = f.f32(&key("attention.layer_norm_rms_epsilon"))?;
    let rope_scaling = match f.metadata(&key("rope.scaling.type")) {
        None => RopeScaling::None,
        Some(_) => match f.str(&key("rope.scaling.type"))? {
            "none" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: f.f32(&key("rope.scaling.factor"))?,
            },
            other => {
                return Err(GgufError::InvalidConfig(format!(
                    "RoPE scaling {other} is not supported (plain and linear are)"
                )));
            }
        },
    };

    // The file must hold every tensor the config names, so nothing is
    // built for layers that are not there.
    let per_layer = 9
        + if attention_bias { 3 } else { 0 }
        + if qk_norm { 2 } else { 0 }
        + if gemma { 2 } else { 0 };
    if n_layers
        .checked_mul(per_layer)
        .is_none_or(|n| n > f.tensors().len())
    {
        return Err(GgufError::InvalidConfig(format!(
            "{} says {n_layers} layers but the file holds {} tensors",
            key("block_count"),
            f.tensors().len()
        )));
    }
    let embd = f
        .tensor("token_embd.weight")
        .ok_or_else(|| GgufError::MissingTensor("token_embd.weight".into()))?;
    let vocab_size = match embd.dims() {
        [d, v] if *d as usize == dim => *v as usize,
        got => {
            return Err(GgufError::Shape {
                tensor: "token_embd.weight".into(),
                expected: vec![dim as u64, 0],
                got: got.to_vec(),
            });
        }
    };
    let config = ModelConfig {
        dim,
        hidden_dim: size("feed_forward_length")?,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size,
        max_seq_len: size("context_length")?,
        rope_theta,
        rope_style,
        rope_scaling,
        norm_eps,
        tied_embeddings: f.tensor("output.weight").is_none(),
        attention_bias,
        qk_norm,
        gemma: None,
    };
    let config = ModelConfig {
        gemma: if gemma {
            Some(gemma_config(f, &key, &config)?)
        } else {
            None
        },
        ..config
    };
    config
        .validate()
        .map_err(|e| GgufError::InvalidConfig(e.to_string()))?;
    // Every product of sizes a layer's tensors use must fit.
    let (d, h) = (config.dim, config.hidden_dim);
    for (x, y) in [
        (n_heads, head_dim),
        (n_kv_heads, head_dim),
        (h, d),
        (vocab_size, d),
    ] {
        if x.checked_mul(y).and_then(|n| n.checked_mul(4)).is_none() {
            return Err(GgufError::InvalidConfig(format!(
                "sizes {x} x {y} overflow"
            )));
        }
    }
    Ok(config)
}

/// Gemma 3's block from a `gemma3` file's metadata. llama.cpp's own
/// defaults stand where the file has no key: a local RoPE base of 10,000,
/// a global layer every sixth, and scores scaled by `1 / sqrt(head_dim)`
/// (except the 62-layer 27B, whose `query_pre_attn_scalar` is
/// `dim / n_heads`).
fn gemma_config(
    f: &GgufFile,
    key: &dyn Fn(&str) -> String,
    c: &ModelConfig,
) -> Result<Gemma, GgufError> {
    let opt_f32 = |k: &str| -> Result<Option<f32>, GgufError> {
        f.metadata(&key(k)).map(|_| f.f32(&key(k))).transpose()
    };
    let opt_u64 = |k: &str| -> Result<Option<u64>, GgufError> {
        f.metadata(&key(k)).map(|_| f.u64(&key(k))).transpose()
    };
    if opt_f32("attn_logit_softcapping")?.is_some() {
        return Err(GgufError::InvalidConfig(format!(
            "{}: attention logit soft-capping is not supported",
            key("attn_logit_softcapping")
        )));
    }
    let usize_of = |k: &str, v: u64| {
        usize::try_from(v).map_err(|_| GgufError::InvalidConfig(format!("{} is {v}", key(k))))
    };
    let sliding_window = usize_of(
        "attention.sliding_window",
        f.u64(&key("attention.sliding_window"))?,
    )?;
    let global_every = match opt_u64("attention.sliding_window_pattern")? {
        Some(v) => usize_of("attention.sliding_window_pattern", v)?,
        None => 6,
    };
    let query_pre_attn_scalar = if c.n_layers == 62 && c.n_heads > 0 {
        (c.dim / c.n_heads) as f32
    } else {
        c.head_dim as f32
    };
    Ok(Gemma {
        sliding_window,
        global_every,
        local_rope_theta: opt_f32("rope.freq_base_swa")?.unwrap_or(10_000.0),
        query_pre_attn_scalar,
        final_logit_softcap: opt_f32("final_logit_softcapping")?,
    })
}

/// Every tensor `c` reads, by name, with its GGUF dimensions.
fn expected(c: &ModelConfig) -> Vec<(String, Vec<u64>)> {
    let (d, h) = (c.dim as u64, c.hidden_dim as u64);
    let (qd, kvd) = (
        (c.n_heads * c.head_dim) as u64,
        (c.n_kv_heads * c.head_dim) as u64,
    );
    let mut v = vec![(
        "token_embd.weight".to_string(),
        vec![d, c.vocab_size as u64],
    )];
    for l in 0..c.n_layers {
        v.extend(layer_names(c, l).into_iter().flatten());
    }
    v.push(("output_norm.weight".into(), vec![d]));
    if !c.tied_embeddings {
        v.push(("output.weight".into(), vec![d, c.vocab_size as u64]));
    }
    let _ = (h, qd, kvd);
    v
}

/// Layer `l`'s tensors in [`LayerTensors`] order (attn_norm, q, k, v, o,
/// ffn_norm, gate, down, up), then its biases and q/k norms when the model
/// has them, then Gemma's post norms.
fn layer_names(c: &ModelConfig, l: usize) -> [Option<(String, Vec<u64>)>; 16] {
    let (d, h) = (c.dim as u64, c.hidden_dim as u64);
    let (qd, kvd) = (
        (c.n_heads * c.head_dim) as u64,
        (c.n_kv_heads * c.head_dim) as u64,
    );
    let n = |t: &str, dims: Vec<u64>| Some((format!("blk.{l}.{t}"), dims));
    let b = |t: &str, len: u64| {
        c.attention_bias
            .then(|| (format!("blk.{l}.{t}.bias"), vec![len]))
    };
    let g = |t: &str| {
        c.qk_norm
            .then(|| (format!("blk.{l}.{t}.weight"), vec![c.head_dim as u64]))
    };
    let post = |t: &str| {
        c.gemma
            .is_some()
            .then(|| (format!("blk.{l}.{t}.weight"), vec![d]))
    };
    [
        n("attn_norm.weight", vec![d]),
        n("attn_q.weight", vec![d, qd]),
        n("attn_k.weight", vec![d, kvd]),
        n("attn_v.weight", vec![d, kvd]),
        n("attn_output.weight", vec![qd, d]),
        n("ffn_norm.weight", vec![d]),
        n("ffn_gate.weight", vec![d, h]),
        n("ffn_down.weight", vec![h, d]),
        n("ffn_up.weight", vec![d, h]),
        b("attn_q", qd),
        b("attn_k", kvd),
        b("attn_v", kvd),
        g("attn_q_norm"),
        g("attn_k_norm"),
        post("post_attention_norm"),
        post("post_ffw_norm"),
    ]
}

/// Reads every tensor of `f` into `sink`, layer by layer.
pub(crate) fn assemble<S: TensorSink>(
    f: &GgufFile,
    c: &ModelConfig,
    mut sink: S,
) -> Result<S::Out, ModelError> {
    let want = expected(c);
    for (name, dims) in &want {
        let info = f
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.clone()))?;
        if info.dims() != dims.as_slice() {
            return Err(GgufError::Shape {
                tensor: name.clone(),
                expected: dims.clone(),
                got: info.dims().to_vec(),
            }
            .into());
        }
        if !info.ggml_type().computable() {
            return Err(GgufError::UnsupportedType {
                tensor: name.clone(),
                ty: info.ggml_type(),
            }
            .into());
        }
    }
    let names: HashSet<&str> = want.iter().map(|(n, _)| n.as_str()).collect();
    if let Some(t) = f.tensors().iter().find(|t| !names.contains(t.name())) {
        return Err(GgufError::UnexpectedTensor(t.name().to_string()).into());
    }

    let get = |name: &str| {
        f.tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.into()))
    };
    sink.embedding_t(matrix(f, get("token_embd.weight")?)?)?;
    for l in 0..c.n_layers {
        let [an, q, k, v, o, fnn, g, dn, up, bq, bk, bv, qn, kn, pa, pf] =
            layer_names(c, l).map(|e| e.map(|(n, _)| n));
        let m = |n: Option<String>| -> Result<Tensor, ModelError> {
            matrix(f, get(n.as_deref().unwrap_or_default())?)
        };
        let vector = |n: Option<String>| -> Result<Option<Vec<f32>>, ModelError> {
            n.map(|n| values(f, get(&n)?)).transpose()
        };
        let need = |v: Option<Vec<f32>>, n: &str| {
            v.ok_or_else(|| ModelError::from(GgufError::MissingTensor(n.into())))
        };
        sink.layer_t(LayerTensors {
            attn_norm: need(vector(an)?, "attn_norm")?,
            wq: m(q)?,
            wk: m(k)?,
            wv: m(v)?,
            wo: m(o)?,
            bq: vector(bq)?,
            bk: vector(bk)?,
            bv: vector(bv)?,
            q_norm: vector(qn)?,
            k_norm: vector(kn)?,
            post_attn_norm: vector(pa)?,
            ffn_norm: need(vector(fnn)?, "ffn_norm")?,
            post_ffn_norm: vector(pf)?,
            w1: m(g)?,
            w2: m(dn)?,
            w3: m(up)?,
        })?;
    }
    let final_norm = values(f, get("output_norm.weight")?)?;
    let head = if c.tied_embeddings {
        None
    } else {
        Some(matrix(f, get("output.weight")?)?)
    };
    sink.finish_t(final_norm, head)
}

/// A tensor's values as f32, every one finite.
fn values(f: &GgufFile, t: &TensorInfo) -> Result<Vec<f32>, ModelError> {
    let mut out = vec![0f32; t.elems()];
    crate::model::gguf::dequantize(t.ggml_type(), f.tensor_bytes(t), &mut out);
    finite(t.name(), &out)?;
    Ok(out)
}

fn finite(name: &str, v: &[f32]) -> Result<(), ModelError> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(GgufError::NonFinite {
            tensor: name.to_string(),
            index,
        }
        .into()),
        None => Ok(()),
    }
}

/// A 2-D tensor: f32 for the plain float types (the backend may keep
/// exact f16/bf16 compact), quantized for block formats.
fn matrix(f: &GgufFile, t: &TensorInfo) -> Result<Tensor, ModelError> {
    match t.ggml_type() {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => values(f, t).map(Tensor::F32),
        ty => {
            let (cols, rows) = (t.dims()[0] as usize, t.dims()[1] as usize);
            let q = QuantMatrix::new(t.name(), ty, rows, cols, f.tensor_bytes(t).to_vec())
                .map_err(GgufError::from)?;
            if let Some(index) = q.first_non_finite() {
                return Err(GgufError::NonFinite {
                    tensor: t.name().to_string(),
                    index,
                }
                .into());
            }
            Ok(Tensor::Quant(q))
        }
    }
}
