//! GGUF files (llama.cpp's format, versions 2 and 3): the metadata and the
//! tensor directory ([`GgufFile`]), parsed with every count, length and
//! offset checked against the file before it sizes anything; ggml's storage
//! types ([`GgmlType`]); and a writer ([`GgufWriter`]) for tests and tools.
//! Turning a file into a model is the model layer's job (`model::gguf`),
//! into a tokenizer the text layer's.

mod error;
mod file;
mod ggml;
mod reader;
mod value;
mod write;

pub use error::GgufError;
pub use file::{GgufFile, TensorInfo};
pub use ggml::GgmlType;
pub use value::{GgufArray, GgufValue};
pub use write::GgufWriter;
