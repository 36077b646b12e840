//! Where a loader's tensors go as it reads them: collected into
//! [`ModelWeights`], or placed on a backend at once ([`Placer`]), so a model
//! can be loaded without ever holding all of its weights in f32.

use crate::backend::QuantMatrix;
use crate::backend::{AttnShape, Backend};
use crate::model::check::{check, check_output};
use crate::model::fingerprint::Fingerprinter;
use crate::model::forward::Layer;
use crate::model::{LayerWeights, Model, ModelConfig, ModelError, ModelWeights};

/// Receives a model's tensors in load order: the embedding, every layer in
/// order, then the final norm and the output projection.
pub(crate) trait WeightSink {
    type Out;
    fn embedding(&mut self, v: Vec<f32>) -> Result<(), ModelError>;
    fn layer(&mut self, l: LayerWeights) -> Result<(), ModelError>;
    fn finish(
        self,
        final_norm: Vec<f32>,
        lm_head: Option<Vec<f32>>,
    ) -> Result<Self::Out, ModelError>;
}

/// Collects the tensors into [`ModelWeights`].
pub(crate) struct Collect {
    config: ModelConfig,
    embedding: Vec<f32>,
    layers: Vec<LayerWeights>,
}

impl Collect {
    pub(crate) fn new(config: ModelConfig) -> Self {
        Collect {
            layers: Vec::with_capacity(config.n_layers.min(4096)),
            config,
            embedding: Vec::new(),
        }
    }
}

impl WeightSink for Collect {
    type Out = ModelWeights;
    fn embedding(&mut self, v: Vec<f32>) -> Result<(), ModelError> {
        self.embedding = v;
        Ok(())
    }
    fn layer(&mut self, l: LayerWeights) -> Result<(), ModelError> {
        self.layers.push(l);
        Ok(())
    }
    fn finish(
        self,
        final_norm: Vec<f32>,
        lm_head: Option<Vec<f32>>,
    ) -> Result<ModelWeights, ModelError> {
        Ok(ModelWeights {
            config: self.config,
            embedding: self.embedding,
            layers: self.layers,
            final_norm,
            lm_head,
        })
    }
}

/// Checks each tensor, hashes it into the model's fingerprint and places it
/// on the backend as it arrives; the f32 copy is dropped once placed.
pub(crate) struct Placer<B: Backend> {
    backend: B,
    config: ModelConfig,
    fingerprint: Fingerprinter,
    embedding: Option<B::Mat>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Placer<B> {
    /// A placer for a model of `config`, refused at once if the config is
    /// invalid or the backend has no kernels for its attention shape.
    pub(crate) fn new(backend: B, config: ModelConfig) -> Result<Self, ModelError> {
        config.validate()?;
        backend
            .supports(AttnShape {
                n_heads: config.n_heads,
                n_kv_heads: config.n_kv_heads,
                head_dim: config.head_dim,
            })
            .and_then(|()| {
                if config.qk_norm {
                    backend.supports_qk_norm()
                } else {
                    Ok(())
                }
            })
            .and_then(|()| match config.gemma {
                Some(_) => backend.supports_gemma(),
                None => Ok(()),
            })
            .map_err(|source| ModelError::Unsupported {
                backend: backend.name(),
                source,
            })?;
        Ok(Placer {
            fingerprint: Fingerprinter::new(&config),
            layers: Vec::with_capacity(config.n_layers.min(4096)),
            backend,
            config,
            embedding: None,
        })
    }

    fn up(&self, name: &str, v: Vec<f32>, rows: usize, cols: usize) -> Result<B::Mat, ModelError> {
        upload(&self.backend, name, v, rows, cols)
    }

    fn vec(&self, name: &str, v: Vec<f32>) -> Result<B::Mat, ModelError> {
        let n = v.len();
        self.up(name, v, 1, n)
    }
}

impl<B: Backend> WeightSink for Placer<B> {
    type Out = Model<B>;

