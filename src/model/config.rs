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
    /// Gemma 3's block, when set (see [`Gemma`]).
    pub gemma: Option<Gemma>,
}

/// What Gemma 3 changes in the Llama block. A Gemma model also has per-head
/// q/k norms (`qk_norm`), and every norm gain is the multiplier itself
/// (Hugging Face's `1 + w` is added at load; GGUF files store it so).
///
/// - the embedding rows are scaled by `sqrt(dim)`;
/// - each attention and feed-forward output is RMS-normed (its own gains)
///   before it is added to the residual stream;
/// - the feed-forward is GELU (tanh) gated: `gelu(x·W_gate) ⊙ x·W_up`;
/// - layer `i` is global when `(i + 1) % global_every == 0` (RoPE base
///   `rope_theta` and `rope_scaling`, the whole context); the others are
///   local (RoPE base `local_rope_theta`, no scaling, each query attending
///   only to the last `sliding_window` positions, its own included);
/// - attention scores are scaled by `1 / sqrt(query_pre_attn_scalar)`;
/// - the final logits are soft-capped (`cap · tanh(x / cap)`) when set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemma {
    pub sliding_window: usize,
    pub global_every: usize,
    pub local_rope_theta: f32,
    pub query_pre_attn_scalar: f32,
    pub final_logit_softcap: Option<f32>,
}

impl Gemma {
    /// Whether layer `i` attends to the whole context.
    pub fn is_global(&self, i: usize) -> bool {
        (i + 1).is_multiple_of(self.global_every)
    }

    /// The attention window of layer `i`: `None` for a global layer.
    pub fn window(&self, i: usize) -> Option<usize> {
        (!self.is_global(i)).then_some(self.sliding_window)
    }

    fn validate(&self, c: &ModelConfig) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::InvalidConfig(m));
        if self.sliding_window == 0 || self.global_every == 0 {
            return bad(format!(
                "sliding window {} and global layer period {} must be positive",
                self.sliding_window, self.global_every
            ));
        }
        if self.sliding_window > c.max_seq_len {
            return bad(format!(
                "sliding window of {} positions is larger than the context of {}",
                self.sliding_window, c.max_seq_len
            ));
        }
        for (what, x) in [
            ("local RoPE base", self.local_rope_theta),
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            (
                "final logit soft-cap",
                self.final_logit_softcap.unwrap_or(1.0),
            ),
        ] {
            if !(x.is_finite() && x > 0.0) {
                return bad(format!("{what} {x} is not a positive number"));
            }
        }
        if !c.qk_norm {
            return bad("a Gemma model has per-head q/k norms: qk_norm must be on".into());
        }
        if c.attention_bias {
            return bad("a Gemma model has no attention biases".into());
        }
        Ok(())
    }
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
        if let Some(g) = &self.gemma {
            g.validate(self)?;
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
