//! A Hugging Face tokenizer rebuilt from GGUF tokenizer metadata: the same
//! pieces as the model's `tokenizer.json` would hold (BPE model, split,
//! decoder, special tokens), built from the vocabulary in the file.

use std::collections::HashMap;

use tokenizers::AddedToken;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};

use super::TextError;
use super::metadata::{TokenKind, TokenizerMetadata};
use super::pretokenizer::pre_split;

/// SentencePiece's word-boundary mark.
const SPM_SPACE: char = '\u{2581}';

/// What [`build`] makes: the tokenizer and the ids it brackets text with.
pub(crate) struct Built {
    pub(crate) inner: tokenizers::Tokenizer,
    pub(crate) add_bos: bool,
    pub(crate) add_eos: bool,
    /// Bytes the vocabulary has no token for (some byte-level vocabularies
    /// leave out control characters): text holding one cannot be encoded
    /// without losing it, so [`Tokenizer::encode`](super::Tokenizer::encode)
    /// refuses it.
    pub(crate) missing_bytes: Vec<u8>,
}

fn bad(key: &str, reason: impl Into<String>) -> TextError {
    TextError::BadMetadata {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// `id` as a vocabulary index, or a typed error naming `key`.
pub(crate) fn checked_id(key: &str, id: u64, vocab: usize) -> Result<u32, TextError> {
    match u32::try_from(id) {
        Ok(i) if (i as usize) < vocab => Ok(i),
        _ => Err(bad(
            key,
            format!("id {id} is outside the vocabulary of {vocab}"),
        )),
    }
}

/// Builds the tokenizer `meta` describes, or says which field it cannot honour.
pub(crate) fn build(meta: &TokenizerMetadata) -> Result<Built, TextError> {
    let n = meta.tokens.len();
    if n == 0 {
        return Err(TextError::MissingMetadata {
            key: "tokenizer.ggml.tokens".into(),
        });
    }
    if u32::try_from(n).is_err() {
        return Err(bad(
            "tokenizer.ggml.tokens",
            format!("{n} tokens do not fit u32 ids"),
        ));
    }
    let kinds = kinds(meta)?;
    let mut vocab = Vocab::default();
    let mut first_id: HashMap<&str, u32> = HashMap::with_capacity(n);
    for (id, token) in meta.tokens.iter().enumerate() {
        let id = id as u32;
        if let Some(&first) = first_id.get(token.as_str()) {
            return Err(TextError::DuplicateToken {
                token: token.clone(),
                first,
                second: id,
            });
        }
        first_id.insert(token, id);
        vocab.insert(token.clone(), id);
    }
    for (key, id) in [
        ("tokenizer.ggml.bos_token_id", meta.bos_id),
        ("tokenizer.ggml.eos_token_id", meta.eos_id),
        ("tokenizer.ggml.eot_token_id", meta.eot_id),
        ("tokenizer.ggml.unknown_token_id", meta.unk_id),
    ] {
        if let Some(id) = id {
            checked_id(key, id, n)?;
        }
    }

    let missing_bytes = if meta.model == "gpt2" {
        (0..=255u8)
            .filter(|&b| !vocab.contains_key(byte_char(b).to_string().as_str()))
            .collect()
    } else {
        Vec::new() // SentencePiece falls back to <0xXX> tokens
    };
    let (mut inner, add_bos) = match meta.model.as_str() {
        "gpt2" => byte_level_bpe(meta, vocab)?,
        "llama" => sentencepiece_bpe(meta, vocab, &kinds, &first_id)?,
        other => {
            return Err(TextError::UnsupportedTokenizerModel {
                model: other.to_string(),
            });
        }
    };

    // Control and user-defined tokens are matched whole in text, before any
    // split; control tokens are also "special" (skipped for display).
    let mut specials = Vec::new();
    let mut added = Vec::new();
    for (token, kind) in meta.tokens.iter().zip(&kinds) {
        match kind {
            TokenKind::Control => specials.push(AddedToken::from(token.clone(), true)),
            TokenKind::UserDefined => added.push(AddedToken::from(token.clone(), false)),
            _ => {}
        }
    }
    inner.add_special_tokens(&specials);
    inner.add_tokens(&added);
    if add_bos && meta.bos_id.is_none() {
        return Err(TextError::MissingMetadata {
            key: "tokenizer.ggml.bos_token_id (add_bos_token is set)".into(),
        });
    }
    let add_eos = meta.add_eos.unwrap_or(false);
    if add_eos && meta.eos_id.is_none() {
        return Err(TextError::MissingMetadata {
            key: "tokenizer.ggml.eos_token_id (add_eos_token is set)".into(),
        });
    }
    Ok(Built {
        inner,
        add_bos,
        add_eos,
        missing_bytes,
    })
}

/// Each token's kind; every token is `Normal` when the file has no types.
fn kinds(meta: &TokenizerMetadata) -> Result<Vec<TokenKind>, TextError> {
    let key = "tokenizer.ggml.token_type";
    match &meta.token_types {
        None => Ok(vec![TokenKind::Normal; meta.tokens.len()]),
        Some(types) if types.len() != meta.tokens.len() => Err(bad(
            key,
            format!("{} types for {} tokens", types.len(), meta.tokens.len()),
        )),
        Some(types) => types
            .iter()
            .enumerate()
            .map(|(id, &code)| {
                TokenKind::from_code(code)
                    .ok_or_else(|| bad(key, format!("token {id} has unknown type {code}")))
            })
            .collect(),
    }
}

/// GPT-2's printable stand-in for byte `b`: printable Latin-1 bytes stand
/// for themselves, the others for U+0100 onwards in byte order.
fn byte_char(b: u8) -> char {
    let printable = |x: u8| (b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || x >= 0xAE;
    if printable(b) {
        char::from(b)
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(0x100 + n).unwrap_or(char::REPLACEMENT_CHARACTER)
    }
}

/// GPT-2 style: bytes mapped to printable characters, merges from the file,
/// the split named by `tokenizer.ggml.pre`.
fn byte_level_bpe(
    meta: &TokenizerMetadata,
    vocab: Vocab,
) -> Result<(tokenizers::Tokenizer, bool), TextError> {
    let split = pre_split(meta.pre.as_deref())?;

    let mut merges: Merges = Vec::with_capacity(meta.merges.len());
    for (i, m) in meta.merges.iter().enumerate() {
        let mut parts = m.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(l), Some(r), None) if !l.is_empty() && !r.is_empty() => {
                if !vocab.contains_key(l) || !vocab.contains_key(r) {
                    return Err(bad(
                        "tokenizer.ggml.merges",
                        format!("merge {i} ({m:?}) names a piece outside the vocabulary"),
                    ));
                }
                merges.push((l.to_string(), r.to_string()));
            }
            _ => {
                return Err(bad(
                    "tokenizer.ggml.merges",
                    format!("merge {i} ({m:?}) is not two pieces separated by one space"),
                ));
            }
        }
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(split.ignore_merges)
        .build()
        .map_err(|e| bad("tokenizer.ggml.merges", e.to_string()))?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(split.pre_tokenizer));
    tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::new(
        false, true, true,
    ))));
    Ok((tk, meta.add_bos.unwrap_or(split.bos_by_default)))
}