    fn embedding(&mut self, v: Vec<f32>) -> Result<(), ModelError> {
        let c = &self.config;
        check("embedding".into(), &v, vec![c.vocab_size, c.dim])?;
        self.fingerprint.embedding(&v, c.n_layers);
        self.embedding = Some(self.up("embedding", v, c.vocab_size, c.dim)?);
        Ok(())
    }

    fn layer(&mut self, l: LayerWeights) -> Result<(), ModelError> {
        let i = self.next_layer()?;
        l.check(i, &self.config)?;
        self.fingerprint.layer(&l);
        self.place_layer(LayerTensors::from(l))
    }

    fn finish(
        self,
        final_norm: Vec<f32>,
        lm_head: Option<Vec<f32>>,
    ) -> Result<Model<B>, ModelError> {
        self.check_finish(&final_norm, lm_head.as_deref())?;
        self.complete(final_norm, lm_head.map(Tensor::F32))
    }
}

impl<B: Backend> Placer<B> {
    /// The index of the layer about to be placed; refused past the config's
    /// layer count.
    fn next_layer(&self) -> Result<usize, ModelError> {
        let (i, n) = (self.layers.len(), self.config.n_layers);
        if i >= n {
            return Err(ModelError::Shape {
                tensor: "layers".into(),
                expected: vec![n],
                got: vec![i + 1],
            });
        }
        Ok(i)
    }

    /// Places one layer whose shapes were checked, f32 or quantized.
    fn place_layer(&mut self, l: LayerTensors) -> Result<(), ModelError> {
        let c = &self.config;
        let (d, h) = (c.dim, c.hidden_dim);
        let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let placed = Layer::<B> {
            attn_norm: self.vec("attn_norm", l.attn_norm)?,
            wq: self.up_t("wq", l.wq, qd, d)?,
            wk: self.up_t("wk", l.wk, kvd, d)?,
            wv: self.up_t("wv", l.wv, kvd, d)?,
            wo: self.up_t("wo", l.wo, d, qd)?,
            bq: l.bq.map(|b| self.vec("bq", b)).transpose()?,
            bk: l.bk.map(|b| self.vec("bk", b)).transpose()?,
            bv: l.bv.map(|b| self.vec("bv", b)).transpose()?,
            q_norm: l.q_norm.map(|g| self.vec("q_norm", g)).transpose()?,
            k_norm: l.k_norm.map(|g| self.vec("k_norm", g)).transpose()?,
            post_attn_norm: l
                .post_attn_norm
                .map(|g| self.vec("post_attn_norm", g))
                .transpose()?,
            ffn_norm: self.vec("ffn_norm", l.ffn_norm)?,
            post_ffn_norm: l
                .post_ffn_norm
                .map(|g| self.vec("post_ffn_norm", g))
                .transpose()?,
            w1: self.up_t("w1", l.w1, h, d)?,
            w2: self.up_t("w2", l.w2, d, h)?,
            w3: self.up_t("w3", l.w3, h, d)?,
        };
        self.layers.push(placed);
        Ok(())
    }

    /// Every layer placed; the final norm and output projection (f32 view)
    /// of the right shapes.
    fn check_finish(&self, final_norm: &[f32], head: Option<&[f32]>) -> Result<(), ModelError> {
        let c = &self.config;
        if self.layers.len() != c.n_layers {
            return Err(ModelError::Shape {
                tensor: "layers".into(),
                expected: vec![c.n_layers],
                got: vec![self.layers.len()],
            });
        }
        check("final_norm".into(), final_norm, vec![c.dim])?;
        check_output(head, c)
    }

