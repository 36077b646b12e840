//! Story: a user types a sentence; the server must turn it into exactly the
//! token ids the model was trained on, from whatever the model ships: a
//! Hugging Face `tokenizer.json`, or the vocabulary inside a GGUF file. The
//! SmolLM2 GGUF's ids are compared with an independent implementation's
//! (tests/fixtures/text/smollm2_tokens.json, made by
//! scripts/make_text_fixtures.py; its "source" field says which: Hugging Face
//! transformers' GGUF tokenizer converter, or llama.cpp), the Hugging Face folder's
//! with Python's `tokenizers` (tests/fixtures/text/hf_tiny, made by
//! scripts/make_text_hf_fixture.py). Special tokens written in the text are
//! single tokens; BOS is added only where the model says so; a vocabulary the
//! crate cannot reproduce exactly is refused with the key that is wrong.

use crate::support::text_support;

use std::path::Path;

use handoff::HttpStatus;
use handoff::text::{Message, TextError, TextModel, Tokenizer, TokenizerMetadata};
use serde_json::Value;
use text_support::{byte_level, byte_text, sentencepiece, smollm2};

fn json(rel: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn smollm2_tokenizes_as_the_reference_implementation_does() {
    let Some(model) = smollm2() else { return };
    let f = json("tests/fixtures/text/smollm2_tokens.json");
    let tok = model.tokenizer();
    let texts = f["texts"].as_array().unwrap();
    assert!(texts.len() >= 15);
    for case in texts {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text).unwrap(), ids(&case["ids"]), "{text:?}");
    }
    // Rendered chats: special tokens parsed, nothing added.
    for case in f["chats"].as_array().unwrap() {
        let text = case["rendered"].as_str().unwrap();
        assert_eq!(
            tok.encode_plain(text).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
    }
}

#[test]
fn smollm2_chat_prompts_end_turns_with_im_end_and_add_no_bos() {
    let Some(model) = smollm2() else { return };
    let tok = model.tokenizer();
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(model.tokenizer().bos(), tok.token_to_id("<|im_start|>"));
    assert!(model.stop_ids().contains(&im_end));
    assert_eq!(
        tok.encode("Hello").unwrap().len(),
        1,
        "add_bos_token is false"
    );
    let (text, prompt) = model
        .render_chat(&[Message::new("user", "What is 2+2?")])
        .unwrap();
    assert!(text.ends_with("<|im_start|>assistant\n"));
    assert_eq!(prompt[0], tok.token_to_id("<|im_start|>").unwrap());
}

#[test]
fn a_hugging_face_folder_tokenizes_as_python_tokenizers_does() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text/hf_tiny");
    let f = json("tests/fixtures/text/hf_tiny/expected.json");
    let model = TextModel::load(&dir).unwrap();
    let tok = model.tokenizer();
    for case in f["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text).unwrap(), want, "{text:?}");
        // Without the post-processor's <s>, and back to the text.
        assert_eq!(tok.encode_plain(text).unwrap(), want[1..], "{text:?}");
        assert_eq!(tok.decode(&want[1..], false).unwrap(), text);
    }
    assert_eq!(tok.bos(), Some(f["bos_id"].as_u64().unwrap() as u32));
    // EOS from tokenizer_config.json, <|end|> from generation_config.json.
    assert_eq!(model.stop_ids(), ids(&f["eos_ids"]));
    let (text, _) = model.render_chat(&[Message::new("user", "hi")]).unwrap();
    assert_eq!(text, "<|user|>hi<|end|><|assistant|>");
}

#[test]
fn special_tokens_in_text_are_single_tokens_and_near_misses_are_text() {
    let tok = Tokenizer::from_metadata(&byte_level(&[])).unwrap();
    assert_eq!(
        tok.encode("<|im_start|>a<|im_end|>").unwrap(),
        [257, 97, 258]
    );
    let near = tok.encode("<|im_start a").unwrap();
    assert!(!near.contains(&257) && near.len() == "<|im_start a".len());
    assert!(tok.is_special(258) && !tok.is_special(97));
}

/// Some byte-level vocabularies have no token for a control byte (SmolLM2
/// has none for 0x04): text holding it is refused, not encoded without it.
#[test]
fn text_with_a_byte_the_vocabulary_cannot_write_is_refused_not_shortened() {
    let mut m = byte_level(&[]);
    m.tokens[7] = "not a byte".into();
    let tok = Tokenizer::from_metadata(&m).unwrap();
    assert_eq!(tok.encode("ab").unwrap(), [97, 98]);
    let err = tok.encode("a\u{7}b").unwrap_err();
    assert!(
        matches!(err, TextError::Encode { .. }) && err.to_string().contains("0x07"),
        "{err}"
    );
    assert_eq!(err.http_status(), 400);
}

#[test]
fn bos_is_added_only_where_the_metadata_says_so() {
    let mut meta = byte_level(&[]);
    meta.add_bos = Some(true);
    let with = Tokenizer::from_metadata(&meta).unwrap();
    assert_eq!(with.encode("a").unwrap(), [257, 97]);
    assert_eq!(
        with.encode_plain("a").unwrap(),
        [97],
        "rendered chats get none"
    );
    meta.add_bos = Some(false);
    assert_eq!(
        Tokenizer::from_metadata(&meta)
            .unwrap()
            .encode("a")
            .unwrap(),
        [97]
    );
    // A GPT-2 style vocabulary with no add_bos_token key adds none; a
    // SentencePiece one adds BOS, as SentencePiece Llama models do.
    meta.add_bos = None;
    assert_eq!(
        Tokenizer::from_metadata(&meta)
            .unwrap()
            .encode("a")
            .unwrap(),
        [97]
    );
    let spm = Tokenizer::from_metadata(&sentencepiece(&[("a", -1.0)])).unwrap();
    assert_eq!(spm.encode("a").unwrap()[0], 1);
}

