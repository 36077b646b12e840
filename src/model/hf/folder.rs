//! The file-system side of a Hugging Face folder: which files make up the
//! checkpoint, mapped read-only for the duration of the load.

use std::collections::BTreeMap;
use std::io;
use std::path::{Component, Path};

use crate::model::error::{io_err, map_file};
use crate::model::hf::config::HfConfig;
use crate::model::hf::shard::Shard;
use crate::model::hf::tensors::TensorSet;
use crate::model::place::WeightSink;
use crate::model::{ModelConfig, ModelError};

const INDEX: &str = "model.safetensors.index.json";

/// `weight_map` of the shard index, with every file name checked to be a
/// plain name inside the folder (no path may escape it).
fn read_index(path: &Path) -> Result<BTreeMap<String, String>, ModelError> {
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let bad = |m: String| ModelError::BadHeader(format!("{INDEX}: {m}"));
    let root: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = root
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("weight_map is missing or not an object".to_string()))?;
    let mut out = BTreeMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map[{tensor}] = {file} is not a file name")))?;
        let mut parts = Path::new(file).components();
        let plain = matches!(
            (parts.next(), parts.next()),
            (Some(Component::Normal(_)), None)
        );
        if !plain {
            return Err(bad(format!(
                "weight_map[{tensor}] = {file:?} is not a plain file name in the model folder"
            )));
        }
        out.insert(tensor.clone(), file.to_string());
    }
    Ok(out)
}

/// All `*.safetensors` file names in `dir`, sorted.
fn list_safetensors(dir: &Path) -> Result<Vec<String>, ModelError> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        let entry = entry.map_err(|e| io_err(dir, e))?;
        if let Some(name) = entry.file_name().to_str()
            && name.ends_with(".safetensors")
        {
            names.push(name.to_string());
        }
    }
    names.sort();
    if names.is_empty() {
        return Err(io_err(
            dir,
            io::Error::new(
                io::ErrorKind::NotFound,
                "no *.safetensors file in the folder",
            ),
        ));
    }
    Ok(names)
}

/// Reads the checkpoint in `dir` into the sink `make` builds for its
/// configuration.
pub(super) fn load<S: WeightSink>(
    dir: &Path,
    make: impl FnOnce(ModelConfig) -> Result<S, ModelError>,
) -> Result<S::Out, ModelError> {
    let cfg_path = dir.join("config.json");
    let cfg = HfConfig::parse(&std::fs::read(&cfg_path).map_err(|e| io_err(&cfg_path, e))?)?;

    let index_path = dir.join(INDEX);
    let weight_map = if index_path.is_file() {
        Some(read_index(&index_path)?)
    } else {
        None
    };
    let names: Vec<String> = match &weight_map {
        Some(map) => {
            let mut files: Vec<String> = map.values().cloned().collect();
            files.sort();
            files.dedup();
            files
        }
        None => list_safetensors(dir)?,
    };
    let files = names
        .iter()
        .map(|n| map_file(&dir.join(n)))
        .collect::<Result<Vec<_>, _>>()?;
    let shards = names
        .iter()
        .zip(&files)
        .map(|(n, b)| Shard::parse(n, b.as_slice()))
        .collect::<Result<Vec<_>, _>>()?;
    let tensors = TensorSet::new(shards, weight_map.as_ref())?;
    super::assemble(&cfg, tensors, make(cfg.model.clone())?)
}
