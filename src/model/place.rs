//! Where a loader's tensors go as it reads them: collected into
//! [`ModelWeights`], or placed on a backend at once ([`Placer`]), so a model
//! can be loaded without ever holding all of its weights in f32.

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
        let i = self.layers.len();
        let c = &self.config;
        if i >= c.n_layers {
            return Err(ModelError::Shape {
                tensor: "layers".into(),
                expected: vec![c.n_layers],
                got: vec![i + 1],
            });
        }
        l.check(i, c)?;
        self.fingerprint.layer(&l);
        let (d, h) = (c.dim, c.hidden_dim);
        let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let placed = Layer::<B> {
            attn_norm: self.vec("attn_norm", l.attn_norm)?,
            wq: self.up("wq", l.wq, qd, d)?,
            wk: self.up("wk", l.wk, kvd, d)?,
            wv: self.up("wv", l.wv, kvd, d)?,
            wo: self.up("wo", l.wo, d, qd)?,
            bq: l.bq.map(|b| self.vec("bq", b)).transpose()?,
            bk: l.bk.map(|b| self.vec("bk", b)).transpose()?,
            bv: l.bv.map(|b| self.vec("bv", b)).transpose()?,
            ffn_norm: self.vec("ffn_norm", l.ffn_norm)?,
            w1: self.up("w1", l.w1, h, d)?,
            w2: self.up("w2", l.w2, d, h)?,
            w3: self.up("w3", l.w3, h, d)?,
        };
        self.layers.push(placed);
        Ok(())
    }

    fn finish(
        self,
        final_norm: Vec<f32>,
        lm_head: Option<Vec<f32>>,
    ) -> Result<Model<B>, ModelError> {
        let c = &self.config;
        if self.layers.len() != c.n_layers {
            return Err(ModelError::Shape {
                tensor: "layers".into(),
                expected: vec![c.n_layers],
                got: vec![self.layers.len()],
            });
        }
        check("final_norm".into(), &final_norm, vec![c.dim])?;
        check_output(lm_head.as_deref(), c)?;
        let Placer {
            backend,
            config,
            fingerprint,
            embedding,
            layers,
        } = self;
        let embedding = embedding.ok_or_else(|| ModelError::MissingTensor {
            tensor: "embedding".into(),
        })?;
        let fingerprint = fingerprint.finish(&final_norm, lm_head.as_deref());
        let n = final_norm.len();
        let final_norm = upload(&backend, "final_norm", final_norm, 1, n)?;
        let (vocab, dim) = (config.vocab_size, config.dim);
        let lm_head = lm_head
            .map(|w| upload(&backend, "lm_head", w, vocab, dim))
            .transpose()?;
        Ok(Model::from_placed(
            backend,
            config,
            embedding,
            layers,
            final_norm,
            lm_head,
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