#[test]
fn byte_level_merges_apply_in_their_order_and_digits_split_singly() {
    // smollm's split puts every digit alone, so "12" never merges.
    let tok =
        Tokenizer::from_metadata(&byte_level(&[("1", "2"), ("h", "i"), (" ", "hi")])).unwrap();
    let ids = tok.encode("hi 12 hi").unwrap();
    let hi = tok.token_to_id(&byte_text("hi")).unwrap();
    let space_hi = tok.token_to_id(&byte_text(" hi")).unwrap();
    assert_eq!(ids, [hi, 32, 49, 50, space_hi]);
    let mut qwen = byte_level(&[("1", "2")]);
    qwen.pre = Some("llama3".into());
    let t3 = Tokenizer::from_metadata(&qwen).unwrap();
    assert_eq!(
        t3.encode("12").unwrap(),
        [tok.token_to_id(&byte_text("12")).unwrap()]
    );
}

#[test]
fn sentencepiece_merges_follow_scores_and_unknown_characters_fall_back_to_bytes() {
    let tok = Tokenizer::from_metadata(&sentencepiece(&[
        ("\u{2581}", -1.0),
        ("a", -2.0),
        ("b", -3.0),
        ("\u{2581}a", -4.0),
        ("ab", -5.0),
        ("\u{2581}ab", -6.0),
    ]))
    .unwrap();
    let piece = |p: &str| tok.token_to_id(p).unwrap();
    assert_eq!(tok.encode("ab").unwrap(), [1, piece("\u{2581}ab")]);
    // "é" is not a piece: its two UTF-8 bytes.
    assert_eq!(
        tok.encode("é").unwrap(),
        [1, piece("\u{2581}"), 3 + 0xC3, 3 + 0xA9]
    );
    assert_eq!(
        tok.decode(&tok.encode("ab é").unwrap(), true).unwrap(),
        "ab é"
    );
}

/// Each broken field gives the typed refusal naming it, before anything is
/// served with a tokenizer that would split text differently from training.
#[test]
fn vocabularies_that_cannot_be_reproduced_exactly_are_refused_with_the_key() {
    let refuse = |meta: TokenizerMetadata| -> TextError {
        let err = Tokenizer::from_metadata(&meta).unwrap_err();
        assert_eq!(err.http_status(), 500, "{err}");
        err
    };
    let mut m = byte_level(&[]);
    m.model = "rwkv".into();
    assert!(matches!(refuse(m), TextError::UnsupportedTokenizerModel { model } if model == "rwkv"));

    let mut m = byte_level(&[]);
    m.pre = Some("jais".into());
    let err = refuse(m);
    assert!(matches!(&err, TextError::UnsupportedPreTokenizer { pre, .. } if pre == "jais"));
    assert!(
        err.to_string().contains("smollm"),
        "lists what is supported: {err}"
    );

    let mut m = byte_level(&[]);
    m.tokens[5] = m.tokens[4].clone();
    assert!(matches!(
        refuse(m),
        TextError::DuplicateToken {
            first: 4,
            second: 5,
            ..
        }
    ));

    let mut m = byte_level(&[]);
    m.merges.push("zz qq".into());
    assert!(
        matches!(refuse(m), TextError::BadMetadata { key, .. } if key == "tokenizer.ggml.merges")
    );

    let mut m = byte_level(&[]);
    m.merges.push("a".into());
    assert!(
        matches!(refuse(m), TextError::BadMetadata { key, .. } if key == "tokenizer.ggml.merges")
    );

    let mut m = byte_level(&[]);
    m.eos_id = Some(1 << 40);
    assert!(matches!(refuse(m), TextError::BadMetadata { key, .. } if key.contains("eos")));

    let mut m = byte_level(&[]);
    m.token_types.as_mut().unwrap().pop();
    assert!(matches!(refuse(m), TextError::BadMetadata { key, .. } if key.contains("token_type")));

    let mut m = byte_level(&[]);
    m.token_types.as_mut().unwrap()[0] = 99;
    assert!(matches!(refuse(m), TextError::BadMetadata { key, .. } if key.contains("token_type")));

    let mut m = byte_level(&[]);
    m.add_bos = Some(true);
    m.bos_id = None;
    assert!(matches!(refuse(m), TextError::MissingMetadata { .. }));

    let mut m = sentencepiece(&[("a", -1.0)]);
    m.scores = None;
    assert!(matches!(refuse(m), TextError::MissingMetadata { key } if key.contains("scores")));

    let mut m = sentencepiece(&[("a", -1.0)]);
    m.scores.as_mut().unwrap()[4] = f32::NAN;
    assert!(matches!(refuse(m), TextError::BadMetadata { key, .. } if key.contains("scores")));

    assert!(matches!(
        refuse(TokenizerMetadata::default()),
        TextError::MissingMetadata { .. }
    ));
}

#[test]
fn a_folder_without_a_tokenizer_is_a_typed_error() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_tiny_llama");
    let err = TextModel::load(&dir).unwrap_err();
    assert!(matches!(err, TextError::NoTokenizer { .. }), "{err}");
    let err = TextModel::load(Path::new("/nonexistent/handoff/model.gguf")).unwrap_err();
    assert!(!err.to_string().is_empty());
}
