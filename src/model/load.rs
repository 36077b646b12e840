//! Where a [`Model`] comes from: one entry point for every model format (a
//! Hugging Face folder, a GGUF file or a llama2.c `.bin` file, told apart by
//! what the path is), and the constructors that check weights and place them
//! on a backend. The loaders sit above the forward pass: they build a
//! `Model` through `model::place`, and the pass knows none of them.

use std::path::Path;

use crate::backend::{Backend, CpuBackend};
use crate::model::place::{Placer, WeightSink};
use crate::model::{Model, ModelError, ModelWeights, load_hf, load_llama2c};

impl Model<CpuBackend> {
    /// Places `weights` on a [`CpuBackend`] using every core.
    pub fn cpu(weights: ModelWeights) -> Result<Self, ModelError> {
        Model::new(CpuBackend::new(), weights)
    }
}

impl<B: Backend> Model<B> {
    /// Checks `weights` and places them on `backend`.
    pub fn new(backend: B, weights: ModelWeights) -> Result<Self, ModelError> {
        weights.check_shapes()?;
        let ModelWeights {
            config,
            embedding,
            layers,
            final_norm,
            lm_head,
        } = weights;
        let mut placer = Placer::new(backend, config)?;
        placer.embedding(embedding)?;
        for l in layers {
            placer.layer(l)?;
        }
        placer.finish(final_norm, lm_head)
    }

    /// Loads the model at `path` (a Hugging Face folder or a llama2.c file,
    /// as [`load_model`](crate::model::load_model) reads them) and places it
    /// on `backend` as it is read: a Hugging Face checkpoint's tensors are
    /// placed one layer at a time, so loading never holds the whole model in
    /// f32. A bf16 checkpoint, kept as bf16 by the CPU backend, needs about
    /// its file's size plus its largest layer (or embedding) in f32, where
    /// reading it whole first needed twice its file's size (`cargo bench
    /// --bench load_memory`). It refuses the same models, with the same
    /// numbers and the same [fingerprint](Model::fingerprint) for those it
    /// accepts, as `Model::new(backend, load_model(path)?)`; a backend that
    /// cannot run the model's shape refuses it before any tensor is read.
    pub fn load(backend: B, path: &Path) -> Result<Self, ModelError> {
        load_on(backend, path)
    }
}

/// Loads the model at `path`: a directory is a Hugging Face checkpoint
/// (`config.json` + `*.safetensors`), a `.gguf` file (or one starting with
/// GGUF's magic) is GGUF, any other file is a llama2.c `.bin`.
///
/// ```no_run
/// let weights = handoff::model::load_model(std::path::Path::new("stories260K.bin"))?;
/// println!("{} layers", weights.config.n_layers);
/// # Ok::<(), handoff::model::ModelError>(())
/// ```
pub fn load_model(path: &Path) -> Result<ModelWeights, ModelError> {
    if is_gguf(path) {
        crate::model::gguf::load_gguf(path)
    } else if is_hf_folder(path)? {
        load_hf(path)
    } else {
        load_llama2c(path)
    }
}

/// [`load_model`], placed on `backend` as it is read ([`Model::load`]).
pub(crate) fn load_on<B: Backend>(backend: B, path: &Path) -> Result<Model<B>, ModelError> {
    if is_gguf(path) {
        crate::model::gguf::load_gguf_on(backend, path)
    } else if is_hf_folder(path)? {
        crate::model::hf::load_hf_on(backend, path)
    } else {
        // A llama2.c file is f32 already: nothing to save by streaming it.
        Model::new(backend, load_llama2c(path)?)
    }
}

/// True for a file named `*.gguf` or starting with GGUF's magic.
fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|()| &magic == b"GGUF")
}

/// True for a folder (read as a Hugging Face checkpoint), false for a file;
/// a folder without config.json is refused with what to pass instead.
fn is_hf_folder(path: &Path) -> Result<bool, ModelError> {
    let meta = std::fs::metadata(path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    if meta.is_dir() && !path.join("config.json").is_file() {
        return Err(ModelError::BadHeader(format!(
            "{} is a directory, read as a Hugging Face checkpoint, but has no config.json; \
             pass the checkpoint folder (config.json and *.safetensors) or a llama2.c .bin file",
            path.display()
        )));
    }
    Ok(meta.is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_read_as_hugging_face_and_a_file_as_llama2c() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let hf = load_model(&root.join("tests/fixtures/hf_tiny_llama")).unwrap();
        assert_eq!(hf.config.rope_style, crate::model::RopeStyle::Half);

        // A folder without config.json says how folders are read.
        let err = load_model(&root.join("tests")).unwrap_err();
        assert!(
            matches!(&err, ModelError::BadHeader(m) if m.contains("Hugging Face")),
            "{err}"
        );

        // A file with a Hugging Face config inside is still a llama2.c file
        // to this dispatcher, and fails as one.
        let err = load_model(&root.join("tests/fixtures/hf_tiny_llama/config.json")).unwrap_err();
        assert!(matches!(err, ModelError::BadHeader(_)), "{err}");

        let missing = load_model(&root.join("no/such/model")).unwrap_err();
        assert!(matches!(missing, ModelError::Io { .. }));

        let bin = root.join("../shared/models/stories260K.bin");
        if bin.exists() {
            let l2c = load_model(&bin).unwrap();
            assert_eq!(l2c.config.rope_style, crate::model::RopeStyle::Interleaved);
        } else {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "skipping the llama2.c half: {} is absent",
                bin.display()
            );
        }
    }
}
