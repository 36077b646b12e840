//! How a byte-level BPE vocabulary splits text before merging, by the name
//! GGUF records in `tokenizer.ggml.pre`. Each entry is the split the model's
//! own Hugging Face `tokenizer.json` uses (llama.cpp keeps the same table);
//! a name not listed is refused, never guessed.

use tokenizers::SplitDelimiterBehavior;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

use super::TextError;

/// Llama 3's split (also Falcon 3): case-insensitive contractions, letters
/// with one leading non-letter, numbers of up to three digits.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: Llama 3's with single digits.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The names this table knows, for the refusal message.
pub(crate) const SUPPORTED: &str = "gpt2, gpt-2 (GPT-2's split); smollm, starcoder, refact (single digits, then GPT-2's split); llama3, llama-v3, llama-bpe, falcon3 (Llama 3's); qwen2, deepseek-r1-qwen (Qwen2's)";

/// What one `tokenizer.ggml.pre` name means.
pub(crate) struct PreSplit {
    pub(crate) pre_tokenizer: PreTokenizerWrapper,
    /// Whole words found in the vocabulary skip the merges (Llama 3).
    pub(crate) ignore_merges: bool,
    /// Whether a missing `add_bos_token` means "add BOS" for this family.
    pub(crate) bos_by_default: bool,
}

/// The split for `pre` (`None`: GPT-2's, the format's default).
pub(crate) fn pre_split(pre: Option<&str>) -> Result<PreSplit, TextError> {
    let gpt2 = || PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    let regex_then_bytes = |regex: &str| -> Result<PreTokenizerWrapper, TextError> {
        let split = Split::new(
            SplitPattern::Regex(regex.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TextError::BadMetadata {
            key: "tokenizer.ggml.pre".into(),
            reason: format!("its split expression does not compile: {e}"),
        })?;
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
        ])))
    };
    let plain = |pre_tokenizer| PreSplit {
        pre_tokenizer,
        ignore_merges: false,
        bos_by_default: false,
    };
    Ok(match pre.unwrap_or("gpt2") {
        "gpt2" | "gpt-2" => plain(gpt2()),
        "smollm" | "starcoder" | "refact" => {
            plain(PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                gpt2(),
            ])))
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => PreSplit {
            pre_tokenizer: regex_then_bytes(LLAMA3_REGEX)?,
            ignore_merges: true,
            bos_by_default: true,
        },
        "qwen2" | "deepseek-r1-qwen" => plain(regex_then_bytes(QWEN2_REGEX)?),
        other => {
            return Err(TextError::UnsupportedPreTokenizer {
                pre: other.to_string(),
                supported: SUPPORTED.to_string(),
            });
        }
    })
}
