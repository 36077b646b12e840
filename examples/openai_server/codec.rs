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

use crate::errors::ApiError;

/// One chat message, as rendered by a template.
#[derive(Clone, Debug)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

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
    /// A chat rendered with the generation prompt, as ids.
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError>;
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
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
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
        Box::new(Utf8Stream::default())
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

/// Bytes to UTF-8 text as they stream: complete characters go out, an
/// incomplete trailing sequence waits for its next byte, and an invalid
/// byte becomes U+FFFD (as `String::from_utf8_lossy` does).
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    fn drain(&mut self, at_end: bool) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // The prefix up to `good` is valid UTF-8 by the error's word.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..good]));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                        None if at_end => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.clear();
                            return out;
                        }
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                    }
                }
            }
        }
    }
}

impl StreamText for Utf8Stream {
    fn push(&mut self, id: u32) -> String {
        match u8::try_from(id) {
            Ok(b) => {
                self.pending.push(b);
                self.drain(false)
            }
            Err(_) => {
                let mut s = self.drain(true);
                s.push_str(&format!("<|{id}|>"));
                s
            }
        }
    }
    fn finish(&mut self) -> String {
        self.drain(true)
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
    fn render_chat(&self, _messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
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

/// User stop strings over streamed text: holds back a tail that may be the
/// start of a stop string, and never emits the stop string itself.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What [`StopMatcher::push`] lets out.
#[derive(Debug, PartialEq, Eq)]
pub enum Released {
    /// Text safe to send; generation goes on.
    Text(String),
    /// A stop string matched: the text before it, and generation ends.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops,
            pending: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> Released {
        self.pending.push_str(text);
        if self.stops.is_empty() {
            return Released::Text(std::mem::take(&mut self.pending));
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let before = self.pending[..at].to_string();
            self.pending.clear();
            return Released::Stopped(before);
        }
        // Hold back the longest tail that starts some stop string.
        let hold = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len());
        let out = self.pending[..hold].to_string();
        self.pending.drain(..hold);
        Released::Text(out)
    }

    /// The held-back tail, once generation has ended without a match.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// The model's own tokenizer and chat template (`handoff::text`): a GGUF
/// file's vocabulary and template, or a Hugging Face folder's
/// `tokenizer.json` and `tokenizer_config.json`. The text model lives as
/// long as the process (the server loads it once), so each stream's decoder
/// can borrow it.
pub struct ModelCodec {
    text: &'static handoff::text::TextModel,
}

impl ModelCodec {
    /// The codec of the model at `path`, or `None` (with the reason) when it
    /// carries no tokenizer.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text = handoff::text::TextModel::load(path).map_err(|e| e.to_string())?;
        Ok(ModelCodec {
            text: Box::leak(Box::new(text)),
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
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
        let messages: Vec<handoff::text::Message> = messages
            .iter()
            .map(|m| handoff::text::Message::new(m.role.clone(), m.content.clone()))
            .collect();
        self.text
            .render_chat(&messages)
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