/// SentencePiece BPE (Llama 1/2, Mistral v0.1): pieces merge in the order of
/// the merged piece's score, unknown characters fall back to `<0xXX>` bytes,
/// spaces are `▁` and a leading one is added where the file says so.
fn sentencepiece_bpe(
    meta: &TokenizerMetadata,
    vocab: Vocab,
    kinds: &[TokenKind],
    ids: &HashMap<&str, u32>,
) -> Result<(tokenizers::Tokenizer, bool), TextError> {
    let scores = meta.scores.as_ref().ok_or(TextError::MissingMetadata {
        key: "tokenizer.ggml.scores".into(),
    })?;
    if scores.len() != meta.tokens.len() {
        return Err(bad(
            "tokenizer.ggml.scores",
            format!("{} scores for {} tokens", scores.len(), meta.tokens.len()),
        ));
    }
    if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
        return Err(bad(
            "tokenizer.ggml.scores",
            format!("score {i} is not finite"),
        ));
    }
    // A merge (left, right) exists for every normal piece that splits into
    // two normal pieces; the piece's score orders it (highest first), ties
    // by id, as SentencePiece's bigram merging picks them.
    let normal = |id: u32| kinds[id as usize] == TokenKind::Normal;
    let mut ranked: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (id, piece) in meta.tokens.iter().enumerate() {
        let id = id as u32;
        if !normal(id) {
            continue;
        }
        for (cut, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(cut);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r))
                && normal(li)
                && normal(ri)
            {
                ranked.push((scores[id as usize], id, li, ri));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Merges = ranked
        .iter()
        .map(|&(_, _, l, r)| {
            (
                meta.tokens[l as usize].clone(),
                meta.tokens[r as usize].clone(),
            )
        })
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = meta.unk_id {
        builder = builder.unk_token(meta.tokens[unk as usize].clone());
    }
    let bpe = builder
        .build()
        .map_err(|e| bad("tokenizer.ggml.tokens", e.to_string()))?;
    let prefix = meta.add_space_prefix.unwrap_or(true);
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let scheme = if prefix {
        PrependScheme::First
    } else {
        PrependScheme::Never
    };
    tk.with_pre_tokenizer(Some(Metaspace::new(SPM_SPACE, scheme, false)));
    let space = Replace::new(SPM_SPACE.to_string(), " ")
        .map_err(|e| bad("tokenizer.ggml.model", e.to_string()))?;
    let mut steps = vec![
        DecoderWrapper::Replace(space),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if prefix {
        steps.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    tk.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(steps))));
    Ok((tk, meta.add_bos.unwrap_or(true)))
}