    /// Hashes the final norm and the output projection (dequantized, when
    /// quantized), places them and builds the model. Shapes were checked.
    fn complete(self, final_norm: Vec<f32>, head: Option<Tensor>) -> Result<Model<B>, ModelError> {
        let Placer {
            backend,
            config,
            fingerprint,
            embedding,
            layers,
        } = self;
        let fingerprint = match &head {
            None => fingerprint.finish(&final_norm, None),
            Some(Tensor::F32(v)) => fingerprint.finish(&final_norm, Some(v)),
            Some(Tensor::Quant(q)) => fingerprint.finish(&final_norm, Some(&q.dequantize())),
        };
        let (vocab, dim) = (config.vocab_size, config.dim);
        let head = head
            .map(|t| place(&backend, "lm_head", t, vocab, dim))
            .transpose()?;
        let embedding = embedding.ok_or_else(|| ModelError::MissingTensor {
            tensor: "embedding".into(),
        })?;
        let n = final_norm.len();
        let final_norm = upload(&backend, "final_norm", final_norm, 1, n)?;
        Ok(Model::from_placed(
            backend,
            config,
            embedding,
            layers,
            final_norm,
            head,
            fingerprint,
        ))
    }
}

/// Places one tensor; a backend refusal names it.
fn upload<B: Backend>(
    backend: &B,
    name: &str,
    v: Vec<f32>,
    rows: usize,
    cols: usize,
) -> Result<B::Mat, ModelError> {
    backend
        .upload(v, rows, cols)
        .map_err(|e| ModelError::InvalidConfig(format!("placing {name}: {e}")))
}

/// A tensor as a GGUF loader hands it over: f32, or a matrix kept in its
/// ggml block format.
pub(crate) enum Tensor {
    F32(Vec<f32>),
    Quant(QuantMatrix),
}

impl Tensor {
    /// The values as f32 (dequantized, a copy, for a quantized matrix).
    pub(crate) fn to_f32(&self) -> Vec<f32> {
        match self {
            Tensor::F32(v) => v.clone(),
            Tensor::Quant(q) => q.dequantize(),
        }
    }

    pub(crate) fn into_f32(self) -> Vec<f32> {
        match self {
            Tensor::F32(v) => v,
            Tensor::Quant(q) => q.dequantize(),
        }
    }
}

/// One layer whose matrices may be quantized (the order of [`LayerWeights`]).
pub(crate) struct LayerTensors {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) wq: Tensor,
    pub(crate) wk: Tensor,
    pub(crate) wv: Tensor,
    pub(crate) wo: Tensor,
    pub(crate) bq: Option<Vec<f32>>,
    pub(crate) bk: Option<Vec<f32>>,
    pub(crate) bv: Option<Vec<f32>>,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) post_attn_norm: Option<Vec<f32>>,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) post_ffn_norm: Option<Vec<f32>>,
    pub(crate) w1: Tensor,
    pub(crate) w2: Tensor,
    pub(crate) w3: Tensor,
}

impl From<LayerWeights> for LayerTensors {
    /// An f32 layer, moved (no copy).
    fn from(l: LayerWeights) -> Self {
        LayerTensors {
            attn_norm: l.attn_norm,
            wq: Tensor::F32(l.wq),
            wk: Tensor::F32(l.wk),
            wv: Tensor::F32(l.wv),
            wo: Tensor::F32(l.wo),
            bq: l.bq,
            bk: l.bk,
            bv: l.bv,
            q_norm: l.q_norm,
            k_norm: l.k_norm,
            post_attn_norm: l.post_attn_norm,
            ffn_norm: l.ffn_norm,
            post_ffn_norm: l.post_ffn_norm,
            w1: Tensor::F32(l.w1),
            w2: Tensor::F32(l.w2),
            w3: Tensor::F32(l.w3),
        }
    }
}

