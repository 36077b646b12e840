//! A deliberately naive Llama forward pass in f64, written from the model
//! description (../shared/models/README.md and the transformers Llama
//! semantics), sharing no code with handoff's backend: one token at a time,
//! plain loops, its own KV cache. Tests compare handoff against it, so it
//! must stay independent: do not "simplify" it by calling into the crate.
//!
//! Shared by the test files that include it with `mod naive_llama;`; each
//! uses a different subset, hence the allow.

/// One transformer block; matrices row-major `[out][in]`.
pub struct NaiveLayer {
    pub attn_norm: Vec<f64>,
    pub wq: Vec<f64>,
    pub wk: Vec<f64>,
    pub wv: Vec<f64>,
    pub wo: Vec<f64>,
    pub bq: Option<Vec<f64>>,
    pub bk: Option<Vec<f64>>,
    pub bv: Option<Vec<f64>>,
    pub ffn_norm: Vec<f64>,
    pub w_gate: Vec<f64>,
    pub w_down: Vec<f64>,
    pub w_up: Vec<f64>,
}

/// Which dimensions RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NaiveRope {
    /// (2i, 2i+1): llama2.c / Meta.
    AdjacentPairs,
    /// (i, i + head_dim/2): Hugging Face.
    RotateHalf,
}

/// How RoPE frequencies are stretched (transformers' `rope_type`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NaiveFreqScale {
    Plain,
    /// Every frequency divided by the factor.
    Linear(f64),
    /// Llama 3.1: pairs whose wavelength (positions per turn) is shorter
    /// than `old / high` keep their frequency, longer than `old / low` get
    /// it divided by `factor`, and in between a blend linear in
    /// `old / wavelength`.
    Llama3 {
        factor: f64,
        low: f64,
        high: f64,
        old: f64,
    },
}

impl NaiveFreqScale {
    fn apply(self, f: f64) -> f64 {
        match self {
            Self::Plain => f,
            Self::Linear(factor) => f / factor,
            Self::Llama3 {
                factor,
                low,
                high,
                old,
            } => {
                let wavelength = 2.0 * std::f64::consts::PI / f;
                if wavelength < old / high {
                    f
                } else if wavelength > old / low {
                    f / factor
                } else {
                    let t = (old / wavelength - low) / (high - low);
                    t * f + (1.0 - t) * (f / factor)
                }
            }
        }
    }
}

pub struct NaiveModel {
    pub dim: usize,
    pub hidden_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub rope: NaiveRope,
    pub freq_scale: NaiveFreqScale,
    pub embedding: Vec<f64>,
    pub layers: Vec<NaiveLayer>,
    pub final_norm: Vec<f64>,
    /// `[vocab][dim]`
    pub output: Vec<f64>,
}

pub fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn matvec(w: &[f64], x: &[f64], out_dim: usize) -> Vec<f64> {
    let n = x.len();
    assert_eq!(w.len(), out_dim * n, "matrix shape");
    (0..out_dim)
        .map(|o| {
            w[o * n..(o + 1) * n]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * inv * g).collect()
}

fn add_bias(x: &mut [f64], b: &Option<Vec<f64>>) {
    if let Some(b) = b {
        for (v, bb) in x.iter_mut().zip(b) {
            *v += bb;
        }
    }
}

impl NaiveModel {
    /// Rotates every head of `x` (heads of `head_dim`) for position `pos`.
    fn rope(&self, x: &mut [f64], pos: usize) {
        let hd = self.head_dim;
        for head in x.chunks_exact_mut(hd) {
            for i in 0..hd / 2 {
                let freq = self
                    .freq_scale
                    .apply(self.rope_theta.powf(-((2 * i) as f64) / hd as f64));
                let (s, c) = (pos as f64 * freq).sin_cos();
                let (a, b) = match self.rope {
                    NaiveRope::AdjacentPairs => (2 * i, 2 * i + 1),
                    NaiveRope::RotateHalf => (i, i + hd / 2),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }

    pub fn session(&self) -> NaiveSession<'_> {
        NaiveSession {
            m: self,
            keys: vec![Vec::new(); self.layers.len()],
            values: vec![Vec::new(); self.layers.len()],
        }
    }

    /// Logits after each prompt position.
    pub fn logits_for_prompt(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let mut s = self.session();
        tokens.iter().map(|&t| s.step(t)).collect()
    }

    /// Greedy continuation of `prompt`; with each step's top-2 logit gap.
    pub fn greedy(&self, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f64>) {
        let mut s = self.session();
        let mut logits = Vec::new();
        for &t in prompt {
            logits = s.step(t);
        }
        let (mut out, mut gaps) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let (tok, gap) = argmax_gap(&logits);
            out.push(tok);
            gaps.push(gap);
            logits = s.step(tok);
        }
        (out, gaps)
    }
}

/// Index of the largest value and its lead over the runner-up.
pub fn argmax_gap(v: &[f64]) -> (u32, f64) {
    let mut best = (0usize, f64::NEG_INFINITY);
    let mut second = f64::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > best.1 {
            second = best.1;
            best = (i, x);
        } else if x > second {
            second = x;
        }
    }
    (best.0 as u32, best.1 - second)
}

/// A sequence being decoded: per layer, the keys and values of every
/// position so far (after RoPE for keys).
pub struct NaiveSession<'a> {
    m: &'a NaiveModel,
    keys: Vec<Vec<Vec<f64>>>,
    values: Vec<Vec<Vec<f64>>>,
}

