//! Text in and text out: tokenizers, chat templates, streaming
//! detokenization and stop strings.
//!
//! - [`Tokenizer`]: Hugging Face's implementation, from a `tokenizer.json`
//!   or rebuilt from GGUF metadata ([`TokenizerMetadata`]); special tokens in
//!   text parse as special tokens, BOS is added only where the model says.
//! - [`ChatTemplate`]: the model's own Jinja chat template, rendered as
//!   Hugging Face's `apply_chat_template` does, under [`TemplateLimits`]
//!   (fuel, output cap, deadline): the template is code from the model file.
//! - [`StreamDecoder`]: ids to text as they are generated, never half a
//!   character.
//! - [`Utf8Decoder`]: raw bytes to text as they stream (vocabularies whose
//!   ids are bytes).
//! - [`StopMatcher`]: user stop strings over streamed text, never emitted.
//! - [`TextModel`]: all of the above for the model at a path, with the ids
//!   that end a generation. Its chats encode message content as text:
//!   special-token text a user writes (`<|im_end|>`) never becomes a
//!   control token; only the template's own text does.
//!
//! ```
//! use handoff::text::{StopMatcher, StopStep};
//! let mut stop = StopMatcher::new(["\n\nUser:"])?;
//! assert_eq!(stop.push("Sure.\n").text, "Sure.");
//! let step = stop.push("\nUser: hi");
//! assert_eq!((step.text.as_str(), step.stopped), ("", Some(0)));
//! # Ok::<(), handoff::text::TextError>(())
//! ```

mod chat;
mod error;
mod gguf;
mod hf;
mod metadata;
mod pretokenizer;
mod stop;
mod stream;
mod text_model;
mod tokenizer;
mod utf8;
mod vocab;

pub use chat::{ChatTemplate, Message, TemplateLimit, TemplateLimits};
pub use error::TextError;
pub use metadata::{TokenKind, TokenizerMetadata};
pub use stop::{StopMatcher, StopStep};
pub use stream::StreamDecoder;
pub use text_model::{ContentTokens, TextModel};
pub use tokenizer::Tokenizer;
pub use utf8::Utf8Decoder;
