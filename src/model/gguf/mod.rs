//! Llama-family models from GGUF files: the configuration from the
//! metadata, the weights from the tensor directory. The file itself (its
//! reader, values, tensor directory and errors) is [`crate::format::gguf`],
//! re-exported here so that `handoff::model::gguf::GgufFile` and the rest
//! keep their paths.

pub(crate) mod model;
mod random;

pub use crate::backend::QuantMatrix;
pub(crate) use crate::backend::quant::dequantize;
pub use crate::format::gguf::{
    GgmlType, GgufArray, GgufError, GgufFile, GgufValue, GgufWriter, TensorInfo,
};
pub use random::random_gguf;

use std::path::Path;

use crate::backend::Backend;
use crate::model::place::{Collect, Placer};
use crate::model::{Model, ModelError, ModelWeights};

/// Loads a GGUF model with every tensor dequantized to f32 (a reference, or
/// for backends without quantized kernels; [`Model::load`] keeps quantized
/// matrices quantized on the CPU).
///
/// ```no_run
/// let w = handoff::model::gguf::load_gguf(std::path::Path::new("model.gguf"))?;
/// println!("{} layers", w.config.n_layers);
/// # Ok::<(), handoff::model::ModelError>(())
/// ```
pub fn load_gguf(path: &Path) -> Result<ModelWeights, ModelError> {
    let f = GgufFile::open(path)?;
    let c = model::config(&f)?;
    model::assemble(&f, &c, Collect::new(c.clone()))
}

/// [`load_gguf`] from bytes in memory (fuzzing, hosts that fetch files).
pub fn load_gguf_bytes(bytes: Vec<u8>) -> Result<ModelWeights, ModelError> {
    let f = GgufFile::from_bytes(bytes)?;
    let c = model::config(&f)?;
    model::assemble(&f, &c, Collect::new(c.clone()))
}

/// Places a GGUF model on `backend` layer by layer; quantized matrices go
/// through [`Backend::upload_quant`].
pub(crate) fn load_gguf_on<B: Backend>(backend: B, path: &Path) -> Result<Model<B>, ModelError> {
    let f = GgufFile::open(path)?;
    let c = model::config(&f)?;
    model::assemble(&f, &c, Placer::new(backend, c.clone())?)
}
