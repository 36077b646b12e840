use crate::http::HttpStatus;
use crate::kv::KvError;

/// Errors of a backend operation. The op did not produce output; the
/// caller fails the request(s) it was computing for.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    #[error(
        "{op}: shape mismatch: {what}: expected {expected}, got {got}; the caller passed inconsistent buffers"
    )]
    Shape {
        op: &'static str,
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("token id {token} is outside the vocabulary of {vocab}: reject the request")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error(
        "attention for span {span} needs {needed} KV positions, the sequence holds {written}: append its KV first"
    )]
    KvNotWritten {
        span: usize,
        needed: usize,
        written: usize,
    },
    #[error("KV access refused: {0}")]
    Kv(#[from] KvError),
    #[error("device error: {0}")]
    Device(String),
    #[error("{what} {detail} is beyond what this backend runs: use another backend or shape")]
    Unsupported { what: &'static str, detail: String },
}

impl HttpStatus for BackendError {
    fn http_status(&self) -> u16 {
        match self {
            BackendError::TokenOutOfRange { .. } => 400,
            BackendError::Kv(e) => e.http_status(),
            _ => 500,
        }
    }
}
