//! The Llama forward pass over paged KV, written once against [`Backend`].
//!
//! One pass serves a batch of sequences: their new tokens are stacked into
//! one activation buffer so every weight matrix is read once per step, each
//! sequence's K/V rows are appended to its own pages, and attention reads
//! each sequence's own pages through validated views. The pass does not own
//! a pool or a scheduler: callers (the engine layer's colocated `Engine`, prefill
//! and decode workers) hand it the `KvSeq` handles to fill.

use crate::backend::{AttnShape, Backend, BackendError, CpuBackend, Norm, PassPlan, Rope, SeqSpan};
use crate::http::HttpStatus;
use crate::ids::RequestId;
use crate::kv::{Filling, KvError, KvPool, KvSeq, PoolConfig, Readable, Ready, Writable};
use crate::kv::{KvDtype, KvGeometry};
use crate::model::{ModelConfig, ModelFingerprint};
use crate::sampling::{Draw, SamplingError, TokenLogprobs};

/// Why a forward pass failed. Variants with an `index` name the sequence
/// (position in the batch) at fault; the others concern the whole batch.
///
/// A pass that fails may have appended KV for some layers of some
/// sequences: callers must not seal or decode from those handles, but
/// release them (and recompute the requests that were not at fault).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ForwardError {
    #[error("the batch is empty")]
    EmptyBatch,
    #[error("the batch has {seqs} sequences but {inputs} inputs: pass one input per sequence")]
    BatchMismatch { seqs: usize, inputs: usize },
    #[error("sequence {index} has no input tokens")]
    NoTokens { index: usize },
    #[error("sequence {index}: token {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        index: usize,
        token: u32,
        vocab: usize,
    },
    #[error(
        "sequence {index} ({owner}): layers hold different token counts {written:?}: the KV is \
         incomplete; release it"
    )]
    IncompleteKv {
        index: usize,
        owner: RequestId,
        written: Vec<usize>,
    },
    #[error(
        "sequence {index} ({owner}): {needed} tokens needed, {reserved} reserved: grow the \
         sequence before the pass"
    )]
    Reservation {
        index: usize,
        owner: RequestId,
        needed: usize,
        reserved: usize,
    },
    #[error("sequence {index} belongs to another KV pool than sequence 0: batch per pool")]
    ForeignPool { index: usize },
    #[error(
        "the KV pool stores {pool_layers} layers x {pool_kv_dim} per token, the model needs \
         {model_layers} x {model_kv_dim}: build the pool from the model's kv_geometry"
    )]
    Geometry {
        pool_layers: usize,
        pool_kv_dim: usize,
        model_layers: usize,
        model_kv_dim: usize,
    },
    #[error("sequence {index} ({owner}): {source}")]
    Kv {
        index: usize,
        owner: RequestId,
        #[source]
        source: KvError,
    },
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
    #[error("cannot build a private KV pool: {0}")]
    PrivatePool(String),
}

impl ForwardError {
    /// The same error with its batch position moved by `by` (a group pass
    /// reports positions within its group).
    fn shifted(mut self, by: usize) -> Self {
        match &mut self {
            ForwardError::NoTokens { index }
            | ForwardError::TokenOutOfRange { index, .. }
            | ForwardError::IncompleteKv { index, .. }
            | ForwardError::Reservation { index, .. }
            | ForwardError::ForeignPool { index }
            | ForwardError::Kv { index, .. } => *index += by,
            _ => {}
        }
        self
    }

    /// The batch position of the sequence at fault, when one is.
    pub fn culprit(&self) -> Option<usize> {
        match self {
            ForwardError::NoTokens { index }
            | ForwardError::TokenOutOfRange { index, .. }
            | ForwardError::IncompleteKv { index, .. }
            | ForwardError::Reservation { index, .. }
            | ForwardError::ForeignPool { index }
            | ForwardError::Kv { index, .. } => Some(*index),
            _ => None,
        }
    }
}

