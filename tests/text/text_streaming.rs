//! Story: a chat client prints the answer as it is generated. Byte-level BPE
//! and SentencePiece byte fallback both split one character over several
//! tokens (an emoji is four bytes, a CJK character three); the stream must
//! hold such a character back until its last byte arrives and never print
//! half of it, and what it prints, joined, must be exactly the text a full
//! decode gives.

use crate::support::text_support;

use handoff::HttpStatus;
use handoff::text::{StreamDecoder, TextError, Tokenizer};
use text_support::{byte_level, sentencepiece, smollm2};

/// Streams `ids` one at a time; returns what each push emitted.
fn stream(tok: &Tokenizer, ids: &[u32]) -> (Vec<Option<String>>, String) {
    let mut dec = StreamDecoder::new(tok, true);
    let steps: Vec<Option<String>> = ids.iter().map(|&id| dec.push(id).unwrap()).collect();
    let tail = dec.finish().unwrap();
    (steps, tail)
}

fn joined(steps: &[Option<String>], tail: &str) -> String {
    steps.iter().flatten().cloned().collect::<String>() + tail
}

#[test]
fn an_emoji_split_over_four_byte_tokens_is_emitted_whole_on_its_last_byte() {
    let tok = Tokenizer::from_metadata(&byte_level(&[])).unwrap();
    let ids = tok.encode("a🙂b").unwrap();
    assert_eq!(ids.len(), 6, "one token per byte: {ids:?}");
    let (steps, tail) = stream(&tok, &ids);
    assert_eq!(
        steps,
        [
            Some("a".to_string()),
            None,
            None,
            None,
            Some("🙂".to_string()),
            Some("b".to_string())
        ]
    );
    assert_eq!(tail, "");
}

#[test]
fn mixed_scripts_streamed_byte_by_byte_join_to_the_text_with_no_replacement_char() {
    let tok = Tokenizer::from_metadata(&byte_level(&[("h", "e"), ("he", "l")])).unwrap();
    let text = "hello 日本語, Ελληνικά, مرحبا, 👍🏽 and 🇫🇷 — done.";
    let ids = tok.encode(text).unwrap();
    assert!(
        ids.len() > text.chars().count(),
        "multi-byte characters span tokens"
    );
    let (steps, tail) = stream(&tok, &ids);
    for chunk in steps.iter().flatten() {
        assert!(!chunk.contains('\u{FFFD}'), "{chunk:?}");
    }
    assert_eq!(joined(&steps, &tail), text);
    assert_eq!(joined(&steps, &tail), tok.decode(&ids, true).unwrap());
}

#[test]
fn sentencepiece_byte_fallback_streams_cjk_whole_and_keeps_word_spaces() {
    let tok = Tokenizer::from_metadata(&sentencepiece(&[
        ("\u{2581}", -1.0),
        ("a", -2.0),
        ("b", -3.0),
        ("\u{2581}a", -4.0),
        ("ab", -5.0),
        ("\u{2581}ab", -6.0),
    ]))
    .unwrap();
    let text = "ab 日本 ab";
    let ids = tok.encode(text).unwrap();
    assert_eq!(
        ids[0], 1,
        "BOS first: SentencePiece Llama adds it by default"
    );
    // 日 and 本 are not pieces: each falls back to its three UTF-8 bytes.
    assert_eq!(ids.iter().filter(|&&id| (3..259).contains(&id)).count(), 6);
    let (steps, tail) = stream(&tok, &ids[1..]);
    assert!(steps.iter().flatten().all(|c| !c.contains('\u{FFFD}')));
    assert_eq!(joined(&steps, &tail), text);
    assert!(
        steps.iter().flatten().any(|c| c == "本"),
        "a CJK character comes out whole: {steps:?}"
    );
}

