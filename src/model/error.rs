use std::path::Path;

use crate::format::Mapped;
use crate::http::HttpStatus;

/// Errors loading or validating a model. Each names what was wrong and where.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("bad header: {0}; check that the file is a model of the expected format")]
    BadHeader(String),
    #[error(
        "file truncated: tensor {tensor} needs {expected} bytes, {available} remain; download or copy the file again"
    )]
    Truncated {
        tensor: String,
        expected: usize,
        available: usize,
    },
    #[error(
        "tensor {tensor} is missing: the checkpoint is incomplete or not a supported architecture"
    )]
    MissingTensor { tensor: String },
    #[error(
        "tensor {tensor} has shape {got:?}, expected {expected:?}: the weights do not match the model's configuration (config.json or the file header)"
    )]
    Shape {
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tensor {tensor} has unsupported dtype {dtype}: use f32, f16 or bf16")]
    Dtype { tensor: String, dtype: String },
    #[error(
        "tensor {tensor} contains a non-finite value at index {index}: the weights are corrupt; re-export them"
    )]
    NonFinite { tensor: String, index: usize },
    #[error(
        "unsupported architecture {0}: handoff serves Llama-family models (Llama, Mistral, Qwen2, Qwen3) and Gemma 3"
    )]
    UnsupportedArchitecture(String),
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    #[error("the {backend} backend cannot run this model: {source}; use another backend")]
    Unsupported {
        backend: &'static str,
        source: crate::backend::BackendError,
    },
    #[error(transparent)]
    Gguf(#[from] crate::format::gguf::GgufError),
}

impl HttpStatus for ModelError {
    fn http_status(&self) -> u16 {
        500
    }
}

impl From<crate::backend::InvalidRopeScaling> for ModelError {
    fn from(e: crate::backend::InvalidRopeScaling) -> Self {
        ModelError::InvalidConfig(e.0)
    }
}

/// An I/O failure on `path`, as the loaders report it.
pub(crate) fn io_err(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// `path`'s bytes mapped read-only for a load, or the loaders' I/O error.
pub(crate) fn map_file(path: &Path) -> Result<Mapped, ModelError> {
    Mapped::open(path).map_err(|e| io_err(path, e))
}
