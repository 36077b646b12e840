//! `config.json` of a Hugging Face checkpoint -> [`ModelConfig`].
//!
//! Field spellings differ across transformers versions; everything the
//! forward pass would silently get wrong (RoPE scalings other than linear and
//! Llama 3's, a partial rotary dimension, other activations, output-projection
//! biases) is refused rather than ignored.

use serde_json::{Map, Value};

use super::gemma;
use crate::model::{ModelConfig, ModelError, RopeScaling, RopeStyle};

/// Architectures whose checkpoints this loader maps onto the Llama forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arch {
    Llama,
    Mistral,
    Qwen2,
    /// Qwen2's shape without attention biases, with per-head q/k norms.
    Qwen3,
    /// Gemma 3's text model (see [`crate::model::Gemma`]).
    Gemma3,
}

impl Arch {
    fn from_class(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" => Some(Self::Llama),
            "MistralForCausalLM" => Some(Self::Mistral),
            "Qwen2ForCausalLM" => Some(Self::Qwen2),
            "Qwen3ForCausalLM" => Some(Self::Qwen3),
            "Gemma3ForCausalLM" => Some(Self::Gemma3),
            _ => None,
        }
    }

    fn from_model_type(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "mistral" => Some(Self::Mistral),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            "gemma3_text" => Some(Self::Gemma3),
            _ => None,
        }
    }

    pub(super) fn class_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// transformers' default `max_position_embeddings` for the class.
    fn default_max_positions(self) -> usize {
        match self {
            Self::Llama => 2048,
            Self::Mistral => 4096 * 32,
            Self::Qwen2 | Self::Qwen3 => 32768,
            Self::Gemma3 => 131_072,
        }
    }
}

/// transformers' default `sliding_window` (`MistralConfig`, `Qwen2Config`)
/// when config.json omits the key.
const DEFAULT_SLIDING_WINDOW: usize = 4096;

/// The `sliding_window` of an architecture that has one: the key's value,
/// none for an explicit null, transformers' default when the key is absent.
fn sliding_window(obj: &Map<String, Value>) -> Result<Option<usize>, ModelError> {
    match obj.get("sliding_window") {
        None => Ok(Some(DEFAULT_SLIDING_WINDOW)),
        Some(_) => opt_usize(obj, "sliding_window"),
    }
}

/// A parsed and validated `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct HfConfig {
    pub(super) arch: Arch,
    pub(super) model: ModelConfig,
}

pub(super) fn invalid(msg: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig(format!("config.json: {}", msg.into()))
}

/// A field that is absent and a field that is `null` mean the same in
/// transformers' configs.
pub(super) fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(super) fn opt_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>, ModelError> {
    let Some(v) = field(obj, key) else {
        return Ok(None);
    };
    v.as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .map(Some)
        .ok_or_else(|| invalid(format!("{key} = {v} is not a non-negative integer")))
}

pub(super) fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize, ModelError> {
    opt_usize(obj, key)?.ok_or_else(|| invalid(format!("{key} is missing")))
}

pub(super) fn opt_f32(obj: &Map<String, Value>, key: &str) -> Result<Option<f32>, ModelError> {
    let Some(v) = field(obj, key) else {
        return Ok(None);
    };
    let x = v
        .as_f64()
        .ok_or_else(|| invalid(format!("{key} = {v} is not a number")))? as f32;
    if !x.is_finite() {
        return Err(invalid(format!("{key} = {v} does not fit in f32")));
    }
    Ok(Some(x))
}

pub(super) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ModelError> {
    let Some(v) = field(obj, key) else {
        return Ok(None);
    };
    v.as_bool()
        .map(Some)
        .ok_or_else(|| invalid(format!("{key} = {v} is not true/false")))
}

pub(super) fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, ModelError> {
    let Some(v) = field(obj, key) else {
        return Ok(None);
    };
    v.as_str()
        .map(Some)
        .ok_or_else(|| invalid(format!("{key} = {v} is not a string")))
}

fn arch(obj: &Map<String, Value>) -> Result<Arch, ModelError> {
    if let Some(v) = field(obj, "architectures") {
        let first = v
            .as_array()
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(format!("architectures = {v} is not a list of names")))?;
        return Arch::from_class(first)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(first.to_string()));
    }
    match opt_str(obj, "model_type")? {
        Some(t) => Arch::from_model_type(t)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(format!("model_type {t}"))),
        None => Err(ModelError::UnsupportedArchitecture(
            "(config.json names neither architectures nor model_type)".to_string(),
        )),
    }
}

