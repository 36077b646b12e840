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
    /// `[dim]`
    pub ffn_norm: Vec<f32>,
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
}
