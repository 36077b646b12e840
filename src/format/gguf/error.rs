//! What can be wrong with a GGUF file, each naming where.

use crate::format::gguf::GgmlType;
use crate::http::HttpStatus;

/// A GGUF file that cannot be read, or cannot be served. Every variant names
/// the key or tensor at fault; none is produced by a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    #[error("cannot read GGUF file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file: it starts with {found:02x?}, not \"GGUF\"")]
    BadMagic { found: Vec<u8> },
    #[error(
        "GGUF version {0} is not supported: handoff reads versions 2 and 3; re-convert the model with a current llama.cpp"
    )]
    UnsupportedVersion(u32),
    #[error(
        "GGUF file truncated reading {what}: needs {needed} bytes, {available} remain; download or copy the file again"
    )]
    Truncated {
        what: String,
        needed: u64,
        available: u64,
    },
    #[error(
        "{what} claims {count} entries, more than the {available} bytes left could hold: the file is corrupt"
    )]
    ImplausibleCount {
        what: String,
        count: u64,
        available: u64,
    },
    #[error(
        "metadata key {key} has value type {type_id}, which GGUF does not define: the file is corrupt"
    )]
    BadValueType { key: String, type_id: u32 },
    #[error("arrays nest more than {limit} deep under metadata key {key}: the file is corrupt")]
    NestingTooDeep { key: String, limit: usize },
    #[error("{what} is not valid UTF-8: the file is corrupt")]
    NotUtf8 { what: String },
    #[error("metadata key {0} appears twice: the file is corrupt")]
    DuplicateKey(String),
    #[error("tensor {0} appears twice in the tensor directory: the file is corrupt")]
    DuplicateTensor(String),
    #[error("metadata key {key} is {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("metadata key {0} is missing: the file is incomplete or not a supported model")]
    MissingKey(String),
    #[error("general.alignment is {0}: it must be a non-zero power of two")]
    BadAlignment(u64),
    #[error("tensor {tensor} has {n_dims} dimensions; GGUF allows at most 4")]
    TooManyDims { tensor: String, n_dims: u32 },
    #[error(
        "tensor {tensor} has dimensions {dims:?}: each must be non-zero and their product must fit this machine"
    )]
    BadDims { tensor: String, dims: Vec<u64> },
    #[error(
        "tensor {tensor} has ggml type id {type_id}, which handoff does not know: re-quantize to a supported type"
    )]
    UnknownType { tensor: String, type_id: u32 },
    #[error(
        "tensor {tensor} is {ty} with rows of {cols} elements, not a multiple of its block of {block}"
    )]
    RowNotBlockMultiple {
        tensor: String,
        ty: GgmlType,
        cols: u64,
        block: u64,
    },
    #[error(
        "tensor {tensor} at offset {offset} is not aligned to {alignment} bytes: the file is corrupt"
    )]
    Misaligned {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {tensor} needs bytes {offset}..{end} of the data section, which holds {available}: the file is truncated or its directory lies"
    )]
    OutOfBounds {
        tensor: String,
        offset: u64,
        end: u64,
        available: u64,
    },
    #[error(
        "tensor {tensor} is stored as {ty}, which handoff cannot compute with: use F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K"
    )]
    UnsupportedType { tensor: String, ty: GgmlType },
    #[error("tensor {0} is missing: the file is incomplete or not a supported architecture")]
    MissingTensor(String),
    #[error(
        "tensor {tensor} has shape {got:?} (GGUF order, innermost first), expected {expected:?}"
    )]
    Shape {
        tensor: String,
        expected: Vec<u64>,
        got: Vec<u64>,
    },
    #[error("tensor {tensor} holds a non-finite value at element {index}: the weights are corrupt")]
    NonFinite { tensor: String, index: usize },
    #[error(
        "unsupported architecture {0}: handoff serves Llama-family GGUF models (llama, mistral, qwen2, qwen3)"
    )]
    UnknownArchitecture(String),
    #[error(
        "tensor {0} is not part of this architecture: the file holds weights handoff would ignore"
    )]
    UnexpectedTensor(String),
    #[error("invalid model in GGUF metadata: {0}")]
    InvalidConfig(String),
}

impl HttpStatus for GgufError {
    fn http_status(&self) -> u16 {
        500
    }
}
