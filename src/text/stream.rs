//! [`StreamDecoder`]: token ids to text one id at a time, for streaming.

use super::{TextError, Tokenizer};

/// Turns generated ids into text as they arrive, emitting only whole
/// characters: a character whose UTF-8 bytes are split over several tokens
/// (byte-level BPE, SentencePiece byte fallback) is held back until its last
/// byte arrives. What it emits, joined, is what
/// [`Tokenizer::decode`] gives for all the ids at once.
///
/// Each step decodes a short window (the ids of the previous chunk and the
/// new ones) and emits the difference, so spacing that depends on the
/// neighbouring token (SentencePiece's leading `▁`) comes out as in a full
/// decode, and the work per id stays constant.
#[must_use = "a stream decoder holds text back until it is pushed or finished"]
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    skip_special: bool,
    /// `ids[..read]` have been turned into text (the first `prefix` of them
    /// as context only); `ids[read..]` are held.
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl<'t> StreamDecoder<'t> {
    /// A decoder for a stream that starts the text.
    pub fn new(tokenizer: &'t Tokenizer, skip_special: bool) -> Self {
        StreamDecoder {
            tokenizer,
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// A decoder for ids that continue `context` (the prompt): the last few
    /// context ids are decoded with the first new ones, so the first word's
    /// leading space is kept as a full decode would keep it.
    pub fn after(tokenizer: &'t Tokenizer, context: &[u32], skip_special: bool) -> Self {
        let tail = &context[context.len().saturating_sub(4)..];
        StreamDecoder {
            tokenizer,
            skip_special,
            ids: tail.to_vec(),
            prefix: 0,
            read: tail.len(),
        }
    }

    /// Adds one generated id; returns the text it completes (`None` while a
    /// character is still incomplete). An id outside the vocabulary is an
    /// error and changes nothing.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TextError> {
        if self.tokenizer.id_to_token(id).is_none() {
            return Err(TextError::UnknownTokenId {
                id,
                vocab: self.tokenizer.vocab_size(),
            });
        }
        self.ids.push(id);
        let (before, now) = self.window_texts()?;
        // A trailing U+FFFD is an incomplete UTF-8 sequence: wait for its
        // remaining bytes. So is a window whose text does not yet extend the
        // text already emitted.
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(new) = now.strip_prefix(before.as_str()) else {
            return Ok(None);
        };
        let new = new.to_string();
        // The ids just emitted become the next window's context.
        self.ids.drain(..self.read);
        self.prefix = 0;
        self.read = self.ids.len();
        Ok(Some(new))
    }

    /// The text of the held ids before the unread ones, and of all the
    /// held ids: what is new is what the second adds to the first.
    fn window_texts(&self) -> Result<(String, String), TextError> {
        let decode = |ids: &[u32]| self.tokenizer.decode(ids, self.skip_special);
        Ok((
            decode(&self.ids[self.prefix..self.read])?,
            decode(&self.ids[self.prefix..])?,
        ))
    }

    /// Ends the stream: the text still held, as a full decode shows it (an
    /// incomplete character the model left at the end reads as U+FFFD, as
    /// [`Tokenizer::decode`] shows it). Empty when nothing is held.
    pub fn finish(self) -> Result<String, TextError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let (before, now) = self.window_texts()?;
        Ok(match now.strip_prefix(before.as_str()) {
            Some(rest) => rest.to_string(),
            None => now,
        })
    }
}
