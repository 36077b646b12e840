use crate::config::{KvDtype, KvGeometry};
use crate::model::ModelError;

/// Which pairs of dimensions rotary embeddings rotate together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): Meta's original checkpoints and llama2.c.
    Interleaved,
    /// Dimension i with i + head_dim/2 ("rotate half"): Hugging Face checkpoints.
    Half,
}

/// How a checkpoint stretches RoPE's frequencies beyond the context it was
/// pre-trained on. Each variant is exact for every position (none depends on
/// the sequence length), so a cached K stays valid as the sequence grows.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: frequency `i` is `theta^(-2i/head_dim)`.
    #[default]
    None,
    /// Every frequency divided by `factor` (transformers' `"linear"`).
    Linear { factor: f32 },
    /// Llama 3.1's frequency-dependent scaling (transformers' `"llama3"`):
    /// wavelengths shorter than `original_max_position / high_freq_factor`
    /// are kept, those longer than `original_max_position / low_freq_factor`
    /// are stretched by `factor`, and those between are interpolated.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        /// The context length of pre-training.
        original_max_position: u32,
    },
}

impl RopeScaling {
    /// The rotation frequency (radians per position) of pair `i` of a head
    /// of `head_dim` elements, in f64 (angles reach 10^6 radians).
    pub fn inv_freq(self, theta: f32, i: usize, head_dim: usize) -> f64 {
        let base = f64::from(theta).powf(-((2 * i) as f64) / head_dim as f64);
        match self {
            Self::None => base,
            Self::Linear { factor } => base / f64::from(factor),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let (factor, low, high) = (
                    f64::from(factor),
                    f64::from(low_freq_factor),
                    f64::from(high_freq_factor),
                );
                let old = f64::from(original_max_position);
                let wavelen = 2.0 * std::f64::consts::PI / base;
                if wavelen < old / high {
                    base
                } else if wavelen > old / low {
                    base / factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * base / factor + smooth * base
                }
            }
        }
    }

    /// Checks the parameters: finite, positive factors, and for Llama 3
    /// `low_freq_factor < high_freq_factor` (the interpolation divides by
    /// their difference) and a non-zero pre-training context.
    pub fn validate(self) -> Result<(), ModelError> {
        let positive = |name: &str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ModelError::InvalidConfig(format!(
                    "RoPE scaling {name} {v} is not a positive number"
                )))
            }
        };
        match self {
            Self::None => Ok(()),
            Self::Linear { factor } => positive("factor", factor),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if low_freq_factor >= high_freq_factor {
                    return Err(ModelError::InvalidConfig(format!(
                        "llama3 RoPE scaling needs low_freq_factor {low_freq_factor} below \
                         high_freq_factor {high_freq_factor}"
                    )));
                }
                if original_max_position == 0 {
                    return Err(ModelError::InvalidConfig(
                        "llama3 RoPE scaling's original_max_position_embeddings is 0".to_string(),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// Hyper-parameters of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Residual stream width.
    pub dim: usize,
    /// SwiGLU inner width.
    pub hidden_dim: usize,
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads; divides `n_heads` (GQA when smaller, MQA when 1).
    pub n_kv_heads: usize,
    /// Elements per head (often `dim / n_heads`, but not always).
    pub head_dim: usize,
    pub vocab_size: usize,
    /// Longest sequence the model was trained for.
    pub max_seq_len: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    /// RoPE frequency scaling (Llama 3.1 and later checkpoints).
    pub rope_scaling: RopeScaling,
    pub norm_eps: f32,
    /// Output projection shares the token embedding.
    pub tied_embeddings: bool,
    /// Q/K/V projections have biases (Qwen2).
    pub attention_bias: bool,
}

impl ModelConfig {
    /// Checks that the shapes are consistent.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::InvalidConfig(m));
        for (name, v) in [
            ("dim", self.dim),
            ("hidden_dim", self.hidden_dim),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_seq_len", self.max_seq_len),
        ] {
            if v == 0 {
                return bad(format!("{name} is 0"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "n_kv_heads {} does not divide n_heads {}",
                self.n_kv_heads, self.n_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} is odd: RoPE needs pairs",
                self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope_theta {} is not positive", self.rope_theta));
        }
        self.rope_scaling.validate()?;
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            return bad(format!("norm_eps {} is invalid", self.norm_eps));
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// KV geometry of this model with the given storage dtype.
    pub fn kv_geometry(&self, dtype: KvDtype) -> KvGeometry {
        KvGeometry {
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            dtype,
        }
    }
}
