//! [`StopMatcher`]: user stop strings over streamed text.

use super::TextError;

/// What one [`StopMatcher::push`] lets through.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct StopStep {
    /// Text safe to show: it is not, and cannot become, part of a stop string.
    pub text: String,
    /// The index (into the stop strings given) of the one that just matched:
    /// generation should end, and nothing after `text` is shown.
    pub stopped: Option<usize>,
}

/// Watches streamed text for any of the user's stop strings. Text that could
/// still be the start of a stop string is held back until the next chunk
/// decides; a matched stop string is never emitted, nor anything after it.
/// The held text is at most the longest stop string's length.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stops`; an empty stop string is refused (it would
    /// match before any text).
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Result<Self, TextError> {
        let stops: Vec<String> = stops.into_iter().map(Into::into).collect();
        if stops.iter().any(String::is_empty) {
            return Err(TextError::EmptyStopString);
        }
        Ok(StopMatcher {
            stops,
            held: String::new(),
            stopped: None,
        })
    }

    /// Feeds the next chunk of streamed text. After a stop has matched,
    /// every later chunk is swallowed.
    pub fn push(&mut self, chunk: &str) -> StopStep {
        if self.stopped.is_some() {
            return StopStep {
                text: String::new(),
                stopped: None,
            };
        }
        self.held.push_str(chunk);
        // The earliest match wins; among matches at one place, the first given.
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = found {
            let text = self.held[..at].to_string();
            self.held.clear();
            self.stopped = Some(i);
            return StopStep {
                text,
                stopped: Some(i),
            };
        }
        // Hold the longest tail that some stop string starts with.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let rest = self.held.split_off(keep_from);
        let text = std::mem::replace(&mut self.held, rest);
        StopStep {
            text,
            stopped: None,
        }
    }

    /// The stop string that matched, if one has.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    /// Ends the stream without a stop: the text held back, which turned out
    /// not to be a stop string. Empty after a stop.
    pub fn finish(self) -> String {
        self.held
    }
}
