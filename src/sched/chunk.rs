//! Chunked prefill: one step's token budget shared between the running
//! decodes and the prompts still being prefilled. Pure planning.
//!
//! Every running decode costs one token and comes first, so a long prompt
//! never stalls the decodes for its whole prefill (as vLLM's and SGLang's
//! schedulers do). What is left goes to the prefills in the order given
//! (oldest first), each a chunk of at most its remaining tokens. The oldest
//! prefill always advances, by at least `min_chunk` tokens, even when the
//! decodes take the whole budget: no prompt waits for ever.
//!
//! A chunk only changes how many prompt tokens one pass carries: the model
//! appends each chunk after the KV already written and attends over it
//! through the same paged views, so the KV and logits are those of an
//! unchunked prefill (tests/isolation/prefix_cache_chunked.rs runs prompts in planned chunks).

use crate::ids::RequestId;

/// A prompt partway through its prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartialPrefill {
    pub id: RequestId,
    /// Prompt tokens already in its KV (computed or reused from the cache).
    pub done: usize,
    /// Prompt tokens in all.
    pub total: usize,
}

impl PartialPrefill {
    /// Tokens still to prefill.
    pub fn remaining(&self) -> usize {
        self.total.saturating_sub(self.done)
    }
}

/// The per-step token budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkBudget {
    /// Tokens one step computes: decodes (one each) plus prefill chunks.
    pub step_tokens: usize,
    /// Tokens the oldest prefill advances by at least, whatever the
    /// decodes take (at least 1).
    pub min_chunk: usize,
}

impl Default for ChunkBudget {
    fn default() -> Self {
        ChunkBudget {
            step_tokens: 512,
            min_chunk: 16,
        }
    }
}

/// One prefill's chunk this step: prompt tokens `[start, start + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub id: RequestId,
    pub start: usize,
    pub len: usize,
}

impl Chunk {
    /// True when this chunk ends the prompt (its pass yields the logits of
    /// the prompt's last token, so the sequence starts decoding after it).
    pub fn finishes(&self, p: &PartialPrefill) -> bool {
        self.start + self.len >= p.total
    }
}

/// Plans one step: `decodes` running sequences take a token each, then
/// `prefills` (oldest first) share what is left of the budget.
pub fn plan_chunks(budget: ChunkBudget, decodes: usize, prefills: &[PartialPrefill]) -> Vec<Chunk> {
    let mut left = budget.step_tokens.saturating_sub(decodes);
    let mut chunks = Vec::new();
    for p in prefills {
        let floor = if chunks.is_empty() {
            budget.min_chunk.max(1)
        } else {
            0
        };
        let len = p.remaining().min(left.max(floor));
        if len == 0 {
            if p.remaining() == 0 {
                continue;
            }
            break;
        }
        left = left.saturating_sub(len);
        chunks.push(Chunk {
            id: p.id,
            start: p.done,
            len,
        });
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: u64, done: usize, total: usize) -> PartialPrefill {
        PartialPrefill {
            id: RequestId(id),
            done,
            total,
        }
    }

    fn budget(step_tokens: usize, min_chunk: usize) -> ChunkBudget {
        ChunkBudget {
            step_tokens,
            min_chunk,
        }
    }

    #[test]
    fn decodes_first_then_prefills_share_the_rest_in_order() {
        let c = plan_chunks(budget(100, 8), 30, &[p(1, 0, 50), p(2, 10, 100)]);
        assert_eq!(
            c,
            vec![
                Chunk {
                    id: RequestId(1),
                    start: 0,
                    len: 50
                },
                Chunk {
                    id: RequestId(2),
                    start: 10,
                    len: 20
                },
            ]
        );
        assert!(c[0].finishes(&p(1, 0, 50)));
        assert!(!c[1].finishes(&p(2, 10, 100)));
    }

    #[test]
    fn a_long_prompt_advances_by_the_budget_over_several_steps() {
        let mut prompt = p(1, 0, 16_384);
        let mut steps = 0;
        while prompt.remaining() > 0 {
            let c = plan_chunks(budget(512, 16), 32, &[prompt]);
            assert_eq!(c.len(), 1);
            assert!(c[0].len <= 480, "decodes keep their share");
            prompt.done += c[0].len;
            steps += 1;
        }
        assert_eq!(steps, 16_384usize.div_ceil(480));
    }

    #[test]
    fn the_oldest_prefill_advances_even_when_decodes_fill_the_budget() {
        let c = plan_chunks(budget(64, 16), 200, &[p(1, 0, 100), p(2, 0, 100)]);
        assert_eq!(c.len(), 1, "only the oldest");
        assert_eq!((c[0].id, c[0].len), (RequestId(1), 16));
        let c = plan_chunks(budget(64, 0), 200, &[p(1, 0, 100)]);
        assert_eq!(c[0].len, 1, "min_chunk is at least 1");
    }

    #[test]
    fn finished_prefills_are_skipped_and_nothing_is_planned_past_a_prompt() {
        let c = plan_chunks(budget(100, 1), 0, &[p(1, 5, 5), p(2, 3, 7)]);
        assert_eq!(
            c,
            vec![Chunk {
                id: RequestId(2),
                start: 3,
                len: 4
            }]
        );
    }
}
