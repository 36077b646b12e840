use crate::backend::{RopeScaling, RopeStyle};
use crate::kv::{KvDtype, KvGeometry};
use crate::model::ModelError;

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
    /// Each query and key head is RMS-normed (gains of `head_dim`, the
    /// model's `norm_eps`) after its projection and before RoPE (Qwen3).
    pub qk_norm: bool,
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