impl HttpStatus for ForwardError {
    fn http_status(&self) -> u16 {
        match self {
            ForwardError::TokenOutOfRange { .. } | ForwardError::NoTokens { .. } => 400,
            ForwardError::Kv { source, .. } => source.http_status(),
            ForwardError::Backend(e) => e.http_status(),
            _ => 500,
        }
    }
}

pub(crate) struct Layer<B: Backend> {
    pub(crate) attn_norm: B::Mat,
    pub(crate) wq: B::Mat,
    pub(crate) wk: B::Mat,
    pub(crate) wv: B::Mat,
    pub(crate) wo: B::Mat,
    pub(crate) bq: Option<B::Mat>,
    pub(crate) bk: Option<B::Mat>,
    pub(crate) bv: Option<B::Mat>,
    /// Per-head RMS gains `[head_dim]` of q and k (Qwen3).
    pub(crate) q_norm: Option<B::Mat>,
    pub(crate) k_norm: Option<B::Mat>,
    /// Gemma's norms of the attention and feed-forward outputs.
    pub(crate) post_attn_norm: Option<B::Mat>,
    pub(crate) ffn_norm: B::Mat,
    pub(crate) post_ffn_norm: Option<B::Mat>,
    pub(crate) w1: B::Mat,
    pub(crate) w2: B::Mat,
    pub(crate) w3: B::Mat,
}

/// A model's weights placed on a backend.
pub struct Model<B: Backend = CpuBackend> {
    backend: B,
    config: ModelConfig,
    embedding: B::Mat,
    lm_head: Option<B::Mat>,
    final_norm: B::Mat,
    layers: Vec<Layer<B>>,
    /// Weight elements a token's pass reads (for [`Backend::plan_pass`]).
    weight_elems: usize,
    fingerprint: ModelFingerprint,
}

impl<B: Backend> std::fmt::Debug for Model<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("backend", &self.backend.name())
            .field("config", &self.config)
            .finish()
    }
}

/// Reusable buffers of forward passes. Keep one per worker thread: after the
/// first passes have grown it, a step allocates nothing proportional to the
/// model.
pub struct Scratch<B: Backend> {
    x: B::Buf,
    xn: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    att: B::Buf,
    proj: B::Buf,
    gate: B::Buf,
    up: B::Buf,
    tmp: B::Buf,
    tmp2: B::Buf,
    logits_dev: B::Buf,
    logits: Vec<f32>,
    /// Each row's token (or sampling error) of a sampled pass.
    sampled: Vec<Result<u32, SamplingError>>,
    /// Each row's log-probabilities where its draw asked (empty when no
    /// row of the pass asked).
    logprobs: Vec<Option<TokenLogprobs>>,
    tokens: Vec<u32>,
    positions: Vec<usize>,
    spans: Vec<SeqSpan>,
    out_rows: Vec<usize>,
    /// One scratch per group of a [`PassPlan::Groups`] pass.
    groups: Vec<Scratch<B>>,
}

/// A sampled pass's output: each row's token (or why it has none), read as
/// a slice, and the log-probabilities of rows whose draws asked.
#[derive(Clone, Copy, Debug)]
pub struct Sampled<'s> {
    tokens: &'s [Result<u32, SamplingError>],
    logprobs: &'s [Option<TokenLogprobs>],
}

impl<'s> Sampled<'s> {
    fn of<B: Backend>(s: &'s Scratch<B>) -> Self {
        Sampled {
            tokens: &s.sampled,
            logprobs: &s.logprobs,
        }
    }

    /// Row `i`'s log-probabilities, if its draw asked for them.
    pub fn logprobs(&self, i: usize) -> Option<&'s TokenLogprobs> {
        self.logprobs.get(i).and_then(Option::as_ref)
    }
}

impl<'s> std::ops::Deref for Sampled<'s> {
    type Target = [Result<u32, SamplingError>];
    fn deref(&self) -> &Self::Target {
        self.tokens
    }
}

impl<'s> IntoIterator for Sampled<'s> {
    type Item = &'s Result<u32, SamplingError>;
    type IntoIter = std::slice::Iter<'s, Result<u32, SamplingError>>;
    fn into_iter(self) -> Self::IntoIter {
        self.tokens.iter()
    }
}

