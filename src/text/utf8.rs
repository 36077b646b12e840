//! [`Utf8Decoder`]: raw bytes to text as they stream, for byte-level
//! vocabularies whose ids are the bytes themselves.

/// Bytes to UTF-8 text as they arrive: complete characters go out, an
/// incomplete trailing sequence waits for its next byte, and an invalid
/// byte becomes U+FFFD (as [`String::from_utf8_lossy`] shows it). What it
/// emits, joined, is `String::from_utf8_lossy` of all the bytes.
#[derive(Debug, Default, Clone)]
pub struct Utf8Decoder {
    pending: Vec<u8>,
}

impl Utf8Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one byte; returns the text it completes (possibly empty).
    pub fn push(&mut self, byte: u8) -> String {
        self.pending.push(byte);
        self.drain(false)
    }

    /// Adds several bytes; returns the text they complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        self.drain(false)
    }

    /// Ends the stream (or a run of bytes): what is still held, an
    /// incomplete character reading as U+FFFD. The decoder is empty after.
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    /// Bytes held back, waiting for the rest of their character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

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
