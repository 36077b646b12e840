//! Speculative decoding's verify step: each sequence's last accepted token
//! and the tokens drafted after it are scored by the target model in one
//! batched pass over the pages the request owns ([`Model::verify`]), the
//! acceptance rule ([`accept`]) keeps the drafts the target agrees with
//! and adds the target's own next token, and the KV rows of the rejected
//! drafts are rolled back: the sequence's written count moves back to the
//! kept rows, their audit records are cleared, and pages that hold no kept
//! row are scrubbed and returned. Drafted tokens never reach the prefix
//! cache: it publishes prompt pages only, and a verify pass runs after the
//! prompt is sealed.

use crate::backend::Backend;
use crate::kv::{KvSeq, Ready, Settled};
use crate::model::{ForwardError, Model, Scratch};
use crate::sampling::spec::accept;
use crate::sampling::{Draw, SamplingError, TokenLogprobs, token_logprobs, with_row_scratch};

/// One sequence's part of a verify pass.
#[derive(Debug)]
pub struct Proposal<'s> {
    pub seq: &'s mut KvSeq<Ready>,
    /// The last accepted token, whose KV is not yet written.
    pub next: u32,
    /// Tokens drafted to follow it. A pass drafts only as many as the
    /// sequence can grow to hold: the rest are dropped.
    pub drafts: Vec<u32>,
}

/// What a verify pass gave one sequence.
#[derive(Debug)]
pub struct Verdict {
    /// The tokens it emits, in order: the drafts the target kept, then the
    /// target's own token (the last may be an error, and ends the
    /// request). The last is the next step's input.
    pub tokens: Vec<Result<u32, SamplingError>>,
    /// Each token's log-probabilities, where its draw asked for them.
    pub logprobs: Vec<Option<TokenLogprobs>>,
    /// Drafts scored (after trimming to what the sequence could hold).
    pub drafted: usize,
    /// The rollback: rows kept, rows rolled back, pages returned.
    pub settled: Settled,
}

impl Verdict {
    /// Drafts the target kept.
    pub fn accepted(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }
}

/// Verifies `props` in one pass of `model` (see the module doc). `draw(i)`
/// gives sequence `i`'s next draw, once per token it emits. On a failed
/// pass every sequence is rolled back to where it stood (nothing it wrote
/// stays readable) and the error names the sequence at fault, if one was.
pub fn verify<B: Backend>(
    model: &Model<B>,
    scratch: &mut Scratch<B>,
    props: &mut [Proposal<'_>],
    mut draw: impl FnMut(usize) -> Draw,
) -> Result<Vec<Verdict>, ForwardError> {
    let kv_err = |index: usize, seq: &KvSeq<Ready>| {
        let owner = seq.owner();
        move |source| ForwardError::Kv {
            index,
            owner,
            source,
        }
    };
    let mut marks = Vec::with_capacity(props.len());
    for (i, p) in props.iter_mut().enumerate() {
        let mark = p.seq.begin_draft().map_err(kv_err(i, p.seq))?;
        let len = p.seq.complete_len().unwrap_or(0);
        // Room for the input and every draft, else for as many drafts as
        // the pages it has hold (the pass itself refuses a sequence that
        // cannot take its one input).
        if p.seq.ensure_capacity(len + 1 + p.drafts.len()).is_err() {
            let room = p.seq.reserved_tokens().saturating_sub(len + 1);
            p.drafts.truncate(room);
        }
        marks.push(mark);
    }
    let inputs: Vec<Vec<u32>> = props
        .iter()
        .map(|p| {
            std::iter::once(p.next)
                .chain(p.drafts.iter().copied())
                .collect()
        })
        .collect();
    let mut seqs: Vec<&mut KvSeq<Ready>> = props.iter_mut().map(|p| &mut *p.seq).collect();
    let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
    let result = model.verify(scratch, &mut seqs, &refs);
    drop(seqs);
    let logits = match result {
        Ok(l) => l,
        Err(e) => {
            for (p, mark) in props.iter_mut().zip(marks) {
                // Back to the mark: a sequence the pass never reached
                // keeps its rows as they were.
                let _ = p.seq.settle_draft(mark, 0);
            }
            return Err(e);
        }
    };
    let mut verdicts = Vec::with_capacity(props.len());
    let mut first = 0;
    for (i, (p, mark)) in props.iter_mut().zip(marks).enumerate() {
        let at = first;
        let rows = |j: usize| logits.row(at + j);
        first += 1 + p.drafts.len();
        let mut asked = None;
        let tokens = with_row_scratch(|s| {
            accept(
                rows,
                &p.drafts,
                || {
                    let d = draw(i);
                    asked = d.logprobs();
                    d
                },
                s,
            )
        });
        let logprobs = tokens
            .iter()
            .enumerate()
            .map(|(j, t)| {
                let (Ok(t), Some(top)) = (t, asked) else {
                    return None;
                };
                Some(token_logprobs(rows(j), *t, usize::from(top)))
            })
            .collect();
        let settled = p
            .seq
            .settle_draft(mark, tokens.len())
            .map_err(kv_err(i, p.seq))?;
        verdicts.push(Verdict {
            drafted: p.drafts.len(),
            tokens,
            logprobs,
            settled,
        });
    }
    Ok(verdicts)
}
