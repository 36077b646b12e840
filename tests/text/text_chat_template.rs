//! Story: a client sends a conversation, and the server must turn it into
//! exactly the prompt text the model was trained on, using the model's own
//! chat template as Hugging Face's `apply_chat_template` renders it. The
//! expected renderings were made by Python's jinja2 with Hugging Face's
//! settings (tests/fixtures/text/chat_templates.json, from
//! scripts/make_text_fixtures.py): SmolLM2's ChatML template from its GGUF,
//! a Mistral-style template that refuses non-alternating roles with
//! `raise_exception`, a Llama 3-style one, and one using block trimming and
//! Python string methods. A refusal is a typed client error (400) carrying
//! the template's message; a template that does not compile is a typed
//! server error; a model without a template says so.

use crate::support::text_support;

use handoff::HttpStatus;
use handoff::text::{ChatTemplate, Message, TextError, TextModel, Tokenizer};
use serde_json::Value;
use text_support::byte_level;

fn fixture() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/text/chat_templates.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn messages(v: &Value) -> Vec<Message> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

#[test]
fn smollm2s_chatml_template_renders_as_jinja2_does_with_the_generation_prompt() {
    let f = fixture();
    let s = &f["smollm2"];
    let t = ChatTemplate::new(
        s["chat_template"].as_str().unwrap(),
        s["bos_token"].as_str(),
        s["eos_token"].as_str(),
    )
    .unwrap();
    let chats = s["chats"].as_array().unwrap();
    assert!(chats.len() >= 3);
    for chat in chats {
        let rendered = t.render(&messages(&chat["messages"]), true).unwrap();
        assert_eq!(rendered, chat["rendered"].as_str().unwrap());
        assert!(rendered.ends_with("<|im_start|>assistant\n"));
    }
    // Without the generation prompt the text ends with the last turn.
    let one = [Message::new("user", "Hi")];
    assert!(t.render(&one, false).unwrap().ends_with("Hi<|im_end|>\n"));
}

#[test]
fn other_families_render_or_refuse_exactly_as_jinja2_does() {
    let f = fixture();
    let mut refusals = 0;
    for family in f["templates"].as_array().unwrap() {
        let name = family["name"].as_str().unwrap();
        let t = ChatTemplate::new(
            family["source"].as_str().unwrap(),
            family["bos_token"].as_str(),
            family["eos_token"].as_str(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        for case in family["cases"].as_array().unwrap() {
            let got = t.render(
                &messages(&case["messages"]),
                case["add_generation_prompt"].as_bool().unwrap(),
            );
            match (case.get("rendered"), got) {
                (Some(want), Ok(text)) => assert_eq!(text, want.as_str().unwrap(), "{name}"),
                (None, Err(TextError::TemplateRefused { message })) => {
                    assert_eq!(message, case["refused"].as_str().unwrap(), "{name}");
                    refusals += 1;
                }
                (want, got) => panic!("{name}: expected {want:?}, got {got:?}"),
            }
        }
    }
    assert!(refusals >= 2, "the fixture exercises refusals");
}

#[test]
fn a_refusal_is_a_client_error_and_a_broken_template_a_server_error() {
    let t = ChatTemplate::new("{{ raise_exception('no system role') }}", None, None).unwrap();
    let err = t.render(&[Message::new("system", "x")], true).unwrap_err();
    assert!(matches!(&err, TextError::TemplateRefused { message } if message == "no system role"));
    assert_eq!(err.http_status(), 400);

    let err = ChatTemplate::new("{% for m in messages %}{{ m", None, None).unwrap_err();
    assert!(matches!(err, TextError::TemplateSyntax { .. }), "{err}");
    assert_eq!(err.http_status(), 500);

    // A template error while rendering (not a refusal) is the server's.
    let t = ChatTemplate::new("{{ messages[0]['content'] + 1 }}", None, None).unwrap();
    let err = t.render(&[Message::new("user", "x")], true).unwrap_err();
    assert!(matches!(err, TextError::TemplateRender { .. }), "{err}");
    assert_eq!(err.http_status(), 500);
}

#[test]
fn the_end_of_turn_token_is_read_from_the_template_and_stops_generation() {
    let mut meta = byte_level(&[]);
    meta.chat_template = Some(
        fixture()["smollm2"]["chat_template"]
            .as_str()
            .unwrap()
            .to_string(),
    );
    // EOS here is <|endoftext|> (256); ChatML ends a turn with <|im_end|> (258).
    let model = TextModel::from_metadata(&meta).unwrap();
    let tok: &Tokenizer = model.tokenizer();
    let chat = model.chat_template().unwrap();
    assert_eq!(chat.end_of_turn(tok), Some(258));
    assert_eq!(model.stop_ids(), [256, 258]);

    let (text, ids) = model.render_chat(&[Message::new("user", "hi")]).unwrap();
    assert!(text.starts_with("<|im_start|>system\n"));
    assert_eq!(
        ids[0], 257,
        "<|im_start|> is one special token, not its characters"
    );
    assert_eq!(ids.iter().filter(|&&id| id == 258).count(), 2);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn a_model_without_a_chat_template_refuses_a_conversation_with_a_reason() {
    let model = TextModel::from_metadata(&byte_level(&[])).unwrap();
    let err = model
        .render_chat(&[Message::new("user", "hi")])
        .unwrap_err();
    assert!(matches!(err, TextError::NoChatTemplate { .. }), "{err}");
    assert_eq!(err.http_status(), 400);
    assert_eq!(model.stop_ids(), [256], "EOS alone ends generation");
}

#[test]
fn templates_see_bos_and_eos_and_can_stamp_the_date() {
    let t = ChatTemplate::new(
        "{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}",
        Some("<s>"),
        Some("</s>"),
    )
    .unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "<s>|</s>|4");
}
