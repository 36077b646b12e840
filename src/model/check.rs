//! Shape checks of a [`ModelWeights`] against its own config, for weights
//! built by any loader or by hand.

use crate::model::{LayerWeights, ModelConfig, ModelError, ModelWeights};

impl ModelWeights {
    /// Checks the config and that every tensor has the length its shape
    /// needs. A mismatch names the tensor and the expected shape.
    pub fn check_shapes(&self) -> Result<(), ModelError> {
        let c = &self.config;
        c.validate()?;
        let d = c.dim;
        check("embedding".into(), &self.embedding, vec![c.vocab_size, d])?;
        check("final_norm".into(), &self.final_norm, vec![d])?;
        check_output(self.lm_head.as_deref(), c)?;
        if self.layers.len() != c.n_layers {
            return Err(ModelError::Shape {
                tensor: "layers".into(),
                expected: vec![c.n_layers],
                got: vec![self.layers.len()],
            });
        }
        for (i, l) in self.layers.iter().enumerate() {
            l.check(i, c)?;
        }
        Ok(())
    }
}

impl LayerWeights {
    /// Checks that layer `i`'s tensors have the lengths `c` needs (and its
    /// biases, q/k norms and Gemma's post norms are present exactly when
    /// `c` has them).
    pub(crate) fn check(&self, i: usize, c: &ModelConfig) -> Result<(), ModelError> {
        let (d, h) = (c.dim, c.hidden_dim);
        let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let n = |t: &str| format!("layers.{i}.{t}");
        check(n("attn_norm"), &self.attn_norm, vec![d])?;
        check(n("wq"), &self.wq, vec![qd, d])?;
        check(n("wk"), &self.wk, vec![kvd, d])?;
        check(n("wv"), &self.wv, vec![kvd, d])?;
        check(n("wo"), &self.wo, vec![d, qd])?;
        check(n("ffn_norm"), &self.ffn_norm, vec![d])?;
        check(n("w1"), &self.w1, vec![h, d])?;
        check(n("w2"), &self.w2, vec![d, h])?;
        check(n("w3"), &self.w3, vec![h, d])?;
        for (t, b, len) in [
            ("bq", &self.bq, qd),
            ("bk", &self.bk, kvd),
            ("bv", &self.bv, kvd),
        ] {
            present(n(t), b.as_deref(), len, c.attention_bias, "attention_bias")?;
        }
        for (t, g) in [("q_norm", &self.q_norm), ("k_norm", &self.k_norm)] {
            present(n(t), g.as_deref(), c.head_dim, c.qk_norm, "qk_norm")?;
        }
        for (t, g) in [
            ("post_attn_norm", &self.post_attn_norm),
            ("post_ffn_norm", &self.post_ffn_norm),
        ] {
            present(n(t), g.as_deref(), d, c.gemma.is_some(), "gemma")?;
        }
        Ok(())
    }
}

/// An optional vector `name` of `len` elements: present exactly when the
/// config's `flag` is on.
fn present(
    name: String,
    v: Option<&[f32]>,
    len: usize,
    on: bool,
    flag: &str,
) -> Result<(), ModelError> {
    match (v, on) {
        (Some(v), true) => check(name, v, vec![len]),
        (None, false) => Ok(()),
        (None, true) => Err(ModelError::MissingTensor { tensor: name }),
        (Some(_), false) => Err(ModelError::InvalidConfig(format!(
            "{name} is present but {flag} is off"
        ))),
    }
}

/// `v` must have the length of `shape`; a mismatch names the tensor.
pub(crate) fn check(name: String, v: &[f32], shape: Vec<usize>) -> Result<(), ModelError> {
    let want = shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
    if want != Some(v.len()) {
        return Err(ModelError::Shape {
            tensor: name,
            expected: shape,
            got: vec![v.len()],
        });
    }
    Ok(())
}

/// The output projection's presence must match `tied_embeddings`.
pub(crate) fn check_output(lm_head: Option<&[f32]>, c: &ModelConfig) -> Result<(), ModelError> {
    match (lm_head, c.tied_embeddings) {
        (Some(head), false) => check("lm_head".into(), head, vec![c.vocab_size, c.dim]),
        (None, true) => Ok(()),
        (Some(_), true) => Err(ModelError::InvalidConfig(
            "tied_embeddings is set but a separate lm_head is present".into(),
        )),
        (None, false) => Err(ModelError::MissingTensor {
            tensor: "lm_head".into(),
        }),
    }
}