impl<B: Backend> Scratch<B> {
    /// `x += a · Wᵀ` for `a` the attention output (the gated feed-forward
    /// input when `mlp`), the projection RMS-normed by `post` first when
    /// given (Gemma's post-attention and post-feed-forward norms).
    fn add_projection(
        &mut self,
        b: &B,
        mlp: bool,
        w: &B::Mat,
        post: Option<Norm<'_, B::Mat>>,
    ) -> Result<(), BackendError> {
        let Scratch {
            x,
            att,
            gate,
            proj,
            tmp,
            ..
        } = self;
        let a = if mlp { &*gate } else { &*att };
        match post {
            None => b.matmul_add(a, w, proj, x),
            Some(n) => {
                b.matmul(a, w, proj)?;
                b.rms_norm(proj, n.weight, n.eps, tmp)?;
                b.add_assign(x, tmp)
            }
        }
    }

    /// The last pass's logits.
    fn logits_view(&self, vocab: usize) -> Logits<'_> {
        Logits {
            data: &self.logits,
            vocab,
        }
    }
}

impl<B: Backend> Default for Scratch<B> {
    fn default() -> Self {
        Scratch {
            x: B::Buf::default(),
            xn: B::Buf::default(),
            q: B::Buf::default(),
            k: B::Buf::default(),
            v: B::Buf::default(),
            att: B::Buf::default(),
            proj: B::Buf::default(),
            gate: B::Buf::default(),
            up: B::Buf::default(),
            tmp: B::Buf::default(),
            tmp2: B::Buf::default(),
            logits_dev: B::Buf::default(),
            logits: Vec::new(),
            sampled: Vec::new(),
            logprobs: Vec::new(),
            tokens: Vec::new(),
            positions: Vec::new(),
            spans: Vec::new(),
            out_rows: Vec::new(),
            groups: Vec::new(),
        }
    }
}

/// Logits of a pass, `[rows, vocab]`, borrowed from the scratch.
#[derive(Clone, Copy, Debug)]
pub struct Logits<'a> {
    data: &'a [f32],
    vocab: usize,
}

impl<'a> Logits<'a> {
    /// Rows (one per sequence, or one per position for
    /// [`Model::logits_for_prompt`]).
    pub fn len(&self) -> usize {
        self.data.len() / self.vocab
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    /// Row `i`.
    pub fn row(&self, i: usize) -> &'a [f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
    /// Every row.
    pub fn rows(&self) -> impl Iterator<Item = &'a [f32]> + 'a {
        self.data.chunks_exact(self.vocab)
    }
    /// Copies into owned rows.
    pub fn to_vecs(&self) -> Vec<Vec<f32>> {
        self.rows().map(<[f32]>::to_vec).collect()
    }
}

/// One input per sequence in each of `inputs`, else the first that differs.
fn same_batch(seqs: usize, inputs: &[usize]) -> Result<(), ForwardError> {
    match inputs.iter().find(|&&n| n != seqs) {
        Some(&inputs) => Err(ForwardError::BatchMismatch { seqs, inputs }),
        None => Ok(()),
    }
}

/// What a pass hands back from its logits.
#[derive(Clone, Copy)]
enum Out<'d> {
    /// The logits, copied to the host (`Scratch::logits`).
    Logits,
    /// One token per logits row, sampled by the backend where the logits
    /// are (`Scratch::sampled`).
    Tokens(&'d [Draw]),
}

impl<'d> Out<'d> {
    /// This output for the rows `off..off + n` of the batch.
    fn rows(self, off: usize, n: usize) -> Self {
        match self {
            Out::Logits => Out::Logits,
            Out::Tokens(d) => Out::Tokens(&d[off..off + n]),
        }
    }
}

/// Which rows of the pass produce logits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Want {
    LastOfEachSequence,
    Every,
}

