//! Story: a user asks generation to stop at "\n\nUser:" or "###". The model
//! writes text token by token and a stop string can straddle several tokens
//! (even several bytes of one character); the client must never see any part
//! of the stop string, must see every character before it, and nothing after
//! it. Text that only looked like the start of a stop string is released as
//! soon as the next chunk shows it is not one.

use crate::support::text_support;

use handoff::HttpStatus;
use handoff::text::{StopMatcher, StreamDecoder, TextError, Tokenizer};
use text_support::byte_level;

/// Feeds `chunks` through a matcher for `stops`; returns every emitted
/// text, the stop that matched, and the text released at the end.
fn run(stops: &[&str], chunks: &[&str]) -> (Vec<String>, Option<usize>, String) {
    let mut m = StopMatcher::new(stops.iter().copied()).unwrap();
    let mut out = Vec::new();
    let mut stopped = None;
    for c in chunks {
        let step = m.push(c);
        out.push(step.text);
        stopped = stopped.or(step.stopped);
    }
    (out, stopped, m.finish())
}

#[test]
fn a_stop_string_split_over_three_chunks_is_never_emitted() {
    let (out, stopped, rest) = run(
        &["\n\nUser:"],
        &["Sure, here.", "\n", "\nUs", "er: next", "more"],
    );
    assert_eq!(out, ["Sure, here.", "", "", "", ""]);
    assert_eq!(stopped, Some(0));
    assert_eq!(rest, "", "nothing after the stop is released");
}

#[test]
fn a_false_start_is_released_once_the_next_chunk_rules_it_out() {
    let (out, stopped, rest) = run(&["###"], &["a #", "# b", " c"]);
    assert_eq!(out, ["a ", "## b", " c"]);
    assert_eq!(stopped, None);
    assert_eq!(rest, "");
}

#[test]
fn the_held_tail_is_released_when_the_stream_ends_without_a_stop() {
    let (out, stopped, rest) = run(&["###"], &["a #", "#"]);
    assert_eq!(out, ["a ", ""]);
    assert_eq!(stopped, None);
    assert_eq!(rest, "##");
}

#[test]
fn the_earliest_of_several_stop_strings_wins_and_text_before_it_is_kept() {
    let (out, stopped, _) = run(&["END", "STOP"], &["one STOP two END"]);
    assert_eq!(out, ["one "]);
    assert_eq!(stopped, Some(1));
}

#[test]
fn after_a_stop_every_later_chunk_is_swallowed() {
    let mut m = StopMatcher::new(["x"]).unwrap();
    assert_eq!(m.push("ax").stopped, Some(0));
    let later = m.push("bbb");
    assert_eq!((later.text.as_str(), later.stopped), ("", None));
    assert_eq!(m.stopped(), Some(0));
    assert_eq!(m.finish(), "");
}

#[test]
fn a_stop_string_across_byte_level_tokens_inside_one_character() {
    // "→" is three bytes, three tokens here; the stop string is "→ done".
    let tok = Tokenizer::from_metadata(&byte_level(&[])).unwrap();
    let ids = tok.encode("step 1 → done → more").unwrap();
    let mut dec = StreamDecoder::new(&tok, true);
    let mut stop = StopMatcher::new(["→ done"]).unwrap();
    let mut shown = String::new();
    let mut consumed = 0;
    for &id in &ids {
        consumed += 1;
        if let Some(chunk) = dec.push(id).unwrap() {
            let step = stop.push(&chunk);
            shown.push_str(&step.text);
            if step.stopped.is_some() {
                break;
            }
        }
    }
    assert_eq!(shown, "step 1 ");
    assert_eq!(stop.stopped(), Some(0));
    assert!(
        consumed < ids.len(),
        "generation ends at the stop, not at the end"
    );
}

#[test]
fn an_empty_stop_string_is_refused_with_a_client_error() {
    let err = StopMatcher::new(["ok", ""]).unwrap_err();
    assert!(matches!(err, TextError::EmptyStopString));
    assert_eq!(err.http_status(), 400);
}