impl NaiveSession<'_> {
    /// Feeds one token; returns the logits for the next.
    pub fn step(&mut self, token: u32) -> Vec<f64> {
        let m = self.m;
        let (dim, hd) = (m.dim, m.head_dim);
        let pos = self.keys[0].len();
        let t = token as usize;
        let mut x = m.embedding[t * dim..(t + 1) * dim].to_vec();
        let group = m.n_heads / m.n_kv_heads;
        for (l, layer) in m.layers.iter().enumerate() {
            let h = rmsnorm(&x, &layer.attn_norm, m.norm_eps);
            let mut q = matvec(&layer.wq, &h, m.n_heads * hd);
            let mut k = matvec(&layer.wk, &h, m.n_kv_heads * hd);
            let mut v = matvec(&layer.wv, &h, m.n_kv_heads * hd);
            add_bias(&mut q, &layer.bq);
            add_bias(&mut k, &layer.bk);
            add_bias(&mut v, &layer.bv);
            m.rope(&mut q, pos);
            m.rope(&mut k, pos);
            self.keys[l].push(k);
            self.values[l].push(v);

            let mut attn = vec![0.0; m.n_heads * hd];
            for head in 0..m.n_heads {
                let kvh = head / group;
                let qh = &q[head * hd..(head + 1) * hd];
                let scores: Vec<f64> = self.keys[l]
                    .iter()
                    .map(|k| {
                        let kh = &k[kvh * hd..(kvh + 1) * hd];
                        qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = exps.iter().sum();
                for (p, e) in exps.iter().enumerate() {
                    let vh = &self.values[l][p][kvh * hd..(kvh + 1) * hd];
                    for (o, vv) in attn[head * hd..(head + 1) * hd].iter_mut().zip(vh) {
                        *o += e / sum * vv;
                    }
                }
            }
            let o = matvec(&layer.wo, &attn, dim);
            for (xi, oi) in x.iter_mut().zip(&o) {
                *xi += oi;
            }

            let h = rmsnorm(&x, &layer.ffn_norm, m.norm_eps);
            let gate = matvec(&layer.w_gate, &h, m.hidden_dim);
            let up = matvec(&layer.w_up, &h, m.hidden_dim);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = matvec(&layer.w_down, &act, dim);
            for (xi, di) in x.iter_mut().zip(&down) {
                *xi += di;
            }
        }
        let h = rmsnorm(&x, &m.final_norm, m.norm_eps);
        matvec(&m.output, &h, m.vocab_size)
    }
}

/// The naive model holding (in f64) the same weights as a handoff
/// `ModelWeights`: a copy of the data, no computation from the crate.
pub fn from_weights(w: &handoff::model::ModelWeights) -> NaiveModel {
    let c = &w.config;
    NaiveModel {
        dim: c.dim,
        hidden_dim: c.hidden_dim,
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        vocab_size: c.vocab_size,
        norm_eps: f64::from(c.norm_eps),
        rope_theta: f64::from(c.rope_theta),
        rope: match c.rope_style {
            handoff::model::RopeStyle::Half => NaiveRope::RotateHalf,
            handoff::model::RopeStyle::Interleaved => NaiveRope::AdjacentPairs,
        },
        freq_scale: match c.rope_scaling {
            handoff::model::RopeScaling::None => NaiveFreqScale::Plain,
            handoff::model::RopeScaling::Linear { factor } => NaiveFreqScale::Linear(factor.into()),
            handoff::model::RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => NaiveFreqScale::Llama3 {
                factor: factor.into(),
                low: low_freq_factor.into(),
                high: high_freq_factor.into(),
                old: original_max_position.into(),
            },
        },
        embedding: to_f64(&w.embedding),
        layers: w
            .layers
            .iter()
            .map(|l| NaiveLayer {
                attn_norm: to_f64(&l.attn_norm),
                wq: to_f64(&l.wq),
                wk: to_f64(&l.wk),
                wv: to_f64(&l.wv),
                wo: to_f64(&l.wo),
                bq: l.bq.as_deref().map(to_f64),
                bk: l.bk.as_deref().map(to_f64),
                bv: l.bv.as_deref().map(to_f64),
                ffn_norm: to_f64(&l.ffn_norm),
                w_gate: to_f64(&l.w1),
                w_down: to_f64(&l.w2),
                w_up: to_f64(&l.w3),
            })
            .collect(),
        final_norm: to_f64(&w.final_norm),
        output: to_f64(w.output()),
    }
}