impl<B: Backend> Model<B> {
    /// A model from parts a placer placed (`model::place`).
    pub(crate) fn from_placed(
        backend: B,
        config: ModelConfig,
        embedding: B::Mat,
        layers: Vec<Layer<B>>,
        final_norm: B::Mat,
        lm_head: Option<B::Mat>,
        fingerprint: ModelFingerprint,
    ) -> Self {
        let c = &config;
        let (d, h) = (c.dim, c.hidden_dim);
        let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let weight_elems = layers.len() * (2 * qd * d + 2 * kvd * d + 3 * h * d) + c.vocab_size * d;
        Model {
            backend,
            config,
            embedding,
            lm_head,
            final_norm,
            layers,
            weight_elems,
            fingerprint,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The hash of this model's configuration and weights (see
    /// [`ModelFingerprint`]): disaggregated workers refuse to hand KV
    /// between different models.
    pub fn fingerprint(&self) -> ModelFingerprint {
        self.fingerprint
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Bytes the placed weights occupy on the backend (for sizing a
    /// deployment: add the KV pool's).
    pub fn weight_bytes(&self) -> usize {
        let b = &self.backend;
        let mut mats = vec![&self.embedding, &self.final_norm];
        mats.extend(&self.lm_head);
        for l in &self.layers {
            mats.extend([
                &l.attn_norm,
                &l.wq,
                &l.wk,
                &l.wv,
                &l.wo,
                &l.ffn_norm,
                &l.w1,
                &l.w2,
                &l.w3,
            ]);
            mats.extend(
                [
                    &l.bq,
                    &l.bk,
                    &l.bv,
                    &l.q_norm,
                    &l.k_norm,
                    &l.post_attn_norm,
                    &l.post_ffn_norm,
                ]
                .into_iter()
                .flatten(),
            );
        }
        mats.into_iter().map(|m| b.mat_bytes(m)).sum()
    }

    /// The KV geometry a pool serving this model must have.
    pub fn kv_geometry(&self, dtype: KvDtype) -> KvGeometry {
        self.config.kv_geometry(dtype)
    }

    /// Fresh reusable buffers for passes of this model.
    pub fn scratch(&self) -> Scratch<B> {
        Scratch::default()
    }

    /// Prefill: appends the KV of `prompts[i]` to `seqs[i]` (after whatever
    /// it already holds, so a prompt may be fed in chunks) and returns the
    /// logits of each sequence's last position.
    pub fn prefill<'s>(
        &self,
        scratch: &'s mut Scratch<B>,
        seqs: &mut [&mut KvSeq<Filling>],
        prompts: &[&[u32]],
    ) -> Result<Logits<'s>, ForwardError> {
        same_batch(seqs.len(), &[prompts.len()])?;
        self.pass(
            scratch,
            seqs,
            |i| prompts[i],
            Want::LastOfEachSequence,
            false,
            Out::Logits,
        )?;
        Ok(scratch.logits_view(self.config.vocab_size))
    }

    /// [`Model::prefill`], then each sequence's next token chosen by
    /// `draws[i]` where the logits are ([`Backend::sample`]: on the device
    /// for the CUDA backend, so the logits never cross to the host).
    pub fn prefill_sampled<'s>(
        &self,
        scratch: &'s mut Scratch<B>,
        seqs: &mut [&mut KvSeq<Filling>],
        prompts: &[&[u32]],
        draws: &[Draw],
    ) -> Result<Sampled<'s>, ForwardError> {
        same_batch(seqs.len(), &[prompts.len(), draws.len()])?;
        self.pass(
            scratch,
            seqs,
            |i| prompts[i],
            Want::LastOfEachSequence,
            false,
            Out::Tokens(draws),
        )?;
        Ok(Sampled::of(scratch))
    }

