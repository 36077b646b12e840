//! [`Tokenizer`]: text to token ids and back, as the model was trained.

use std::path::Path;

use super::TextError;
use super::metadata::TokenizerMetadata;
use super::vocab;

/// How [`Tokenizer::encode`] brackets text with BOS/EOS.
#[derive(Debug, Clone)]
enum Bracket {
    /// `tokenizer.json`'s own post-processor decides (Hugging Face's
    /// `add_special_tokens=True`).
    PostProcessor,
    /// The GGUF metadata's `add_bos_token` / `add_eos_token`.
    Ids { bos: Option<u32>, eos: Option<u32> },
}

/// A model's tokenizer: Hugging Face's implementation, loaded from a
/// `tokenizer.json` or rebuilt from GGUF metadata.
///
/// Special tokens written in the text (`<|im_start|>`) encode as those
/// tokens; [`encode`](Self::encode) adds BOS only where the model says so;
/// every id given to [`decode`](Self::decode) must be in the vocabulary.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bracket: Bracket,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    special: std::sync::Arc<std::collections::HashSet<u32>>,
    /// `inner` with special-token text left as text: what
    /// [`encode_text`](Self::encode_text) encodes with.
    as_text: std::sync::Arc<tokenizers::Tokenizer>,
    /// Bytes with no token in a byte-level vocabulary: text holding one is
    /// refused rather than encoded without it.
    missing_bytes: Vec<u8>,
}

/// `inner`, encoding the text of its special tokens as ordinary text.
fn text_only(inner: &tokenizers::Tokenizer) -> std::sync::Arc<tokenizers::Tokenizer> {
    let mut t = inner.clone();
    t.set_encode_special_tokens(true);
    std::sync::Arc::new(t)
}

/// The ids of `inner`'s special added tokens.
fn special_ids(inner: &tokenizers::Tokenizer) -> std::sync::Arc<std::collections::HashSet<u32>> {
    std::sync::Arc::new(
        inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect(),
    )
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .finish()
    }
}

impl Tokenizer {
    /// A Hugging Face `tokenizer.json`. BOS/EOS are what its post-processor
    /// adds; use [`from_hf_dir`](Self::from_hf_dir) to also learn the BOS and
    /// EOS ids from `tokenizer_config.json`.
    pub fn from_file(path: &Path) -> Result<Self, TextError> {
        let bytes = std::fs::read(path).map_err(|source| TextError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TextError::BadTokenizerFile {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
        Ok(Tokenizer {
            special: special_ids(&inner),
            as_text: text_only(&inner),
            inner,
            bracket: Bracket::PostProcessor,
            bos: None,
            eos: None,
            eot: None,
            missing_bytes: Vec::new(),
        })
    }

    /// The tokenizer of a Hugging Face model folder: `tokenizer.json`, with
    /// BOS and EOS named by `tokenizer_config.json` where it is present.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TextError> {
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Err(TextError::NoTokenizer {
                path: dir.display().to_string(),
            });
        }
        let mut tok = Self::from_file(&file)?;
        if let Some(cfg) = super::hf::tokenizer_config(dir)? {
            tok.bos = cfg.bos_token.as_deref().and_then(|t| tok.token_to_id(t));
            tok.eos = cfg.eos_token.as_deref().and_then(|t| tok.token_to_id(t));
        }
        Ok(tok)
    }

    /// The tokenizer GGUF metadata describes (`tokenizer.ggml.*`), or a typed
    /// refusal naming the key it cannot honour (an unknown tokenizer model or
    /// pre-tokenizer, ids outside the vocabulary, inconsistent lengths).
    pub fn from_metadata(meta: &TokenizerMetadata) -> Result<Self, TextError> {
        let built = vocab::build(meta)?;
        let id = |v: Option<u64>| v.map(|v| v as u32); // checked in build
        let (bos, eos) = (id(meta.bos_id), id(meta.eos_id));
        Ok(Tokenizer {
            special: special_ids(&built.inner),
            as_text: text_only(&built.inner),
            inner: built.inner,
            bracket: Bracket::Ids {
                bos: bos.filter(|_| built.add_bos),
                eos: eos.filter(|_| built.add_eos),
            },
            bos,
            eos,
            eot: id(meta.eot_id),
            missing_bytes: built.missing_bytes,
        })
    }

    /// `text` as token ids, with BOS (or EOS) added only where the model's
    /// tokenizer says so. Special tokens written in the text are parsed.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        match self.bracket {
            Bracket::PostProcessor => self.encode_with(text, true),
            Bracket::Ids { bos, eos } => {
                let body = self.encode_with(text, false)?;
                let mut ids = Vec::with_capacity(body.len() + 2);
                ids.extend(bos);
                ids.extend(body);
                ids.extend(eos);
                Ok(ids)
            }
        }
    }

    /// `text` as token ids with nothing added: for text that already holds
    /// its special tokens, such as a rendered chat template.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.encode_with(text, false)
    }

    /// `text` as token ids with nothing added and special tokens left
    /// unparsed: `<|im_end|>` written in `text` encodes as the pieces of its
    /// characters, never as the control token. For text from a user that
    /// must not be able to forge the model's control tokens.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.check_bytes(text)?;
        self.as_text
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TextError::Encode {
                reason: e.to_string(),
            })
    }

    /// The special tokens (control tokens) and their texts.
    pub fn special_tokens(&self) -> Vec<(u32, String)> {
        let mut all: Vec<(u32, String)> = self
            .special
            .iter()
            .filter_map(|&id| Some((id, self.id_to_token(id)?)))
            .collect();
        all.sort_unstable();
        all
    }

    fn check_bytes(&self, text: &str) -> Result<(), TextError> {
        if !self.missing_bytes.is_empty()
            && let Some(b) = text.bytes().find(|b| self.missing_bytes.contains(b))
        {
            return Err(TextError::Encode {
                reason: format!(
                    "byte 0x{b:02X} has no token in this model's vocabulary; remove it from the text"
                ),
            });
        }
        Ok(())
    }

    fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TextError> {
        self.check_bytes(text)?;
        self.inner
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TextError::Encode {
                reason: e.to_string(),
            })
    }

    /// The text of `ids`; special tokens are left out when `skip_special`.
    /// An id outside the vocabulary is an error, never silently dropped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        if let Some(&id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(TextError::UnknownTokenId {
                id,
                vocab: self.vocab_size(),
            });
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TextError::Decode {
                reason: e.to_string(),
            })
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token written exactly as in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary entry for `id`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// True for control tokens (`<|im_end|>`, `<s>`): matched whole in text,
    /// left out of display text.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// The beginning-of-sequence id, where the model names one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence id, where the model names one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The end-of-turn id the model's metadata names (`eot_token_id`), if any.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// The text of the BOS token (what chat templates call `bos_token`).
    pub fn bos_token(&self) -> Option<String> {
        self.bos.and_then(|id| self.id_to_token(id))
    }

    /// The text of the EOS token (what chat templates call `eos_token`).
    pub fn eos_token(&self) -> Option<String> {
        self.eos.and_then(|id| self.id_to_token(id))
    }
}
