//! Speculative decoding's pure half: drafters that guess the next tokens
//! from what a request has seen ([`Drafter`], [`PromptLookup`]), the
//! request's choice of drafter ([`SpecConfig`]), and the rule that keeps
//! or replaces each drafted token from the target model's logits
//! ([`accept`]), so that greedy output is the target's argmax token for
//! token and sampled output has exactly the target's distribution.
//!
//! The engine layer runs the verify pass (the last accepted token and the
//! drafts scored in one forward pass) and rolls the KV of rejected
//! positions back (`KvSeq::settle_draft`).

mod accept;
mod lookup;

pub use accept::accept;
pub use lookup::PromptLookup;

/// The most tokens one step may draft per request.
pub const MAX_DRAFT: usize = 16;

/// The longest n-gram prompt lookup may match.
pub const MAX_NGRAM: usize = 16;

/// Guesses the tokens that follow a request's history (its prompt, then
/// its output so far, the last accepted token last). A guess costs a verify
/// row each; a wrong one costs nothing else.
pub trait Drafter: Send {
    /// Appends to `out` at most `k` tokens likely to follow `history`
    /// (none when it has no guess).
    fn draft(&mut self, history: &[u32], k: usize, out: &mut Vec<u32>);
}

/// Which drafter a request uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DraftKind {
    /// [`PromptLookup`]: the continuation of the latest earlier occurrence
    /// of the history's last `n` tokens, the longest `n` in
    /// `min_n..=max_n` that occurs.
    PromptLookup { min_n: usize, max_n: usize },
}

/// A request's speculative decoding: its drafter and the most tokens it
/// drafts a step. Set per request (`Request::with_speculative`) or as a
/// server's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    pub drafter: DraftKind,
    /// Tokens drafted per step, at most (1..=[`MAX_DRAFT`]).
    pub k: usize,
}

impl SpecConfig {
    /// Prompt lookup with n-grams of 1 to 3 tokens and up to 8 drafts a step.
    pub fn ngram() -> Self {
        SpecConfig {
            drafter: DraftKind::PromptLookup { min_n: 1, max_n: 3 },
            k: 8,
        }
    }

    /// Prompt lookup with n-grams of `min_n..=max_n` tokens and `k` drafts.
    pub fn prompt_lookup(min_n: usize, max_n: usize, k: usize) -> Self {
        SpecConfig {
            drafter: DraftKind::PromptLookup { min_n, max_n },
            k,
        }
    }

    /// Checks the sizes: `k` in `1..=MAX_DRAFT`, `1 <= min_n <= max_n <=
    /// MAX_NGRAM`. The error names the field at fault.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.k == 0 || self.k > MAX_DRAFT {
            return Err("speculative k must be in 1..=16");
        }
        match self.drafter {
            DraftKind::PromptLookup { min_n, max_n } => {
                if min_n == 0 || min_n > max_n || max_n > MAX_NGRAM {
                    return Err("prompt lookup needs 1 <= min_n <= max_n <= 16");
                }
            }
        }
        Ok(())
    }

    /// A drafter of this configuration.
    pub fn drafter(&self) -> Box<dyn Drafter> {
        match self.drafter {
            DraftKind::PromptLookup { min_n, max_n } => Box::new(PromptLookup::new(min_n, max_n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_out_of_range_are_refused_by_name() {
        assert!(SpecConfig::ngram().validate().is_ok());
        assert!(SpecConfig::prompt_lookup(1, 3, 0).validate().is_err());
        assert!(
            SpecConfig::prompt_lookup(1, 3, MAX_DRAFT + 1)
                .validate()
                .is_err()
        );
        assert!(SpecConfig::prompt_lookup(0, 3, 4).validate().is_err());
        assert!(SpecConfig::prompt_lookup(4, 3, 4).validate().is_err());
        assert!(
            SpecConfig::prompt_lookup(1, MAX_NGRAM + 1, 4)
                .validate()
                .is_err()
        );
    }

    #[test]
    fn a_configuration_builds_its_drafter() {
        let mut d = SpecConfig::prompt_lookup(2, 2, 3).drafter();
        let mut out = Vec::new();
        d.draft(&[1, 2, 3, 4, 5, 1, 2], 3, &mut out);
        assert_eq!(out, [3, 4, 5]);
    }
}