    /// One decode step: appends `tokens[i]` to `seqs[i]` and returns the
    /// logits of the next position of every sequence.
    pub fn decode<'s>(
        &self,
        scratch: &'s mut Scratch<B>,
        seqs: &mut [&mut KvSeq<Ready>],
        tokens: &[u32],
    ) -> Result<Logits<'s>, ForwardError> {
        same_batch(seqs.len(), &[tokens.len()])?;
        self.pass(
            scratch,
            seqs,
            |i| std::slice::from_ref(&tokens[i]),
            Want::LastOfEachSequence,
            true,
            Out::Logits,
        )?;
        Ok(scratch.logits_view(self.config.vocab_size))
    }

    /// [`Model::decode`], then each sequence's next token chosen by
    /// `draws[i]` where the logits are ([`Backend::sample`]): the step a
    /// server runs, with only token ids crossing from a GPU.
    pub fn decode_sampled<'s>(
        &self,
        scratch: &'s mut Scratch<B>,
        seqs: &mut [&mut KvSeq<Ready>],
        tokens: &[u32],
        draws: &[Draw],
    ) -> Result<Sampled<'s>, ForwardError> {
        same_batch(seqs.len(), &[tokens.len(), draws.len()])?;
        self.pass(
            scratch,
            seqs,
            |i| std::slice::from_ref(&tokens[i]),
            Want::LastOfEachSequence,
            true,
            Out::Tokens(draws),
        )?;
        Ok(Sampled::of(scratch))
    }

    /// A speculative verify step: appends `inputs[i]` (the last accepted
    /// token, then the drafts after it) to `seqs[i]` in one batched pass,
    /// causal within each input as a prefill chunk is, and returns the
    /// logits of every input position, sequence after sequence (row `j`
    /// of sequence `i`'s rows follows its first `j + 1` inputs). A
    /// sequence with one input is a decode step: every row's numbers are
    /// those of a decode of the same tokens.
    pub fn verify<'s>(
        &self,
        scratch: &'s mut Scratch<B>,
        seqs: &mut [&mut KvSeq<Ready>],
        inputs: &[&[u32]],
    ) -> Result<Logits<'s>, ForwardError> {
        same_batch(seqs.len(), &[inputs.len()])?;
        self.pass(
            scratch,
            seqs,
            |i| inputs[i],
            Want::Every,
            false,
            Out::Logits,
        )?;
        Ok(scratch.logits_view(self.config.vocab_size))
    }

    /// Logits at every position of `tokens`, computed on a private pool
    /// (for conformance tests and scoring).
    pub fn logits_for_prompt(&self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::NoTokens { index: 0 });
        }
        let page_size = 16;
        let pool = KvPool::new(PoolConfig::new(
            self.kv_geometry(KvDtype::F32),
            page_size,
            crate::kv::pages_for(tokens.len(), page_size),
        ))
        .map_err(|e| ForwardError::PrivatePool(e.to_string()))?;
        let mut seq = pool
            .reserve(RequestId(0), tokens.len())
            .map_err(|e| ForwardError::PrivatePool(e.to_string()))?;
        let mut scratch = self.scratch();
        self.pass(
            &mut scratch,
            &mut [&mut seq],
            |_| tokens,
            Want::Every,
            false,
            Out::Logits,
        )?;
        Ok(scratch.logits_view(self.config.vocab_size).to_vecs())
    }

    /// Validates the batch and lays out tokens, positions and spans.
    fn prepare<'t, S: Writable + Readable>(
        &self,
        scratch: &mut Scratch<B>,
        seqs: &[&mut KvSeq<S>],
        input: impl Fn(usize) -> &'t [u32],
    ) -> Result<(), ForwardError> {
        let first = seqs.first().ok_or(ForwardError::EmptyBatch)?;
        let g = first.pool().config().geometry();
        let c = &self.config;
        if g.n_layers != c.n_layers || g.kv_dim() != c.n_kv_heads * c.head_dim {
            return Err(ForwardError::Geometry {
                pool_layers: g.n_layers,
                pool_kv_dim: g.kv_dim(),
                model_layers: c.n_layers,
                model_kv_dim: c.n_kv_heads * c.head_dim,
            });
        }
        let s = scratch;
        s.tokens.clear();
        s.positions.clear();
        s.spans.clear();
        for (index, seq) in seqs.iter().enumerate() {
            if !seq.pool().same_pool(first.pool()) {
                return Err(ForwardError::ForeignPool { index });
            }
            let owner = seq.owner();
            let start = seq
                .complete_len()
                .ok_or_else(|| ForwardError::IncompleteKv {
                    index,
                    owner,
                    written: seq.written_per_layer().to_vec(),
                })?;
            let toks = input(index);
            if toks.is_empty() {
                return Err(ForwardError::NoTokens { index });
            }
            if let Some(&token) = toks.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(ForwardError::TokenOutOfRange {
                    index,
                    token,
                    vocab: c.vocab_size,
                });
            }
            let needed = start + toks.len();
            if needed > seq.reserved_tokens() {
                return Err(ForwardError::Reservation {
                    index,
                    owner,
                    needed,
                    reserved: seq.reserved_tokens(),
                });
            }
            s.spans.push(SeqSpan {
                first_row: s.tokens.len(),
                rows: toks.len(),
                first_pos: start,
            });
            s.tokens.extend_from_slice(toks);
            s.positions.extend(start..needed);
        }
        Ok(())
    }

    /// One pass; its output (logits or sampled tokens) is left in
    /// `scratch`.
    fn pass<'t, S: Writable + Readable>(
        &self,
        scratch: &mut Scratch<B>,
        seqs: &mut [&mut KvSeq<S>],
        input: impl Fn(usize) -> &'t [u32] + Sync,
        want: Want,
        decode: bool,
        out: Out<'_>,
    ) -> Result<(), ForwardError> {
        let rows: usize = (0..seqs.len()).map(|i| input(i).len()).sum();
        match self.backend.plan_pass(rows, self.weight_elems) {
            PassPlan::Groups(g)
                if g >= 2 && seqs.len() >= 2 && want == Want::LastOfEachSequence =>
            {
                self.pass_groups(g, scratch, seqs, &input, decode, out)
            }
            // Here, or a single sequence of a small model: its large ops
            // still split over the threads.
            PassPlan::Here | PassPlan::Groups(_) => {
                let input = &input;
                self.backend.run_pass(rows, self.weight_elems, || {
                    self.pass_here(scratch, seqs, input, want, decode, out)
                })
            }
        }
    }

    /// The batch split at sequence boundaries into `groups` runs of about
    /// equal rows, each run a whole pass of its own (own scratch, own
    /// sequences, so no two groups touch the same pages), concurrently.
    /// Every row's numbers are the same as in one pass: ops are
    /// batch-invariant.
    fn pass_groups<'t, S: Writable + Readable>(
        &self,
        groups: usize,
        scratch: &mut Scratch<B>,
        seqs: &mut [&mut KvSeq<S>],
        input: &(impl Fn(usize) -> &'t [u32] + Sync),
        decode: bool,
        out: Out<'_>,
    ) -> Result<(), ForwardError> {
        // Validate the whole batch first: errors name batch positions and
        // nothing is appended for a batch that cannot run.
        self.prepare(scratch, seqs, input)?;
        let total = scratch.tokens.len();
        let mut bounds = vec![0];
        let mut acc = 0;
        for (i, sp) in scratch.spans.iter().enumerate().take(seqs.len() - 1) {
            acc += sp.rows;
            if bounds.len() < groups && acc * groups >= total * bounds.len() {
                bounds.push(i + 1);
            }
        }
        bounds.push(seqs.len());
        let n = bounds.len() - 1;
        if scratch.groups.len() < n {
            scratch.groups.resize_with(n, Scratch::default);
        }
        let mut rest = seqs;
        let mut tasks = Vec::with_capacity(n);
        for (w, gs) in bounds.windows(2).zip(scratch.groups.iter_mut()) {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(w[1] - w[0]);
            rest = tail;
            let off = w[0];
            let out = out.rows(off, w[1] - w[0]);
            tasks.push(move || {
                self.pass_here(
                    gs,
                    head,
                    |i| input(off + i),
                    Want::LastOfEachSequence,
                    decode,
                    out,
                )
                .map_err(|e| e.shifted(off))
            });
        }
        for r in self.backend.run_groups(tasks) {
            r?;
        }
        scratch.logits.clear();
        scratch.sampled.clear();
        scratch.logprobs.clear();
        let any_logprobs = scratch.groups[..n].iter().any(|g| !g.logprobs.is_empty());
        for gs in &mut scratch.groups[..n] {
            match out {
                Out::Logits => scratch.logits.extend_from_slice(&gs.logits),
                Out::Tokens(_) => {
                    scratch.sampled.extend_from_slice(&gs.sampled);
                    if any_logprobs {
                        // Moved, not copied; a group none of whose rows
                        // asked left its list empty: its rows get None.
                        let none = gs.sampled.len() - gs.logprobs.len();
                        scratch.logprobs.append(&mut gs.logprobs);
                        scratch.logprobs.extend(std::iter::repeat_n(None, none));
                    }
                }
            }
        }
        Ok(())
    }

    fn pass_here<'t, S: Writable + Readable>(
        &self,
        scratch: &mut Scratch<B>,
        seqs: &mut [&mut KvSeq<S>],
        input: impl Fn(usize) -> &'t [u32],
        want: Want,
        decode: bool,
        out: Out<'_>,
    ) -> Result<(), ForwardError> {
        self.prepare(scratch, seqs, input)?;
        let b = &self.backend;
        let c = &self.config;
        let eps = c.norm_eps;
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        // A Gemma local layer rotates by its own base, without scaling.
        let rope = |n_heads, local: bool| Rope {
            n_heads,
            head_dim: c.head_dim,
            theta: match c.gemma {
                Some(g) if local => g.local_rope_theta,
                _ => c.rope_theta,
            },
            style: c.rope_style,
            scaling: if local {
                crate::backend::RopeScaling::None
            } else {
                c.rope_scaling
            },
        };
        // Gemma scales scores by 1/sqrt(query_pre_attn_scalar), the
        // kernels by 1/sqrt(head_dim): q makes up the difference.
        let q_scale = c
            .gemma
            .map(|g| (c.head_dim as f32 / g.query_pre_attn_scalar).sqrt())
            .filter(|&f| f != 1.0);
        let s = &mut *scratch;
        let kv_err = |index: usize, owner: RequestId| {
            move |e: KvError| ForwardError::Kv {
                index,
                owner,
                source: e,
            }
        };
        b.embed(&self.embedding, &s.tokens, &mut s.x)?;
        if c.gemma.is_some() {
            b.scale(&mut s.x, (c.dim as f32).sqrt())?;
        }
        // Every page this pass can read (what is written and the rows it
        // appends) checked once, under one lock, not once a layer.
        let pool = seqs[0].pool().clone();
        let reader = pool.reader();
        let check = {
            let all: Vec<&KvSeq<S>> = seqs.iter().map(|s| &**s).collect();
            reader
                .check_pass(&all, |i| s.spans.get(i).map_or(0, |sp| sp.rows))
                .map_err(|(i, e)| kv_err(i, seqs[i].owner())(e))?
        };
        for (li, layer) in self.layers.iter().enumerate() {
            let norm = |weight| Norm { weight, eps };
            let window = c.gemma.and_then(|g| g.window(li));
            b.norm_matmul_many(
                &s.x,
                norm(&layer.attn_norm),
                &mut s.xn,
                [&layer.wq, &layer.wk, &layer.wv],
                [&mut s.q, &mut s.k, &mut s.v],
            )?;
            if let Some(bq) = &layer.bq {
                b.add_bias(&mut s.q, bq)?;
            }
            if let Some(bk) = &layer.bk {
                b.add_bias(&mut s.k, bk)?;
            }
            if let Some(bv) = &layer.bv {
                b.add_bias(&mut s.v, bv)?;
            }
            // Per-head norms: the rows of q and k read as `[_, head_dim]`,
            // each normed by the head's gains (the same for every head).
            if let Some(g) = &layer.q_norm {
                b.rms_norm(&s.q, g, eps, &mut s.tmp)?;
                std::mem::swap(&mut s.q, &mut s.tmp);
            }
            if let Some(g) = &layer.k_norm {
                b.rms_norm(&s.k, g, eps, &mut s.tmp)?;
                std::mem::swap(&mut s.k, &mut s.tmp);
            }
            b.rope_qk_append_each(
                &mut s.q,
                &mut s.k,
                &s.v,
                &s.positions,
                rope(c.n_heads, window.is_some()),
                c.n_kv_heads,
                seqs,
                li,
                &s.spans,
            )
            .map_err(|(i, e)| match e {
                BackendError::Kv(k) => kv_err(i, seqs[i].owner())(k),
                other => ForwardError::Backend(other),
            })?;
            {
                let seq_views = reader
                    .pass_views(&check, seqs.iter().map(|s| &**s))
                    .map_err(|(i, e)| kv_err(i, seqs[i].owner())(e))?;
                let mut views = Vec::with_capacity(seqs.len());
                for (i, sv) in seq_views.iter().enumerate() {
                    views.push(sv.layer(li).map_err(kv_err(i, sv.owner()))?);
                }
                if let Some(f) = q_scale {
                    b.scale(&mut s.q, f)?;
                }
                match (decode, window) {
                    (true, None) => b.attention_decode(&s.q, &views, shape, &mut s.att)?,
                    (true, Some(w)) => {
                        b.attention_decode_window(&s.q, &views, shape, w, &mut s.att)?
                    }
                    (false, None) => {
                        b.attention_prefill(&s.q, &views, &s.spans, shape, &mut s.att)?
                    }
                    (false, Some(w)) => {
                        b.attention_prefill_window(&s.q, &views, &s.spans, shape, w, &mut s.att)?
                    }
                }
            }
            let post = layer.post_attn_norm.as_ref().map(norm);
            s.add_projection(b, false, &layer.wo, post)?;
            // Gemma's feed-forward is GELU-gated, Llama's SwiGLU.
            let (n, ffn) = (norm(&layer.ffn_norm), [&layer.w1, &layer.w3]);
            if c.gemma.is_some() {
                b.norm_matmul_many(&s.x, n, &mut s.xn, ffn, [&mut s.gate, &mut s.up])?;
                b.gelu_glu(&mut s.gate, &s.up)?;
            } else {
                b.norm_swiglu(&s.x, n, &mut s.xn, ffn, [&mut s.gate, &mut s.up])?;
            }
            let post = layer.post_ffn_norm.as_ref().map(norm);
            s.add_projection(b, true, &layer.w2, post)?;
        }
        s.out_rows.clear();
        match want {
            Want::LastOfEachSequence => s
                .out_rows
                .extend(s.spans.iter().map(|sp| sp.first_row + sp.rows - 1)),
            Want::Every => s.out_rows.extend(0..s.tokens.len()),
        }
        let output = self.lm_head.as_ref().unwrap_or(&self.embedding);
        b.logits(
            &s.x,
            &s.out_rows,
            &self.final_norm,
            eps,
            output,
            &mut s.tmp,
            &mut s.tmp2,
            &mut s.logits_dev,
        )?;
        if let Some(cap) = c.gemma.and_then(|g| g.final_logit_softcap) {
            b.softcap(&mut s.logits_dev, cap)?;
        }
        match out {
            Out::Logits => b.to_host(&s.logits_dev, &mut s.logits)?,
            Out::Tokens(draws) => b.sample(
                &s.logits_dev,
                c.vocab_size,
                draws,
                &mut s.sampled,
                &mut s.logprobs,
            )?,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_error_is_moved_to_its_place_in_the_whole_batch() {
        let kv = ForwardError::Kv {
            index: 2,
            owner: RequestId(9),
            source: KvError::LayerOutOfRange {
                layer: 7,
                n_layers: 5,
            },
        };
        assert_eq!(kv.shifted(5).culprit(), Some(7));
        assert_eq!(
            ForwardError::NoTokens { index: 0 }.shifted(3).culprit(),
            Some(3)
        );
        // Errors of the whole batch name no sequence, shifted or not.
        assert_eq!(ForwardError::EmptyBatch.shifted(3).culprit(), None);
    }
}
