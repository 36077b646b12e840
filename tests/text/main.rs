//! Text in and out: tokenizers (tokenizer.json and GGUF vocabularies) against independent implementations, chat templates against jinja2, streaming detokenization, stop strings, and the text examples.
//!
//! One story per module; the shared rigs are in `tests/support/`.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod text_chat_template;
mod text_example_chat;
mod text_example_tokenize;
mod text_hostile_templates;
mod text_role_forging;
mod text_split_forging;
mod text_stop_strings;
mod text_streaming;
mod text_tokenizer;
mod text_utf8_bytes;
