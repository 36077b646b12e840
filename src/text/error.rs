//! The text layer's one error enum.

use crate::http::HttpStatus;

/// Everything that can go wrong turning text into token ids and back, or a
/// conversation into a prompt. Each variant says what happened and what to
/// do; [`HttpStatus`] maps it to the status a server answers with (400 when
/// the client must change its request, 500 when the model's own tokenizer or
/// template is unusable).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TextError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path} has no tokenizer: expected tokenizer.json in a Hugging Face folder or tokenizer.ggml.* metadata in a GGUF file"
    )]
    NoTokenizer { path: String },
    #[error("{path} is not a usable tokenizer file: {reason}")]
    BadTokenizerFile { path: String, reason: String },
    #[error(
        "the model's tokenizer metadata lacks {key}; the file was converted without a tokenizer"
    )]
    MissingMetadata { key: String },
    #[error("the model's tokenizer metadata {key} is invalid: {reason}")]
    BadMetadata { key: String, reason: String },
    #[error(
        "tokenizer model {model:?} is not supported: handoff reads \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece) vocabularies"
    )]
    UnsupportedTokenizerModel { model: String },
    #[error(
        "pre-tokenizer {pre:?} is not supported, so this vocabulary cannot be split as the model was trained; supported: {supported}"
    )]
    UnsupportedPreTokenizer { pre: String, supported: String },
    #[error("token {token:?} appears twice in the vocabulary (ids {first} and {second})")]
    DuplicateToken {
        token: String,
        first: u32,
        second: u32,
    },
    #[error("cannot tokenize the text: {reason}")]
    Encode { reason: String },
    #[error("token id {id} is outside the vocabulary of {vocab}; no text can be produced for it")]
    UnknownTokenId { id: u32, vocab: usize },
    #[error("cannot decode the token ids: {reason}")]
    Decode { reason: String },
    #[error(
        "this model ships no chat template ({source_name}); send a plain prompt instead of a conversation"
    )]
    NoChatTemplate { source_name: String },
    #[error("the model's chat template does not compile: {reason}")]
    TemplateSyntax { reason: String },
    #[error("the model's chat template refused the conversation: {message}")]
    TemplateRefused { message: String },
    #[error("the model's chat template failed while rendering the conversation: {reason}")]
    TemplateRender { reason: String },
    #[error(
        "the model's chat template exceeded its {limit} {}",
        if *at_load {
            "on a probe conversation when it was loaded: the template is refused"
        } else {
            "rendering this conversation"
        }
    )]
    TemplateLimit {
        limit: super::TemplateLimit,
        /// Found by the probe renders at load (the template is refused)
        /// rather than on a request's conversation.
        at_load: bool,
    },
    #[error("a stop string must not be empty")]
    EmptyStopString,
    #[error(transparent)]
    Gguf(#[from] crate::format::gguf::GgufError),
}

impl HttpStatus for TextError {
    fn http_status(&self) -> u16 {
        match self {
            TextError::Encode { .. }
            | TextError::UnknownTokenId { .. }
            | TextError::NoChatTemplate { .. }
            | TextError::TemplateRefused { .. }
            | TextError::EmptyStopString => 400,
            TextError::Gguf(e) => e.http_status(),
            _ => 500,
        }
    }
}
