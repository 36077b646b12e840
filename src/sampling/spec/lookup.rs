//! Prompt lookup: drafts copied from the request's own history. Text that
//! repeats its input (a summary quoting its source, code edited in place)
//! continues the way it did the last time the same few tokens appeared.

use super::Drafter;

/// Drafts the tokens that followed the latest earlier occurrence of the
/// history's last `n` tokens, for the longest `n` in `min_n..=max_n` that
/// occurs (a longer match is better evidence). Pure: the same history
/// gives the same drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLookup {
    min_n: usize,
    max_n: usize,
}

impl PromptLookup {
    /// Matches of `min_n..=max_n` tokens (`min_n` raised to 1).
    pub fn new(min_n: usize, max_n: usize) -> Self {
        let min_n = min_n.max(1);
        PromptLookup {
            min_n,
            max_n: max_n.max(min_n),
        }
    }
}

impl Drafter for PromptLookup {
    fn draft(&mut self, history: &[u32], k: usize, out: &mut Vec<u32>) {
        let len = history.len();
        if k == 0 {
            return;
        }
        for n in (self.min_n..=self.max_n).rev() {
            // The suffix, and at least one token after an earlier match.
            if len <= n {
                continue;
            }
            let suffix = &history[len - n..];
            // Latest first: starts whose match ends before the suffix.
            let found = (0..len - n).rev().find(|&s| &history[s..s + n] == suffix);
            if let Some(s) = found {
                let from = s + n;
                out.extend_from_slice(&history[from..(from + k).min(len)]);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(d: &mut PromptLookup, h: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        d.draft(h, k, &mut out);
        out
    }

    #[test]
    fn the_latest_occurrence_of_the_longest_suffix_wins() {
        let mut d = PromptLookup::new(1, 3);
        // "7 8" occurs twice: the later one (followed by 4) is drafted.
        assert_eq!(draft(&mut d, &[7, 8, 1, 2, 7, 8, 4, 5, 7, 8], 2), [4, 5]);
        // The 3-gram "9 7 8" beats the later 2-gram "7 8".
        assert_eq!(draft(&mut d, &[9, 7, 8, 3, 3, 7, 8, 4, 9, 7, 8], 2), [3, 3]);
    }

    #[test]
    fn drafts_stop_at_k_and_at_the_end_of_the_history() {
        let mut d = PromptLookup::new(1, 2);
        let h = [1, 2, 3, 4, 5, 6, 1, 2];
        assert_eq!(draft(&mut d, &h, 3), [3, 4, 5]);
        assert_eq!(draft(&mut d, &h, 100), [3, 4, 5, 6, 1, 2]);
        // The continuation may run into the suffix itself (a repeat).
        assert_eq!(draft(&mut d, &[5, 5, 5], 4), [5]);
        assert_eq!(draft(&mut d, &h, 0), Vec::<u32>::new());
    }

    #[test]
    fn no_match_no_draft() {
        let mut d = PromptLookup::new(2, 3);
        assert!(draft(&mut d, &[1, 2, 3, 4], 4).is_empty());
        assert!(draft(&mut d, &[1], 4).is_empty());
        assert!(draft(&mut d, &[], 4).is_empty());
        // min_n 1 finds the single token.
        let mut one = PromptLookup::new(1, 3);
        assert_eq!(draft(&mut one, &[4, 9, 2, 4], 2), [9, 2]);
    }

    #[test]
    fn the_same_history_gives_the_same_drafts() {
        let h: Vec<u32> = (0..200).map(|i| (i * 7 % 13) as u32).collect();
        let mut a = PromptLookup::new(1, 4);
        let mut b = PromptLookup::new(1, 4);
        assert_eq!(draft(&mut a, &h, 8), draft(&mut b, &h, 8));
        assert_eq!(draft(&mut a, &h, 8), draft(&mut a, &h, 8));
    }
}
