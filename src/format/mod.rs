//! File formats, read and written without knowing a model or a backend:
//! the GGUF container ([`gguf`]: header, metadata, tensor directory, ggml's
//! storage types) and read-only file mappings. `model` builds weights from
//! these and `text` builds tokenizers from them; neither imports the other.

pub mod gguf;
mod mapped;

pub(crate) use mapped::Mapped;
