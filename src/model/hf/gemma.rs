//! The Gemma 3 part of a `config.json` (`Gemma3ForCausalLM`, model type
//! `gemma3_text`): its activation, the local/global layer pattern, the two
//! RoPE bases, the attention scale and the soft-caps.

use serde_json::{Map, Value};

use super::config::{
    field, invalid, opt_bool, opt_f32, opt_object, opt_str, opt_usize, rope, rope_type,
};
use crate::model::{Gemma, ModelError, RopeScaling};

/// The activation of Gemma's gated MLP; anything else is refused.
pub(super) fn check_activation(obj: &Map<String, Value>) -> Result<&'static str, ModelError> {
    const TANH: &str = "gelu_pytorch_tanh";
    match opt_str(obj, "hidden_activation")? {
        None | Some(TANH) => Ok(TANH),
        Some(a) => Err(invalid(format!(
            "hidden_activation {a:?}: handoff's Gemma MLP is gated by {TANH}"
        ))),
    }
}

/// The global RoPE base and scaling (which local layers do not use) and
/// Gemma's block, with Gemma3TextConfig's defaults for absent keys.
pub(super) fn parse(
    obj: &Map<String, Value>,
    n_layers: usize,
    max_positions: usize,
) -> Result<(f32, RopeScaling, Gemma), ModelError> {
    if opt_f32(obj, "attn_logit_softcapping")?.is_some() {
        return Err(invalid(
            "attn_logit_softcapping is set: attention soft-capping is not supported",
        ));
    }
    if opt_bool(obj, "use_bidirectional_attention")? == Some(true) {
        return Err(invalid(
            "use_bidirectional_attention = true: handoff serves causal Gemma models only",
        ));
    }
    let (theta, scaling, local_rope_theta) = ropes(obj, max_positions)?;
    let gemma = Gemma {
        sliding_window: opt_usize(obj, "sliding_window")?.unwrap_or(4096),
        global_every: global_every(obj, n_layers)?,
        local_rope_theta,
        query_pre_attn_scalar: opt_f32(obj, "query_pre_attn_scalar")?.unwrap_or(256.0),
        final_logit_softcap: opt_f32(obj, "final_logit_softcapping")?,
    };
    Ok((theta, scaling, gemma))
}

/// Global base and scaling, local base: transformers 5's per-layer-type
/// `rope_parameters` (`full_attention`, `sliding_attention`), or the older
/// `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq`.
fn ropes(
    obj: &Map<String, Value>,
    max_positions: usize,
) -> Result<(f32, RopeScaling, f32), ModelError> {
    let mut global = obj.clone();
    let per_type = opt_object(obj, "rope_parameters")?
        .filter(|p| p.contains_key("full_attention") || p.contains_key("sliding_attention"));
    let local = match per_type {
        Some(p) => {
            let full = opt_object(p, "full_attention")?
                .ok_or_else(|| invalid("rope_parameters.full_attention is missing"))?;
            global.remove("rope_scaling");
            global.insert("rope_parameters".into(), Value::Object(full.clone()));
            match opt_object(p, "sliding_attention")? {
                Some(s) if rope_type(s)? != "default" => {
                    return Err(invalid(format!(
                        "rope_parameters.sliding_attention asks for RoPE scaling {:?}: Gemma's \
                         local layers rotate plainly",
                        rope_type(s)?
                    )));
                }
                Some(s) => opt_f32(s, "rope_theta")?,
                None => None,
            }
        }
        None => opt_f32(obj, "rope_local_base_freq")?,
    };
    // Gemma3TextConfig's global base when none is given.
    let has_theta = field(obj, "rope_theta").is_some()
        || opt_object(&global, "rope_parameters")?
            .is_some_and(|p| field(p, "rope_theta").is_some());
    if !has_theta {
        global.insert("rope_theta".into(), Value::from(1_000_000.0));
    }
    let (theta, scaling) = rope(&global, max_positions)?;
    Ok((theta, scaling, local.unwrap_or(10_000.0)))
}