/// The object-valued field `key`, if present.
pub(super) fn opt_object<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>, ModelError> {
    let Some(v) = field(obj, key) else {
        return Ok(None);
    };
    v.as_object()
        .map(Some)
        .ok_or_else(|| invalid(format!("{key} = {v} is not an object")))
}

/// The RoPE type an object names (`rope_type`, or the older `type`).
pub(super) fn rope_type(p: &Map<String, Value>) -> Result<&str, ModelError> {
    Ok(match opt_str(p, "rope_type")? {
        Some(k) => k,
        None => opt_str(p, "type")?.unwrap_or("default"),
    })
}

/// RoPE base and frequency scaling, from either spelling: transformers 5's
/// `rope_parameters` (base and scaling in one object), or the older top-level
/// `rope_theta` with an optional `rope_scaling` object. `max_positions` is
/// `max_position_embeddings`, Llama 3's fallback pre-training context.
///
/// Kinds the forward pass does not implement (those that depend on the
/// sequence length or rescale attention: dynamic, yarn, longrope, ...) and a
/// partial rotary dimension are refused: serving them as plain RoPE would
/// silently change every position.
pub(super) fn rope(
    obj: &Map<String, Value>,
    max_positions: usize,
) -> Result<(f32, RopeScaling), ModelError> {
    let params = opt_object(obj, "rope_parameters")?;
    let legacy = opt_object(obj, "rope_scaling")?;
    // Both spellings at once are served only when they say the same (where
    // they overlap): transformers takes rope_scaling's values then.
    let merged;
    let (spec, what) = match (params, legacy) {
        (Some(p), Some(l)) => {
            if rope_type(p)? != rope_type(l)? {
                return Err(invalid(format!(
                    "rope_parameters ({:?}) and rope_scaling ({:?}) disagree; keep one of them",
                    rope_type(p)?,
                    rope_type(l)?
                )));
            }
            let same = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
                (Some(x), Some(y)) => x == y,
                _ => a == b,
            };
            for (key, v) in l {
                if let Some(pv) = p.get(key).filter(|_| key != "type" && key != "rope_type")
                    && !same(pv, v)
                {
                    return Err(invalid(format!(
                        "rope_parameters.{key} = {pv} and rope_scaling.{key} = {v} disagree; keep \
                         one of them"
                    )));
                }
            }
            let mut m = p.clone();
            m.extend(l.iter().map(|(k, v)| (k.clone(), v.clone())));
            merged = m;
            (Some(&merged), "rope_scaling")
        }
        (Some(p), None) => (Some(p), "rope_parameters"),
        (None, l) => (l, "rope_scaling"),
    };
    // Per-layer-type parameters ({"full_attention": {...}, ...}) would read
    // as plain RoPE here: refuse them by name.
    if let Some((key, _)) = spec.and_then(|p| p.iter().find(|(_, v)| v.is_object())) {
        return Err(invalid(format!(
            "{what}.{key} is an object: per-layer RoPE parameters are not supported"
        )));
    }
    let theta = match params
        .map(|p| opt_f32(p, "rope_theta"))
        .transpose()?
        .flatten()
    {
        Some(t) => t,
        None => opt_f32(obj, "rope_theta")?.unwrap_or(10_000.0),
    };
    for partial in [
        spec.map(|p| opt_f32(p, "partial_rotary_factor"))
            .transpose()?
            .flatten(),
        opt_f32(obj, "partial_rotary_factor")?,
    ]
    .into_iter()
    .flatten()
    {
        if partial != 1.0 {
            return Err(invalid(format!(
                "partial_rotary_factor {partial}: handoff rotates every dimension of a head"
            )));
        }
    }
    let Some(spec) = spec else {
        return Ok((theta, RopeScaling::None));
    };
    let factor =
        |key: &str| opt_f32(spec, key)?.ok_or_else(|| invalid(format!("{what}.{key} is missing")));
    let scaling = match rope_type(spec)? {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: factor("factor")?,
        },
        "llama3" => {
            // transformers gives a top-level original_max_position_embeddings
            // priority over the one inside the object.
            let old = match opt_usize(obj, "original_max_position_embeddings")? {
                Some(n) => n,
                None => {
                    opt_usize(spec, "original_max_position_embeddings")?.unwrap_or(max_positions)
                }
            };
            RopeScaling::Llama3 {
                factor: factor("factor")?,
                low_freq_factor: factor("low_freq_factor")?,
                high_freq_factor: factor("high_freq_factor")?,
                original_max_position: u32::try_from(old).map_err(|_| {
                    invalid(format!(
                        "original_max_position_embeddings {old} is over 2^32"
                    ))
                })?,
            }
        }
        k => {
            return Err(invalid(format!(
                "{what} asks for RoPE scaling {k:?}; handoff implements plain, \"linear\" and \
                 \"llama3\" RoPE only"
            )));
        }
    };
    Ok((theta, scaling))
}

