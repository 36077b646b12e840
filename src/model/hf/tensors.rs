//! The tensors of a checkpoint across all its shards, each read at most once
//! and every one accounted for: a tensor nobody asked for means config.json
//! and the weights disagree, and is refused rather than silently ignored.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::model::ModelError;
use crate::model::hf::shard::Shard;

pub(super) struct TensorSet<'a> {
    shards: Vec<Shard<'a>>,
    /// tensor name -> index into `shards`
    owner: HashMap<String, usize>,
    taken: BTreeSet<String>,
}

impl<'a> TensorSet<'a> {
    /// Indexes the shards; a tensor stored twice is a corrupt checkpoint.
    /// `weight_map` (from `model.safetensors.index.json`) must agree with
    /// where each tensor actually is.
    pub(super) fn new(
        shards: Vec<Shard<'a>>,
        weight_map: Option<&BTreeMap<String, String>>,
    ) -> Result<Self, ModelError> {
        let mut owner = HashMap::new();
        for (i, shard) in shards.iter().enumerate() {
            for name in shard.names() {
                if let Some(&j) = owner.get(&name) {
                    let first: &Shard<'_> = &shards[j];
                    return Err(ModelError::BadHeader(format!(
                        "tensor {name} is stored in both {} and {}",
                        first.name, shard.name
                    )));
                }
                owner.insert(name, i);
            }
        }
        if let Some(map) = weight_map {
            for (tensor, file) in map {
                let in_file = shards
                    .iter()
                    .find(|s| &s.name == file)
                    .is_some_and(|s| s.contains(tensor));
                if !in_file {
                    return Err(ModelError::MissingTensor {
                        tensor: format!(
                            "{tensor} (model.safetensors.index.json places it in {file})"
                        ),
                    });
                }
            }
            if let Some(name) = owner.keys().find(|n| !map.contains_key(*n)) {
                return Err(ModelError::BadHeader(format!(
                    "tensor {name} is not listed in model.safetensors.index.json"
                )));
            }
        }
        Ok(Self {
            shards,
            owner,
            taken: BTreeSet::new(),
        })
    }

    /// Reads a required tensor as f32 of exactly `shape`.
    pub(super) fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let missing = || ModelError::MissingTensor {
            tensor: format!("{name} (expected shape {shape:?})"),
        };
        let &i = self.owner.get(name).ok_or_else(missing)?;
        let data = self.shards[i].read_f32(name, shape).ok_or_else(missing)??;
        self.taken.insert(name.to_string());
        Ok(data)
    }

    /// How many tensors the checkpoint holds.
    pub(super) fn len(&self) -> usize {
        self.owner.len()
    }

    /// Whether the checkpoint holds a tensor named `name`.
    pub(super) fn has(&self, name: &str) -> bool {
        self.owner.contains_key(name)
    }

    /// The first tensor (by name) that `wanted` does not accept, before any
    /// is read.
    pub(super) fn first_unwanted(&self, wanted: impl Fn(&str) -> bool) -> Option<&str> {
        let mut names: Vec<&str> = self.owner.keys().map(String::as_str).collect();
        names.sort_unstable();
        names.into_iter().find(|n| !wanted(n))
    }

    /// The first tensor that was neither taken nor allowed to be ignored.
    pub(super) fn first_unused(&self, ignorable: impl Fn(&str) -> bool) -> Option<&str> {
        let mut names: Vec<&str> = self.owner.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
            .into_iter()
            .find(|n| !self.taken.contains(*n) && !ignorable(n))
    }
}
