//! Shape checks of a [`ModelWeights`] against its own config, for weights
//! built by any loader or by hand.

use crate::model::{ModelError, ModelWeights};

impl ModelWeights {
    /// Checks the config and that every tensor has the length its shape
    /// needs. A mismatch names the tensor and the expected shape.
    pub fn check_shapes(&self) -> Result<(), ModelError> {
        let c = &self.config;
        c.validate()?;
        let (d, h) = (c.dim, c.hidden_dim);
        let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let check = |name: String, v: &[f32], shape: Vec<usize>| {
            let want = shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
            if want != Some(v.len()) {
                return Err(ModelError::Shape {
                    tensor: name,
                    expected: shape,
                    got: vec![v.len()],
                });
            }
            Ok(())
        };
        check("embedding".into(), &self.embedding, vec![c.vocab_size, d])?;
        check("final_norm".into(), &self.final_norm, vec![d])?;
        match (&self.lm_head, c.tied_embeddings) {
            (Some(head), false) => check("lm_head".into(), head, vec![c.vocab_size, d])?,
            (None, true) => {}
            (Some(_), true) => {
                return Err(ModelError::InvalidConfig(
                    "tied_embeddings is set but a separate lm_head is present".into(),
                ));
            }
            (None, false) => {
                return Err(ModelError::MissingTensor {
                    tensor: "lm_head".into(),
                });
            }
        }
        if self.layers.len() != c.n_layers {
            return Err(ModelError::Shape {
                tensor: "layers".into(),
                expected: vec![c.n_layers],
                got: vec![self.layers.len()],
            });
        }
        for (i, l) in self.layers.iter().enumerate() {
            let n = |t: &str| format!("layers.{i}.{t}");
            check(n("attn_norm"), &l.attn_norm, vec![d])?;
            check(n("wq"), &l.wq, vec![qd, d])?;
            check(n("wk"), &l.wk, vec![kvd, d])?;
            check(n("wv"), &l.wv, vec![kvd, d])?;
            check(n("wo"), &l.wo, vec![d, qd])?;
            check(n("ffn_norm"), &l.ffn_norm, vec![d])?;
            check(n("w1"), &l.w1, vec![h, d])?;
            check(n("w2"), &l.w2, vec![d, h])?;
            check(n("w3"), &l.w3, vec![h, d])?;
            for (t, b, len) in [("bq", &l.bq, qd), ("bk", &l.bk, kvd), ("bv", &l.bv, kvd)] {
                match (b, c.attention_bias) {
                    (Some(b), true) => check(n(t), b, vec![len])?,
                    (None, false) => {}
                    (None, true) => return Err(ModelError::MissingTensor { tensor: n(t) }),
                    (Some(_), false) => {
                        return Err(ModelError::InvalidConfig(format!(
                            "{} is present but attention_bias is off",
                            n(t)
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}
