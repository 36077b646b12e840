use crate::model::ModelConfig;

/// One transformer block. Matrices are row-major `[out, in]` (the layout of
/// both llama2.c files and Hugging Face `nn.Linear` weights).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// `[dim]`
    pub attn_norm: Vec<f32>,
    /// `[n_heads * head_dim, dim]`
    pub wq: Vec<f32>,
    /// `[n_kv_heads * head_dim, dim]`
    pub wk: Vec<f32>,
    /// `[n_kv_heads * head_dim, dim]`
    pub wv: Vec<f32>,
    /// `[dim, n_heads * head_dim]`
    pub wo: Vec<f32>,
    /// `[n_heads * head_dim]`, when `attention_bias`
    pub bq: Option<Vec<f32>>,
    /// `[n_kv_heads * head_dim]`, when `attention_bias`
    pub bk: Option<Vec<f32>>,
    /// `[n_kv_heads * head_dim]`, when `attention_bias`
    pub bv: Option<Vec<f32>>,
    /// `[head_dim]`, one gain per element of every query head, when
    /// `qk_norm`
    pub q_norm: Option<Vec<f32>>,
    /// `[head_dim]`, for every key head, when `qk_norm`
    pub k_norm: Option<Vec<f32>>,
    /// `[dim]`, Gemma's norm of the attention output before the residual
    /// add, when `gemma`
    pub post_attn_norm: Option<Vec<f32>>,
    /// `[dim]`
    pub ffn_norm: Vec<f32>,
    /// `[dim]`, Gemma's norm of the feed-forward output before the
    /// residual add, when `gemma`
    pub post_ffn_norm: Option<Vec<f32>>,
    /// gate: `[hidden_dim, dim]`
    pub w1: Vec<f32>,
    /// down: `[dim, hidden_dim]`
    pub w2: Vec<f32>,
    /// up: `[hidden_dim, dim]`
    pub w3: Vec<f32>,
}

/// All weights of a Llama-family model, in f32.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelWeights {
    pub config: ModelConfig,
    /// `[vocab_size, dim]`
    pub embedding: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    /// `[dim]`
    pub final_norm: Vec<f32>,
    /// `[vocab_size, dim]`; `None` when tied to `embedding`.
    pub lm_head: Option<Vec<f32>>,
}

impl ModelWeights {
    /// The output projection `[vocab_size, dim]`.
    pub fn output(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embedding)
    }

    /// Rounds every matrix (embedding, output head, each layer's
    /// projections) to the nearest bf16 value, as if loaded from a bf16
    /// checkpoint: backends then keep them as bf16. Norm gains and biases
    /// stay f32.
    pub fn round_matrices_to_bf16(&mut self) {
        self.round_matrices(|x| half::bf16::from_f32(x).to_f32());
    }

    /// Rounds every matrix to the nearest f16 value, as if loaded from an
    /// f16 checkpoint (values past f16's range become infinite, as they
    /// would in one): backends then keep them as f16. Norm gains and
    /// biases stay f32.
    pub fn round_matrices_to_f16(&mut self) {
        self.round_matrices(|x| half::f16::from_f32(x).to_f32());
    }

    fn round_matrices(&mut self, to: impl Fn(f32) -> f32) {
        let round = |v: &mut Vec<f32>| {
            for x in v.iter_mut() {
                *x = to(*x);
            }
        };
        round(&mut self.embedding);
        if let Some(head) = self.lm_head.as_mut() {
            round(head);
        }
        for l in &mut self.layers {
            for v in [
                &mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo, &mut l.w1, &mut l.w2, &mut l.w3,
            ] {
                round(v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::model::{ModelConfig, random_weights};

    fn small() -> crate::model::ModelWeights {
        let mut cfg = ModelConfig::llama_3_2_1b_shape(2);
        (cfg.dim, cfg.hidden_dim, cfg.vocab_size) = (64, 96, 50);
        (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) = (4, 2, 16);
        cfg.tied_embeddings = false;
        random_weights(&cfg, 3)
    }

    #[test]
    fn rounding_to_f16_leaves_every_matrix_f16_exact_most_not_bf16_and_the_norms_alone() {
        let w0 = small();
        let mut w = w0.clone();
        w.round_matrices_to_f16();
        let f16 = |v: &[f32]| v.iter().all(|&x| half::f16::from_f32(x).to_f32() == x);
        let bf16 = |v: &[f32]| v.iter().all(|&x| half::bf16::from_f32(x).to_f32() == x);
        let head = w.lm_head.as_deref().unwrap_or(&[]);
        assert!(!head.is_empty() && f16(head) && f16(&w.embedding) && !bf16(&w.embedding));
        for l in &w.layers {
            assert!(
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w1, &l.w2, &l.w3]
                    .iter()
                    .all(|v| f16(v))
            );
        }
        // Nearest: within half an f16 ulp (2^-11 relative) of normal values.
        for (a, b) in w0.embedding.iter().zip(&w.embedding) {
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-11) + 2f32.powi(-25));
        }
        assert_eq!(w.final_norm, w0.final_norm);
        assert_eq!(w.layers[0].attn_norm, w0.layers[0].attn_norm);
    }

    #[test]
    fn rounding_to_bf16_leaves_every_matrix_bf16_exact_and_the_norms_alone() {
        let w0 = small();
        let mut w = w0.clone();
        w.round_matrices_to_bf16();
        let exact = |v: &[f32]| v.iter().all(|&x| half::bf16::from_f32(x).to_f32() == x);
        let head = w.lm_head.as_deref().unwrap_or(&[]);
        assert!(!head.is_empty() && exact(head) && exact(&w.embedding));
        for l in &w.layers {
            assert!(
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w1, &l.w2, &l.w3]
                    .iter()
                    .all(|v| exact(v))
            );
        }
        // Nearest, not truncated: within half a bf16 ulp (2^-8 relative).
        for (a, b) in w0.embedding.iter().zip(&w.embedding) {
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-8));
        }
        assert_eq!(w.final_norm, w0.final_norm);
        assert_eq!(w.layers[0].attn_norm, w0.layers[0].attn_norm);
        assert_ne!(
            w.embedding, w0.embedding,
            "random f32 weights are not bf16 already"
        );
    }
}