impl HfConfig {
    /// Parses and validates `config.json`'s bytes.
    pub(super) fn parse(bytes: &[u8]) -> Result<Self, ModelError> {
        let root: Value =
            serde_json::from_slice(bytes).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        let obj = root
            .as_object()
            .ok_or_else(|| invalid("top level is not an object"))?;
        let arch = arch(obj)?;

        let act = if arch == Arch::Gemma3 {
            gemma::check_activation(obj)?
        } else {
            "silu"
        };
        if let Some(got) = opt_str(obj, "hidden_act")?
            && got != act
        {
            return Err(invalid(format!(
                "hidden_act {got:?}: handoff's {} MLP is gated by {act}",
                arch.class_name()
            )));
        }
        if opt_bool(obj, "mlp_bias")? == Some(true) {
            return Err(invalid("mlp_bias = true: MLP biases are not supported"));
        }
        // Llama's (and Qwen3's) attention_bias adds an o_proj bias the
        // forward pass lacks; Qwen2 always has q/k/v biases and never an
        // o_proj bias.
        if arch != Arch::Qwen2 && opt_bool(obj, "attention_bias")? == Some(true) {
            return Err(invalid(
                "attention_bias = true (with an o_proj bias) is not supported",
            ));
        }

        let dim = req_usize(obj, "hidden_size")?;
        let hidden_dim = req_usize(obj, "intermediate_size")?;
        let n_layers = req_usize(obj, "num_hidden_layers")?;
        let n_heads = req_usize(obj, "num_attention_heads")?;
        let vocab_size = req_usize(obj, "vocab_size")?;
        if n_heads == 0 {
            return Err(invalid("num_attention_heads is 0"));
        }
        let n_kv_heads = opt_usize(obj, "num_key_value_heads")?.unwrap_or(n_heads);
        let head_dim = match opt_usize(obj, "head_dim")? {
            Some(h) => h,
            // Qwen3Config's and Gemma3TextConfig's defaults, not
            // hidden_size / heads.
            None if arch == Arch::Qwen3 => 128,
            None if arch == Arch::Gemma3 => 256,
            None if dim.is_multiple_of(n_heads) => dim / n_heads,
            None => {
                return Err(invalid(format!(
                    "head_dim is absent and hidden_size {dim} is not a multiple of num_attention_heads {n_heads}"
                )));
            }
        };
        let mut max_seq_len =
            opt_usize(obj, "max_position_embeddings")?.unwrap_or(arch.default_max_positions());
        // Within its window, sliding-window attention equals full attention:
        // serve only that far rather than attend to positions the model never would.
        let sliding = match arch {
            Arch::Llama => None,
            Arch::Mistral => sliding_window(obj)?,
            // Qwen2 uses its window only when asked (on the layers past
            // `max_window_layers`; within the window every layer attends
            // fully, so capping the context is exact for all of them).
            Arch::Qwen2 | Arch::Qwen3 if opt_bool(obj, "use_sliding_window")? == Some(true) => {
                sliding_window(obj)?
            }
            Arch::Qwen2 | Arch::Qwen3 => None,
            // Gemma's window is a mask on its local layers only.
            Arch::Gemma3 => None,
        };
        if let Some(w) = sliding {
            max_seq_len = max_seq_len.min(w);
        }

        let max_positions =
            opt_usize(obj, "max_position_embeddings")?.unwrap_or(arch.default_max_positions());
        let (rope_theta, rope_scaling, gemma) = if arch == Arch::Gemma3 {
            let (theta, scaling, g) = gemma::parse(obj, n_layers, max_positions)?;
            (theta, scaling, Some(g))
        } else {
            let (theta, scaling) = rope(obj, max_positions)?;
            (theta, scaling, None)
        };
        let model = ModelConfig {
            dim,
            hidden_dim,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            max_seq_len,
            rope_theta,
            rope_style: RopeStyle::Half,
            rope_scaling,
            norm_eps: opt_f32(obj, "rms_norm_eps")?.unwrap_or(1e-6),
            // transformers ties by default; handoff's older classes read
            // an absent key as untied, Gemma (always tied) as tied.
            tied_embeddings: opt_bool(obj, "tie_word_embeddings")?.unwrap_or(arch == Arch::Gemma3),
            attention_bias: arch == Arch::Qwen2,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
            gemma,
        };
        model.validate()?;
        for (what, a, b) in [
            ("num_attention_heads * head_dim", n_heads, head_dim),
            ("num_key_value_heads * head_dim", n_kv_heads, head_dim),
            ("vocab_size * hidden_size", vocab_size, dim),
            ("intermediate_size * hidden_size", hidden_dim, dim),
        ] {
            if a.checked_mul(b).is_none_or(|n| n > isize::MAX as usize / 4) {
                return Err(invalid(format!("{what} overflows")));
            }
        }
        Ok(Self { arch, model })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<HfConfig, ModelError> {
        HfConfig::parse(json.as_bytes())
    }

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100"#;

    fn with(arch: &str, extra: &str) -> String {
        format!(r#"{{"architectures": ["{arch}"], {BASE}{extra}}}"#)
    }

    #[test]
    fn older_llama_spelling_with_defaults() {
        let c = parse(&with("LlamaForCausalLM", "")).unwrap();
        assert_eq!(c.arch, Arch::Llama);
        let m = c.model;
        assert_eq!((m.n_kv_heads, m.head_dim), (4, 16));
        assert_eq!(m.rope_theta, 10_000.0);
        assert_eq!(m.rope_style, RopeStyle::Half);
        assert_eq!(m.norm_eps, 1e-6);
        assert_eq!(m.max_seq_len, 2048);
        assert!(!m.tied_embeddings && !m.attention_bias);
    }

    #[test]
    fn newer_rope_parameters_spelling_wins_over_top_level() {
        let c = parse(&with(
            "LlamaForCausalLM",
            r#", "rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
               "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 128, "tie_word_embeddings": true"#,
        ))
        .unwrap();
        let m = c.model;
        assert_eq!(m.rope_theta, 500_000.0);
        assert_eq!((m.n_kv_heads, m.head_dim), (2, 32));
        assert_eq!((m.norm_eps, m.max_seq_len), (1e-5, 128));
        assert!(m.tied_embeddings);
    }

    #[test]
    fn llama3_rope_scaling_in_both_spellings() {
        // Llama-3.2-1B's config.json (transformers 4.x spelling).
        let old = parse(&with(
            "LlamaForCausalLM",
            r#", "max_position_embeddings": 131072, "rope_theta": 500000.0,
               "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
        ))
        .unwrap()
        .model;
        let want = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        };
        assert_eq!((old.rope_theta, old.rope_scaling), (500_000.0, want));
        assert_eq!(old.max_seq_len, 131_072);
        // transformers 5 spelling: one object with the base.
        let new = parse(&with(
            "LlamaForCausalLM",
            r#", "max_position_embeddings": 131072,
               "rope_parameters": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3",
                                   "rope_theta": 500000.0}"#,
        ))
        .unwrap()
        .model;
        assert_eq!(new, old);
        // A top-level original_max_position_embeddings wins (as in
        // transformers), and without either the window is the fallback.
        let top = parse(&with(
            "LlamaForCausalLM",
            r#", "max_position_embeddings": 4096, "original_max_position_embeddings": 1024,
               "rope_scaling": {"type": "llama3", "factor": 2.0, "high_freq_factor": 4.0,
                                "low_freq_factor": 1.0, "original_max_position_embeddings": 64}"#,
        ))
        .unwrap()
        .model;
        assert!(matches!(
            top.rope_scaling,
            RopeScaling::Llama3 {
                original_max_position: 1024,
                ..
            }
        ));
        let fallback = parse(&with(
            "LlamaForCausalLM",
            r#", "max_position_embeddings": 4096,
               "rope_scaling": {"type": "llama3", "factor": 2.0, "high_freq_factor": 4.0,
                                "low_freq_factor": 1.0}"#,
        ))
        .unwrap()
        .model;
        assert!(matches!(
            fallback.rope_scaling,
            RopeScaling::Llama3 {
                original_max_position: 4096,
                ..
            }
        ));
        let linear = parse(&with(
            "LlamaForCausalLM",
            r#", "rope_scaling": {"type": "linear", "factor": 4.0}"#,
        ))
        .unwrap()
        .model;
        assert_eq!(linear.rope_scaling, RopeScaling::Linear { factor: 4.0 });
        // Both spellings at once are fine when they agree.
        let both = parse(&with(
            "LlamaForCausalLM",
            r#", "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
               "rope_scaling": {"type": "linear", "factor": 4.0}"#,
        ))
        .unwrap()
        .model;
        assert_eq!(both.rope_scaling, RopeScaling::Linear { factor: 4.0 });
    }

