//! Computing a model's identity: a hash of its configuration and every
//! weight (the value, [`ModelFingerprint`], lives in `crate::fingerprint`).

use std::hash::Hasher;

use twox_hash::XxHash3_64;

use crate::fingerprint::ModelFingerprint;
use crate::model::{LayerWeights, ModelConfig, ModelWeights, RopeScaling, RopeStyle};

impl ModelFingerprint {
    /// Hashes `weights` (one pass over every weight).
    pub fn of(weights: &ModelWeights) -> Self {
        let mut f = Fingerprinter::new(&weights.config);
        f.embedding(&weights.embedding, weights.layers.len());
        for l in &weights.layers {
            f.layer(l);
        }
        f.finish(&weights.final_norm, weights.lm_head.as_deref())
    }
}

/// A [`ModelFingerprint`] fed one piece at a time, in the order a loader
/// places the pieces (embedding, layers, final norm, output): a model placed
/// while it is read gets the fingerprint of the same weights loaded whole.
pub(crate) struct Fingerprinter(XxHash3_64);

impl Fingerprinter {
    pub(crate) fn new(c: &ModelConfig) -> Self {
        let mut h = XxHash3_64::with_seed(0);
        h.write(b"handoff model fingerprint v1");
        config(&mut h, c);
        Fingerprinter(h)
    }

    /// The embedding, then the number of layers that follow.
    pub(crate) fn embedding(&mut self, t: &[f32], layers: usize) {
        tensor(&mut self.0, t);
        self.0.write_u64(layers as u64);
    }

    pub(crate) fn layer(&mut self, l: &LayerWeights) {
        let h = &mut self.0;
        for t in [&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo] {
            tensor(h, t);
        }
        for b in [&l.bq, &l.bk, &l.bv] {
            optional(h, b.as_deref());
        }
        // As the config's flag: hashed only when present.
        for g in [&l.q_norm, &l.k_norm].into_iter().flatten() {
            tensor(h, g);
        }
        for t in [&l.ffn_norm, &l.w1, &l.w2, &l.w3] {
            tensor(h, t);
        }
        // As the config's Gemma block: hashed only when present.
        for g in [&l.post_attn_norm, &l.post_ffn_norm].into_iter().flatten() {
            tensor(h, g);
        }
    }

    pub(crate) fn finish(
        mut self,
        final_norm: &[f32],
        lm_head: Option<&[f32]>,
    ) -> ModelFingerprint {
        tensor(&mut self.0, final_norm);
        optional(&mut self.0, lm_head);
        ModelFingerprint::from_u64(self.0.finish())
    }
}

fn tensor(h: &mut XxHash3_64, t: &[f32]) {
    h.write_u64(t.len() as u64);
    h.write(bytemuck::cast_slice(t));
}

fn optional(h: &mut XxHash3_64, t: Option<&[f32]>) {
    match t {
        None => h.write_u8(0),
        Some(t) => {
            h.write_u8(1);
            tensor(h, t);
        }
    }
}

fn config(h: &mut XxHash3_64, c: &ModelConfig) {
    // Destructured so that a new field cannot be left out of the hash.
    let ModelConfig {
        dim,
        hidden_dim,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size,
        max_seq_len,
        rope_theta,
        rope_style,
        rope_scaling,
        norm_eps,
        tied_embeddings,
        attention_bias,
        qk_norm,
        gemma,
    } = *c;
    for v in [
        dim,
        hidden_dim,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size,
        max_seq_len,
    ] {
        h.write_u64(v as u64);
    }
    h.write_u32(rope_theta.to_bits());
    h.write_u8(match rope_style {
        RopeStyle::Interleaved => 0,
        RopeStyle::Half => 1,
    });
    match rope_scaling {
        RopeScaling::None => h.write_u8(0),
        RopeScaling::Linear { factor } => {
            h.write_u8(1);
            h.write_u32(factor.to_bits());
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            h.write_u8(2);
            for x in [factor, low_freq_factor, high_freq_factor] {
                h.write_u32(x.to_bits());
            }
            h.write_u32(original_max_position);
        }
    }
    h.write_u32(norm_eps.to_bits());
    h.write_u8(u8::from(tied_embeddings));
    h.write_u8(u8::from(attention_bias));
    // Only when on, so every fingerprint from before q/k norms stays.
    if qk_norm {
        h.write_u8(b'n');
    }
    // Likewise Gemma's block.
    if let Some(g) = gemma {
        h.write_u8(b'g');
        h.write_u64(g.sliding_window as u64);
        h.write_u64(g.global_every as u64);
        h.write_u32(g.local_rope_theta.to_bits());
        h.write_u32(g.query_pre_attn_scalar.to_bits());
        h.write_u32(g.final_logit_softcap.map_or(0, f32::to_bits));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::random_weights;

    #[test]
    fn equal_models_agree_and_any_change_shows() {
        let cfg = ModelConfig::tiny_gqa();
        let w = random_weights(&cfg, 7);
        let fp = ModelFingerprint::of(&w);
        assert_eq!(fp, ModelFingerprint::of(&w.clone()));
        assert_ne!(fp, ModelFingerprint::of(&random_weights(&cfg, 8)));

        let mut one_bit = w.clone();
        let x = &mut one_bit.layers[2].w2[5];
        *x = f32::from_bits(x.to_bits() ^ 1);
        assert_ne!(fp, ModelFingerprint::of(&one_bit));

        let mut scaled = w.clone();
        scaled.config.rope_scaling = RopeScaling::Linear { factor: 2.0 };
        assert_ne!(fp, ModelFingerprint::of(&scaled));

        let mut window = w.clone();
        window.config.max_seq_len -= 1;
        assert_ne!(fp, ModelFingerprint::of(&window));

        // A tensor's bytes moved into its neighbour are a different model.
        let mut moved = w;
        let last = moved.layers[0].attn_norm.pop().unwrap();
        moved.layers[0].wq.insert(0, last);
        assert_ne!(fp, ModelFingerprint::of(&moved));
        assert_eq!(fp, ModelFingerprint::from_u64(fp.to_u64()));
    }
}
