//! A model's tokenizer as its GGUF metadata describes it (`tokenizer.ggml.*`):
//! the raw description, validated when a [`Tokenizer`](super::Tokenizer) is
//! built from it.

/// The kinds of vocabulary entry GGUF records in `tokenizer.ggml.token_type`
/// (the llama.cpp numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenKind {
    /// An ordinary piece of text.
    Normal,
    /// The unknown-piece token.
    Unknown,
    /// A control token (`<s>`, `<|im_start|>`): matched in text as one token,
    /// skipped when decoding for display.
    Control,
    /// A token the model's authors added: matched in text as one token.
    UserDefined,
    /// A reserved slot that never appears in text.
    Unused,
    /// A raw byte (`<0x0A>`) for SentencePiece byte fallback.
    Byte,
}

impl TokenKind {
    /// The kind for GGUF's code, or `None` for a code GGUF does not define.
    pub fn from_code(code: i64) -> Option<Self> {
        Some(match code {
            1 => TokenKind::Normal,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => return None,
        })
    }
}

/// The `tokenizer.ggml.*` keys of a GGUF file, unvalidated. The GGUF loader
/// fills it from the file ([`TokenizerMetadata::from_gguf`]); tests fill it
/// by hand. [`Tokenizer::from_metadata`](super::Tokenizer::from_metadata)
/// checks every field and refuses what it cannot honour exactly.
#[derive(Debug, Clone, Default)]
pub struct TokenizerMetadata {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: how text is split before BPE (`"smollm"`, `"llama3"`, ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, indexed by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores` (SentencePiece merge priorities), one per token.
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type` codes, one per token.
    pub token_types: Option<Vec<i64>>,
    /// `tokenizer.ggml.merges` ("left right", highest priority first).
    pub merges: Vec<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u64>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u64>,
    /// `tokenizer.ggml.eot_token_id` (end of turn), where the file names one.
    pub eot_id: Option<u64>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk_id: Option<u64>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece's dummy prefix).
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}
