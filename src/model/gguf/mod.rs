//! GGUF files (llama.cpp's format, versions 2 and 3): the metadata and the
//! tensor directory ([`GgufFile`]), parsed with every count, length and
//! offset checked against the file before it sizes anything.

mod error;
mod file;
mod reader;
mod types;
mod value;

pub use error::GgufError;
pub use file::{GgufFile, TensorInfo};
pub use types::GgmlType;
pub use value::{GgufArray, GgufValue};
mod write;
pub use write::GgufWriter;