#[test]
fn a_stream_after_a_prompt_keeps_the_first_words_leading_space() {
    let tok = Tokenizer::from_metadata(&sentencepiece(&[
        ("\u{2581}", -1.0),
        ("a", -2.0),
        ("b", -3.0),
        ("\u{2581}a", -4.0),
        ("ab", -5.0),
        ("\u{2581}ab", -6.0),
    ]))
    .unwrap();
    let prompt = tok.encode("ab").unwrap();
    let answer = tok.encode_plain(" ab ab").unwrap();
    let mut dec = StreamDecoder::after(&tok, &prompt, true);
    let mut out = String::new();
    for &id in &answer {
        out.extend(dec.push(id).unwrap());
    }
    out.push_str(&dec.finish().unwrap());
    // The decode of prompt + answer, minus the prompt's text.
    let mut all = prompt.clone();
    all.extend(&answer);
    let full = tok.decode(&all, true).unwrap();
    let head = tok.decode(&prompt, true).unwrap();
    assert_eq!(out, full[head.len()..]);
    assert!(out.starts_with(' '), "{out:?}");
}

#[test]
fn a_stream_that_ends_inside_a_character_shows_it_as_a_full_decode_does() {
    let tok = Tokenizer::from_metadata(&byte_level(&[])).unwrap();
    let ids = tok.encode("ok🙂").unwrap();
    let cut = &ids[..ids.len() - 1]; // the emoji's last byte never comes
    let (steps, tail) = stream(&tok, cut);
    assert_eq!(joined(&steps[..2], ""), "ok");
    assert!(
        steps[2..].iter().all(Option::is_none),
        "nothing partial: {steps:?}"
    );
    assert_eq!(tail, tok.decode(&cut[2..], true).unwrap());
    assert!(tail.contains('\u{FFFD}'));
}

#[test]
fn an_id_outside_the_vocabulary_is_a_typed_error_and_the_stream_goes_on() {
    let tok = Tokenizer::from_metadata(&byte_level(&[])).unwrap();
    let mut dec = StreamDecoder::new(&tok, true);
    assert_eq!(dec.push(u32::from(b'h')).unwrap().as_deref(), Some("h"));
    let err = dec.push(1_000_000).unwrap_err();
    assert!(
        matches!(err, TextError::UnknownTokenId { id: 1_000_000, .. }),
        "{err}"
    );
    assert_eq!(err.http_status(), 400);
    assert_eq!(dec.push(u32::from(b'i')).unwrap().as_deref(), Some("i"));
    assert_eq!(dec.finish().unwrap(), "");
    // The whole-sequence decode refuses it too, rather than dropping it.
    assert!(matches!(
        tok.decode(&[104, 1_000_000], true),
        Err(TextError::UnknownTokenId { .. })
    ));
}

#[test]
fn special_tokens_are_left_out_of_display_text_but_kept_on_request() {
    let tok = Tokenizer::from_metadata(&byte_level(&[])).unwrap();
    let ids = tok.encode("hi<|im_end|>").unwrap();
    assert_eq!(ids, [104, 105, 258]);
    let (steps, tail) = stream(&tok, &ids);
    assert_eq!(joined(&steps, &tail), "hi");
    let mut raw = StreamDecoder::new(&tok, false);
    let shown: String = ids.iter().filter_map(|&id| raw.push(id).unwrap()).collect();
    assert_eq!(shown, "hi<|im_end|>");
}

#[test]
fn smollm2_streams_multilingual_text_back_exactly() {
    let Some(model) = smollm2() else { return };
    let tok = model.tokenizer();
    for text in [
        "emoji: 🙂👍🏽🇫🇷 and 🧑‍💻 coding",
        "日本語のテキストと中文文本, 한국어",
        "Привет, мир! Ελληνικά. مرحبا بالعالم",
        "  spaces,\ttabs\nand newlines\n\n",
    ] {
        let ids = tok.encode(text).unwrap();
        let (steps, tail) = stream(tok, &ids);
        assert!(
            steps.iter().flatten().all(|c| !c.contains('\u{FFFD}')),
            "{text:?}"
        );
        assert_eq!(joined(&steps, &tail), text);
    }
}
