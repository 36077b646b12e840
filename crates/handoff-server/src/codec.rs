//! Text in, token ids out, and back: the one seam between HTTP and the
//! model's vocabulary.
//!
//! [`TextCodec`] is what the routes need from a tokenizer: encode a prompt,
//! render a chat, decode a stream of ids into text without splitting a
//! character, and the ids that end a turn. Two implementations live here:
//!
//! - [`ByteCodec`], for the embedded random-weights model only: ids 0..=255
//!   are the bytes of UTF-8 text, any higher id prints as `<|id|>`, and
//!   chats are rendered with a fixed plain template. It is honest about what
//!   it is: the model's weights are random, so what it generates is noise;
//!   the codec only makes that noise addressable as text.
//! - [`IdsOnly`], for a model file served without a tokenizer (a llama2.c
//!   `.bin`, or a folder without `tokenizer.json` support): text prompts and
//!   chats are refused with a 400 that says to send token ids, and every
//!   answer carries the generated `token_ids` with empty text.
//! - [`ModelCodec`], the model's own tokenizer and chat template
//!   ([`handoff::text::TextModel`]).
//!
//! Chat messages, UTF-8 streaming and stop strings are the library's
//! (`handoff::text`): this module only adapts them to the routes.

use handoff::text::{ContentTokens, Message, TemplateLimits, TextModel, Utf8Decoder};

use crate::errors::ApiError;

/// Turns streamed token ids into text, never emitting half a character.
pub trait StreamText: Send {
    /// The text that `id` completes (possibly empty).
    fn push(&mut self, id: u32) -> String;
    /// What is still held back, at the end of the stream.
    fn finish(&mut self) -> String;
}

/// What the server needs from a tokenizer and chat template.
pub trait TextCodec: Send + Sync + 'static {
    /// One line for the startup banner.
    fn describe(&self) -> String;
    /// Whether answers carry text (false: ids only).
    fn has_text(&self) -> bool;
    /// A prompt's ids.
    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError>;
    /// A chat rendered with the generation prompt, as ids. May block for
    /// the template's deadline: call it off the async workers.
    fn render_chat(&self, messages: &[Message]) -> Result<Vec<u32>, ApiError>;
    /// A fresh streaming decoder.
    fn decoder(&self) -> Box<dyn StreamText>;
    /// Ids that end generation (EOS, end of turn); never shown as text.
    fn stop_ids(&self) -> Vec<u32>;
    /// One token's own bytes, as log-probabilities name it.
    fn token_bytes(&self, id: u32) -> Vec<u8>;
}

/// Bytes as ids, for the random-weights model. See the module docs.
#[derive(Debug)]
pub struct ByteCodec {
    vocab: usize,
}

impl ByteCodec {
    /// `None` when the vocabulary cannot hold the 256 byte ids.
    pub fn new(vocab: usize) -> Option<Self> {
        (vocab >= 256).then_some(ByteCodec { vocab })
    }
}

impl TextCodec for ByteCodec {
    fn describe(&self) -> String {
        format!(
            "byte-level codec (ids 0-255 are UTF-8 bytes, ids 256-{} print as <|id|>); \
             random weights: the text is noise",
            self.vocab - 1
        )
    }
    fn has_text(&self) -> bool {
        true
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn render_chat(&self, messages: &[Message]) -> Result<Vec<u32>, ApiError> {
        let mut s = String::new();
        for m in messages {
            s.push_str("<|");
            s.push_str(&m.role);
            s.push_str("|>\n");
            s.push_str(&m.content);
            s.push('\n');
        }
        s.push_str("<|assistant|>\n");
        self.encode(&s)
    }
    fn decoder(&self) -> Box<dyn StreamText> {
        Box::new(ByteStream::default())
    }
    fn stop_ids(&self) -> Vec<u32> {
        Vec::new()
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        match u8::try_from(id) {
            Ok(b) => vec![b],
            Err(_) => format!("<|{id}|>").into_bytes(),
        }
    }
}

/// Byte ids to text as they stream (the library's [`Utf8Decoder`]); an id
/// past the bytes ends any pending character and prints as `<|id|>`.
#[derive(Debug, Default)]
struct ByteStream {
    bytes: Utf8Decoder,
}

impl StreamText for ByteStream {
    fn push(&mut self, id: u32) -> String {
        match u8::try_from(id) {
            Ok(b) => self.bytes.push(b),
            Err(_) => {
                let mut s = self.bytes.finish();
                s.push_str(&format!("<|{id}|>"));
                s
            }
        }
    }
    fn finish(&mut self) -> String {
        self.bytes.finish()
    }
}

/// No tokenizer: ids in, ids out. See the module docs.
#[derive(Debug)]
pub struct IdsOnly;

impl TextCodec for IdsOnly {
    fn describe(&self) -> String {
        "no tokenizer: prompts must be token ids ({\"prompt\": [1, 2, 3]} on /v1/completions), \
         answers carry token_ids and empty text"
            .into()
    }
    fn has_text(&self) -> bool {
        false
    }
    fn encode(&self, _text: &str) -> Result<Vec<u32>, ApiError> {
        Err(ApiError::bad_param(
            "prompt",
            "this model is served without a tokenizer: send the prompt as an array of token ids",
        ))
    }
    fn render_chat(&self, _messages: &[Message]) -> Result<Vec<u32>, ApiError> {
        Err(ApiError::bad_param(
            "messages",
            "this model is served without a tokenizer or chat template: use /v1/completions \
             with the prompt as an array of token ids",
        ))
    }
    fn decoder(&self) -> Box<dyn StreamText> {
        Box::new(NoText)
    }
    fn stop_ids(&self) -> Vec<u32> {
        Vec::new()
    }
    /// No text: the id itself, as vLLM names tokens without a tokenizer.
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        format!("token_id:{id}").into_bytes()
    }
}

