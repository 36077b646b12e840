//! Text in and text out: tokenizers, chat templates, streaming
//! detokenization and stop strings.
//!
//! - [`Tokenizer`]: Hugging Face's implementation, from a `tokenizer.json`
//!   or rebuilt from GGUF metadata ([`TokenizerMetadata`]); special tokens in
//!   text parse as special tokens, BOS is added only where the model says.
//! - [`ChatTemplate`]: the model's own Jinja chat template, rendered as
//!   Hugging Face's `apply_chat_template` does.
//! - [`StreamDecoder`]: ids to text as they are generated, never half a
//!   character.
//! - [`StopMatcher`]: user stop strings over streamed text, never emitted.
//! - [`TextModel`]: all of the above for the model at a path, with the ids
//!   that end a generation.
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
mod vocab;

pub use chat::{ChatTemplate, Message};
pub use error::TextError;
pub use metadata::{TokenKind, TokenizerMetadata};
pub use stop::{StopMatcher, StopStep};
pub use stream::StreamDecoder;
pub use text_model::TextModel;
pub use tokenizer::Tokenizer;
