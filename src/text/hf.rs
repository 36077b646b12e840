//! What a Hugging Face model folder says about its text beyond
//! `tokenizer.json`: `tokenizer_config.json` (BOS/EOS token names, the chat
//! template), `chat_template.jinja`, and `generation_config.json`'s EOS ids.

use std::path::Path;

use serde_json::Value;

use super::TextError;

/// The fields of `tokenizer_config.json` the text layer reads.
#[derive(Debug, Default)]
pub(crate) struct TokenizerConfig {
    pub(crate) bos_token: Option<String>,
    pub(crate) eos_token: Option<String>,
    pub(crate) chat_template: Option<String>,
}

fn read_json(path: &Path) -> Result<Option<Value>, TextError> {
    if !path.is_file() {
        return Ok(None);
    }
    let bytes = std::fs::read(path).map_err(|source| TextError::Io {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| TextError::BadTokenizerFile {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
}

/// A special token as the config writes it: a string or `{"content": ...}`.
fn token_name(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// `tokenizer_config.json` of `dir`, `None` when the folder has none. The
/// chat template is the config's (a string, or the entry named "default" of
/// a list), else the folder's `chat_template.jinja`.
pub(crate) fn tokenizer_config(dir: &Path) -> Result<Option<TokenizerConfig>, TextError> {
    let path = dir.join("tokenizer_config.json");
    let Some(json) = read_json(&path)? else {
        return Ok(None);
    };
    let template = match json.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        None | Some(Value::Null) => None,
        Some(_) => {
            return Err(TextError::BadTokenizerFile {
                path: path.display().to_string(),
                reason: "chat_template is neither a string nor a list of named templates".into(),
            });
        }
    };
    let template = match template {
        Some(t) => Some(t),
        None => {
            let jinja = dir.join("chat_template.jinja");
            if jinja.is_file() {
                Some(
                    std::fs::read_to_string(&jinja).map_err(|source| TextError::Io {
                        path: jinja.display().to_string(),
                        source,
                    })?,
                )
            } else {
                None
            }
        }
    };
    Ok(Some(TokenizerConfig {
        bos_token: token_name(json.get("bos_token")),
        eos_token: token_name(json.get("eos_token")),
        chat_template: template,
    }))
}

/// `generation_config.json`'s `eos_token_id` (one id or a list): the ids
/// that end a generation, where the folder says.
pub(crate) fn generation_eos_ids(dir: &Path) -> Result<Vec<u32>, TextError> {
    let Some(json) = read_json(&dir.join("generation_config.json"))? else {
        return Ok(Vec::new());
    };
    let ids = match json.get("eos_token_id") {
        Some(Value::Number(n)) => vec![n.clone()],
        Some(Value::Array(a)) => a.iter().filter_map(|v| v.as_number().cloned()).collect(),
        _ => Vec::new(),
    };
    Ok(ids
        .iter()
        .filter_map(|n| n.as_u64().and_then(|v| u32::try_from(v).ok()))
        .collect())
}