    #[test]
    fn qwen2_has_attention_bias_and_mistral_window_caps_context() {
        let q = parse(&with(
            "Qwen2ForCausalLM",
            r#", "sliding_window": 16, "use_sliding_window": false"#,
        ))
        .unwrap();
        assert!(q.model.attention_bias);
        assert_eq!(q.model.max_seq_len, 32768);
        let m = parse(&with(
            "MistralForCausalLM",
            r#", "sliding_window": 4096, "max_position_embeddings": 32768"#,
        ))
        .unwrap();
        assert_eq!(m.model.max_seq_len, 4096);
        assert!(!m.model.attention_bias);
    }

    #[test]
    fn qwen3_has_q_k_norms_no_biases_and_transformers_head_dim_default() {
        let q = parse(&with("Qwen3ForCausalLM", "")).unwrap();
        assert_eq!(q.arch, Arch::Qwen3);
        let m = &q.model;
        assert!(m.qk_norm && !m.attention_bias);
        // Qwen3Config's default head_dim, not hidden_size / heads (16).
        assert_eq!(m.head_dim, 128);
        assert_eq!((m.max_seq_len, m.rope_style), (32768, RopeStyle::Half));
        let by_type = parse(
            r#"{"model_type": "qwen3", "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 100, "head_dim": 32}"#,
        )
        .unwrap();
        assert_eq!((by_type.arch, by_type.model.head_dim), (Arch::Qwen3, 32));
        for arch in ["LlamaForCausalLM", "Qwen2ForCausalLM"] {
            assert!(!parse(&with(arch, "")).unwrap().model.qk_norm, "{arch}");
        }
        // Its attention_bias would add an o_proj bias: refused.
        assert!(parse(&with("Qwen3ForCausalLM", r#", "attention_bias": true"#)).is_err());
    }

    /// A Mistral config.json written without `sliding_window` gets
    /// transformers' default window of 4096, which caps the context; an
    /// explicit null is the only way to turn the window off.
    #[test]
    fn mistral_window_absent_means_4096_and_null_means_none() {
        let long = r#", "max_position_embeddings": 32768"#;
        let absent = parse(&with("MistralForCausalLM", long)).unwrap();
        assert_eq!(absent.model.max_seq_len, 4096);
        let null = parse(&with(
            "MistralForCausalLM",
            &format!(r#"{long}, "sliding_window": null"#),
        ))
        .unwrap();
        assert_eq!(null.model.max_seq_len, 32768);
        // A context shorter than the default window is not stretched.
        let short = parse(&with(
            "MistralForCausalLM",
            r#", "max_position_embeddings": 1024"#,
        ))
        .unwrap();
        assert_eq!(short.model.max_seq_len, 1024);
        // Other architectures keep no window when the key is absent.
        for arch in ["LlamaForCausalLM", "Qwen2ForCausalLM"] {
            let c = parse(&with(arch, long)).unwrap();
            assert_eq!(c.model.max_seq_len, 32768, "{arch}");
        }
    }

    /// Qwen2 with `use_sliding_window` and no `sliding_window` key gets
    /// transformers' default window of 4096; without `use_sliding_window`
    /// no window applies, whatever the key says.
    #[test]
    fn qwen2_window_applies_only_when_used_and_defaults_to_4096() {
        let long = r#", "max_position_embeddings": 32768"#;
        let used = |extra: &str| {
            parse(&with(
                "Qwen2ForCausalLM",
                &format!(r#"{long}, "use_sliding_window": true{extra}"#),
            ))
            .unwrap()
            .model
            .max_seq_len
        };
        assert_eq!(used(""), 4096);
        assert_eq!(used(r#", "sliding_window": 1024"#), 1024);
        assert_eq!(used(r#", "sliding_window": null"#), 32768);
        let unused = parse(&with(
            "Qwen2ForCausalLM",
            &format!(r#"{long}, "use_sliding_window": false, "sliding_window": 1024"#),
        ))
        .unwrap();
        assert_eq!(unused.model.max_seq_len, 32768);
    }

    #[test]
    fn model_type_is_the_fallback_for_architectures() {
        let c = parse(&format!(r#"{{"model_type": "mistral", {BASE}}}"#)).unwrap();
        assert_eq!(c.arch, Arch::Mistral);
    }

    #[test]
    fn refusals_are_typed() {
        let cases: &[(String, &str)] = &[
            (with("GPT2LMHeadModel", ""), "unsupported architecture"),
            (format!("{{{BASE}}}"), "neither architectures"),
            ("[1, 2]".to_string(), "not an object"),
            ("{\"hidden_size\": ".to_string(), "not valid JSON"),
            (
                r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}"#.to_string(),
                "intermediate_size is missing",
            ),
            (
                with("LlamaForCausalLM", r#", "num_key_value_heads": 3"#),
                "does not divide",
            ),
            (
                with("LlamaForCausalLM", r#", "num_key_value_heads": -1"#),
                "not a non-negative integer",
            ),
            (
                with(
                    "LlamaForCausalLM",
                    r#", "rope_scaling": {"rope_type": "llama3"}"#,
                ),
                "rope_scaling.factor is missing",
            ),
            (
                with(
                    "LlamaForCausalLM",
                    r#", "rope_scaling": {"type": "dynamic", "factor": 2.0}"#,
                ),
                "RoPE scaling \"dynamic\"",
            ),
            (
                with(
                    "LlamaForCausalLM",
                    r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                        "low_freq_factor": 4.0, "high_freq_factor": 4.0}"#,
                ),
                "below high_freq_factor",
            ),
            (
                with(
                    "LlamaForCausalLM",
                    r#", "rope_scaling": {"rope_type": "linear", "factor": 0.0}"#,
                ),
                "factor 0 is not a positive number",
            ),
            (
                with(
                    "LlamaForCausalLM",
                    r#", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                        "rope_scaling": {"rope_type": "linear", "factor": 2.0}"#,
                ),
                "disagree",
            ),
            (
                with("LlamaForCausalLM", r#", "partial_rotary_factor": 0.5"#),
                "partial_rotary_factor",
            ),
            (
                with(
                    "LlamaForCausalLM",
                    r#", "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
                        "rope_scaling": {"type": "linear", "factor": 2.0}"#,
                ),
                "rope_parameters.factor = 4.0 and rope_scaling.factor = 2.0 disagree",
            ),
            (
                with(
                    "LlamaForCausalLM",
                    r#", "rope_parameters": {"full_attention": {"rope_type": "default",
                        "rope_theta": 1e4}, "sliding_attention": {"rope_type": "default"}}"#,
                ),
                "per-layer RoPE parameters",
            ),
            (
                with(
                    "LlamaForCausalLM",
                    r#", "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}"#,
                ),
                "partial_rotary_factor",
            ),
            (
                with(
                    "LlamaForCausalLM",
                    r#", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}"#,
                ),
                "RoPE scaling",
            ),
            (
                with("LlamaForCausalLM", r#", "hidden_act": "gelu""#),
                "hidden_act",
            ),
            (
                with("LlamaForCausalLM", r#", "attention_bias": true"#),
                "attention_bias",
            ),
            (with("LlamaForCausalLM", r#", "rope_theta": 1e300"#), "f32"),
            (
                with("LlamaForCausalLM", r#", "rms_norm_eps": "x""#),
                "number",
            ),
            (
                with("LlamaForCausalLM", r#", "head_dim": 9223372036854775808"#),
                "overflows",
            ),
        ];
        for (json, needle) in cases {
            let err = parse(json).unwrap_err().to_string();
            assert!(err.contains(needle), "{json}\n -> {err}\n lacks {needle:?}");
        }
    }
}