struct NoText;

impl StreamText for NoText {
    fn push(&mut self, _id: u32) -> String {
        String::new()
    }
    fn finish(&mut self) -> String {
        String::new()
    }
}

/// The model's own tokenizer and chat template (`handoff::text`): a GGUF
/// file's vocabulary and template, or a Hugging Face folder's
/// `tokenizer.json` and `tokenizer_config.json`. The text model lives as
/// long as the process (the server loads it once), so each stream's decoder
/// can borrow it.
pub struct ModelCodec {
    text: &'static TextModel,
    /// How message content encodes (as text unless the deployment allows
    /// control tokens in messages).
    content: ContentTokens,
}

/// Why a model is served without its text side.
pub enum Untextual {
    /// The model ships no tokenizer the library reads: serve token ids only.
    IdsOnly(String),
    /// The model's chat template exceeds its limits on the probe
    /// conversations: refuse to serve the model at all.
    Refused(handoff::text::TextError),
}

impl ModelCodec {
    /// The codec of the model at `path`, its chat template bounded by
    /// `limits`.
    pub fn load(
        path: &std::path::Path,
        limits: TemplateLimits,
        content: ContentTokens,
    ) -> Result<Self, Untextual> {
        use handoff::text::TextError;
        let text = TextModel::load_with_limits(path, limits).map_err(|e| match e {
            TextError::TemplateLimit { .. } => Untextual::Refused(e),
            e => Untextual::IdsOnly(e.to_string()),
        })?;
        Ok(ModelCodec {
            text: Box::leak(Box::new(text)),
            content,
        })
    }
}

fn text_error(e: handoff::text::TextError) -> ApiError {
    use handoff::HttpStatus;
    ApiError::new(e.http_status(), e.to_string())
}

impl TextCodec for ModelCodec {
    fn describe(&self) -> String {
        format!(
            "the model's tokenizer ({} tokens) and chat template",
            self.text.tokenizer().vocab_size()
        )
    }
    fn has_text(&self) -> bool {
        true
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.text.tokenizer().encode(text).map_err(text_error)
    }
    fn render_chat(&self, messages: &[Message]) -> Result<Vec<u32>, ApiError> {
        self.text
            .render_chat_with(messages, self.content)
            .map(|(_, ids)| ids)
            .map_err(text_error)
    }
    fn decoder(&self) -> Box<dyn StreamText> {
        Box::new(ModelStream {
            inner: Some(handoff::text::StreamDecoder::new(
                self.text.tokenizer(),
                true,
            )),
        })
    }
    fn stop_ids(&self) -> Vec<u32> {
        self.text.stop_ids().to_vec()
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.text
            .tokenizer()
            .decode(&[id], false)
            .map(String::into_bytes)
            .unwrap_or_default()
    }
}

/// Whole characters of the model's text as ids stream in.
struct ModelStream {
    inner: Option<handoff::text::StreamDecoder<'static>>,
}

impl StreamText for ModelStream {
    fn push(&mut self, id: u32) -> String {
        match self.inner.as_mut().map(|d| d.push(id)) {
            Some(Ok(Some(text))) => text,
            _ => String::new(),
        }
    }
    fn finish(&mut self) -> String {
        self.inner
            .take()
            .and_then(|d| d.finish().ok())
            .unwrap_or_default()
    }
}