/// The period of global layers: from `layer_types` (which must repeat
/// `global_every - 1` sliding layers then a full one), else
/// `sliding_window_pattern`, else 6.
fn global_every(obj: &Map<String, Value>, n_layers: usize) -> Result<usize, ModelError> {
    let Some(v) = field(obj, "layer_types") else {
        return Ok(opt_usize(obj, "sliding_window_pattern")?.unwrap_or(6));
    };
    let types = v
        .as_array()
        .ok_or_else(|| invalid(format!("layer_types = {v} is not a list")))?;
    if types.len() != n_layers {
        return Err(invalid(format!(
            "layer_types names {} layers, num_hidden_layers is {n_layers}",
            types.len()
        )));
    }
    let mut full = Vec::with_capacity(types.len());
    for t in types {
        full.push(match t.as_str() {
            Some("full_attention") => true,
            Some("sliding_attention") => false,
            _ => {
                return Err(invalid(format!(
                    "layer_types holds {t}: only \"sliding_attention\" and \"full_attention\" are \
                     served"
                )));
            }
        });
    }
    // No full layer among them: every layer is local.
    let every = full.iter().position(|&f| f).map_or(n_layers + 1, |i| i + 1);
    if let Some(i) = (0..n_layers).find(|&i| full[i] != (i + 1).is_multiple_of(every)) {
        return Err(invalid(format!(
            "layer_types: layer {i} breaks the pattern of a full-attention layer every {every}; \
             handoff serves periodic patterns only"
        )));
    }
    Ok(every)
}

#[cfg(test)]
mod tests {
    use crate::model::hf::config::HfConfig;
    use crate::model::{RopeScaling, RopeStyle};

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 12,
        "num_attention_heads": 4, "vocab_size": 100"#;

    #[test]
    fn gemma3_text_config_defaults_are_transformers_defaults() {
        let c = HfConfig::parse(format!(r#"{{"model_type": "gemma3_text", {BASE}}}"#).as_bytes())
            .unwrap()
            .model;
        let g = c.gemma.unwrap();
        assert_eq!(
            (c.head_dim, c.max_seq_len, c.rope_theta),
            (256, 131_072, 1e6)
        );
        assert_eq!(
            (c.rope_style, c.rope_scaling),
            (RopeStyle::Half, RopeScaling::None)
        );
        assert!(c.tied_embeddings && c.qk_norm && !c.attention_bias);
        assert_eq!((g.sliding_window, g.global_every), (4096, 6));
        assert_eq!((g.local_rope_theta, g.query_pre_attn_scalar), (1e4, 256.0));
        assert_eq!(g.final_logit_softcap, None);
        let global: Vec<usize> = (0..12).filter(|&i| g.is_global(i)).collect();
        assert_eq!(global, [5, 11]);
        assert_eq!((g.window(4), g.window(5)), (Some(4096), None));
    }

    #[test]
    fn rope_scaling_is_the_global_layers_and_the_pattern_comes_from_either_key() {
        let c = HfConfig::parse(
            format!(
                r#"{{"architectures": ["Gemma3ForCausalLM"], {BASE}, "rope_theta": 1e6,
                "rope_scaling": {{"rope_type": "linear", "factor": 8.0}},
                "rope_local_base_freq": 5e3, "sliding_window_pattern": 4,
                "sliding_window": 512, "final_logit_softcapping": 30.0}}"#
            )
            .as_bytes(),
        )
        .unwrap()
        .model;
        let g = c.gemma.unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!((g.local_rope_theta, g.global_every), (5e3, 4));
        assert_eq!((g.sliding_window, g.final_logit_softcap), (512, Some(30.0)));
        // layer_types with every layer local: no global layer.
        let types = ["\"sliding_attention\""; 12].join(",");
        let all_local = HfConfig::parse(
            format!(r#"{{"model_type": "gemma3_text", {BASE}, "layer_types": [{types}]}}"#)
                .as_bytes(),
        )
        .unwrap()
        .model
        .gemma
        .unwrap();
        assert!((0..12).all(|i| !all_local.is_global(i)));
    }
}
