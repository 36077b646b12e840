//! Prompts being prefilled on the colocated engine, possibly over several
//! steps (chunked prefill), possibly starting from pages the tenant's prefix
//! cache already holds.
//!
//! A request enters when the scheduler admits it: its pages are reserved
//! for the whole prompt (plus the first generated token) at once, leased
//! from the cache where the tenant has the prefix, so a prefill that has
//! started never waits for pages. Each step gives the oldest prompts a chunk
//! of the step's token budget ([`crate::sched::plan_chunks`]); the chunk
//! that ends a prompt yields its first token, and the sequence is sealed and
//! joins the running set.

use crate::ids::RequestId;
use crate::kv::{Filling, KvSeq, PrefixKeys};
use crate::request::Request;
use crate::sched::{ChunkBudget, PartialPrefill, plan_chunks};

/// A prompt being prefilled.
pub(crate) struct Prefilling {
    pub(crate) req: Request,
    pub(crate) seq: KvSeq<Filling>,
    /// What the KV must hold before decoding: the prompt, plus the tokens
    /// already streamed when a preempted request recomputes.
    pub(crate) input: Vec<u32>,
    /// The input's prefix-cache keys, when the request uses the cache.
    pub(crate) keys: Option<PrefixKeys>,
}

impl Prefilling {
    /// Input tokens already in the KV (computed or leased).
    pub(crate) fn done(&self) -> usize {
        self.seq.complete_len().unwrap_or(0)
    }

    /// Input tokens still to compute.
    pub(crate) fn remaining(&self) -> usize {
        self.input.len().saturating_sub(self.done())
    }

    fn partial(&self) -> PartialPrefill {
        PartialPrefill {
            id: self.req.id,
            done: self.done(),
            total: self.input.len(),
        }
    }
}

/// The smallest chunk the oldest prompt advances by, whatever the decodes
/// take of the step's budget.
pub(crate) const MIN_CHUNK: usize = 16;

/// This step's chunk length for each prompt in `filling` (0: it waits),
/// oldest first. `budget` is `None` when prefill is not chunked: every
/// prompt computes all it has left.
pub(crate) fn chunk_lengths(
    filling: &[Prefilling],
    budget: Option<ChunkBudget>,
    decodes: usize,
) -> Vec<usize> {
    let Some(budget) = budget else {
        return filling.iter().map(Prefilling::remaining).collect();
    };
    let parts: Vec<PartialPrefill> = filling.iter().map(Prefilling::partial).collect();
    let chunks = plan_chunks(budget, decodes, &parts);
    filling
        .iter()
        .map(|f| {
            chunks
                .iter()
                .find(|c| c.id == f.req.id)
                .map_or(0, |c| c.len)
        })
        .collect()
}

/// Position of `id` in `filling`.
pub(crate) fn position(filling: &[Prefilling], id: RequestId) -> Option<usize> {
    filling.iter().position(|f| f.req.id == id)
}