impl LayerTensors {
    /// The layer in f32 (matrices dequantized), for checks and hashing.
    fn to_f32(&self) -> LayerWeights {
        LayerWeights {
            attn_norm: self.attn_norm.clone(),
            wq: self.wq.to_f32(),
            wk: self.wk.to_f32(),
            wv: self.wv.to_f32(),
            wo: self.wo.to_f32(),
            bq: self.bq.clone(),
            bk: self.bk.clone(),
            bv: self.bv.clone(),
            q_norm: self.q_norm.clone(),
            k_norm: self.k_norm.clone(),
            post_attn_norm: self.post_attn_norm.clone(),
            ffn_norm: self.ffn_norm.clone(),
            post_ffn_norm: self.post_ffn_norm.clone(),
            w1: self.w1.to_f32(),
            w2: self.w2.to_f32(),
            w3: self.w3.to_f32(),
        }
    }
}

/// Receives tensors that may stay quantized: a [`Placer`] keeps them so
/// (when its backend can), [`Collect`] dequantizes them.
pub(crate) trait TensorSink {
    type Out;
    fn embedding_t(&mut self, t: Tensor) -> Result<(), ModelError>;
    fn layer_t(&mut self, l: LayerTensors) -> Result<(), ModelError>;
    fn finish_t(
        self,
        final_norm: Vec<f32>,
        lm_head: Option<Tensor>,
    ) -> Result<Self::Out, ModelError>;
}

impl TensorSink for Collect {
    type Out = ModelWeights;
    fn embedding_t(&mut self, t: Tensor) -> Result<(), ModelError> {
        self.embedding(t.into_f32())
    }
    fn layer_t(&mut self, l: LayerTensors) -> Result<(), ModelError> {
        self.layer(l.to_f32())
    }
    fn finish_t(
        self,
        final_norm: Vec<f32>,
        lm_head: Option<Tensor>,
    ) -> Result<ModelWeights, ModelError> {
        self.finish(final_norm, lm_head.map(Tensor::into_f32))
    }
}

impl<B: Backend> Placer<B> {
    /// Places a matrix: f32 through [`Backend::upload`], quantized through
    /// [`Backend::upload_quant`].
    fn up_t(&self, name: &str, t: Tensor, rows: usize, cols: usize) -> Result<B::Mat, ModelError> {
        place(&self.backend, name, t, rows, cols)
    }
}

/// Places a matrix: f32 through [`Backend::upload`], quantized through
/// [`Backend::upload_quant`].
fn place<B: Backend>(
    backend: &B,
    name: &str,
    t: Tensor,
    rows: usize,
    cols: usize,
) -> Result<B::Mat, ModelError> {
    {
        match t {
            Tensor::F32(v) => upload(backend, name, v, rows, cols),
            Tensor::Quant(q) => {
                if (q.rows(), q.cols()) != (rows, cols) {
                    return Err(ModelError::Shape {
                        tensor: name.into(),
                        expected: vec![rows, cols],
                        got: vec![q.rows(), q.cols()],
                    });
                }
                backend
                    .upload_quant(q)
                    .map_err(|e| ModelError::InvalidConfig(format!("placing {name}: {e}")))
            }
        }
    }
}

impl<B: Backend> TensorSink for Placer<B> {
    type Out = Model<B>;

    fn embedding_t(&mut self, t: Tensor) -> Result<(), ModelError> {
        let c = &self.config;
        let v = t.to_f32();
        check("embedding".into(), &v, vec![c.vocab_size, c.dim])?;
        self.fingerprint.embedding(&v, c.n_layers);
        drop(v);
        self.embedding = Some(self.up_t("embedding", t, c.vocab_size, c.dim)?);
        Ok(())
    }

    fn layer_t(&mut self, l: LayerTensors) -> Result<(), ModelError> {
        let i = self.next_layer()?;
        let flat = l.to_f32();
        flat.check(i, &self.config)?;
        self.fingerprint.layer(&flat);
        drop(flat);
        self.place_layer(l)
    }

    fn finish_t(
        self,
        final_norm: Vec<f32>,
        lm_head: Option<Tensor>,
    ) -> Result<Model<B>, ModelError> {
        let flat = lm_head.as_ref().map(Tensor::to_f32);
        self.check_finish(&final_norm, flat.as_deref())?;
        drop(flat);
        self.complete(final_norm, lm_head)
    }
}
