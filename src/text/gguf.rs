//! [`TokenizerMetadata`] read from a GGUF file's `tokenizer.*` keys.

use crate::format::gguf::{GgufFile, GgufValue};

use super::{TextError, TokenizerMetadata};

fn wrong_type(key: &str, want: &str, got: &GgufValue) -> TextError {
    TextError::BadMetadata {
        key: key.to_string(),
        reason: format!("expected {want}, found {}", got.type_name()),
    }
}

fn string(f: &GgufFile, key: &str) -> Result<Option<String>, TextError> {
    f.metadata(key)
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| wrong_type(key, "a string", v))
        })
        .transpose()
}

fn id(f: &GgufFile, key: &str) -> Result<Option<u64>, TextError> {
    f.metadata(key)
        .map(|v| {
            v.as_u64()
                .ok_or_else(|| wrong_type(key, "an unsigned integer", v))
        })
        .transpose()
}

fn flag(f: &GgufFile, key: &str) -> Result<Option<bool>, TextError> {
    f.metadata(key)
        .map(|v| v.as_bool().ok_or_else(|| wrong_type(key, "a bool", v)))
        .transpose()
}

fn strings(f: &GgufFile, key: &str) -> Result<Option<Vec<String>>, TextError> {
    f.metadata(key)
        .map(|v| {
            v.as_str_array()
                .map(<[String]>::to_vec)
                .ok_or_else(|| wrong_type(key, "an array of strings", v))
        })
        .transpose()
}

impl TokenizerMetadata {
    /// The tokenizer description in `file`'s metadata. `MissingMetadata`
    /// when the file has no `tokenizer.ggml.model` (converted without a
    /// tokenizer); `BadMetadata` naming the key whose value has the wrong type.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, TextError> {
        let model = string(file, "tokenizer.ggml.model")?.ok_or(TextError::MissingMetadata {
            key: "tokenizer.ggml.model".into(),
        })?;
        let tokens = strings(file, "tokenizer.ggml.tokens")?.ok_or(TextError::MissingMetadata {
            key: "tokenizer.ggml.tokens".into(),
        })?;
        let scores = file
            .metadata("tokenizer.ggml.scores")
            .map(|v| {
                v.as_f32_array()
                    .map(<[f32]>::to_vec)
                    .ok_or_else(|| wrong_type("tokenizer.ggml.scores", "an array of f32", v))
            })
            .transpose()?;
        let token_types = file
            .metadata("tokenizer.ggml.token_type")
            .map(|v| {
                v.as_i32_array()
                    .map(|a| a.iter().map(|&t| i64::from(t)).collect())
                    .ok_or_else(|| wrong_type("tokenizer.ggml.token_type", "an array of i32", v))
            })
            .transpose()?;
        Ok(TokenizerMetadata {
            model,
            pre: string(file, "tokenizer.ggml.pre")?,
            tokens,
            scores,
            token_types,
            merges: strings(file, "tokenizer.ggml.merges")?.unwrap_or_default(),
            bos_id: id(file, "tokenizer.ggml.bos_token_id")?,
            eos_id: id(file, "tokenizer.ggml.eos_token_id")?,
            eot_id: id(file, "tokenizer.ggml.eot_token_id")?,
            unk_id: id(file, "tokenizer.ggml.unknown_token_id")?,
            add_bos: flag(file, "tokenizer.ggml.add_bos_token")?,
            add_eos: flag(file, "tokenizer.ggml.add_eos_token")?,
            add_space_prefix: flag(file, "tokenizer.ggml.add_space_prefix")?,
            chat_template: string(file, "tokenizer.chat_template")?,
        })
    }
}
