//! The compute boundary: every operation a Llama forward pass needs, over
//! activations the backend owns and KV pages the [`crate::kv`] module owns.
//!
//! The model code (`model::Model`, the layer above) is written once against
//! [`Backend`]; [`CpuBackend`] implements it now, a CUDA backend later.
//! KV is reached only through the kv module's validated handles and views
//! ([`KvSeq`] to append, [`LayerView`] — a page table plus a written length —
//! to read), so a backend can neither read positions a sequence did not write
//! nor pages it does not own at their current generation.
//!
//! Shapes: activations are row-major f32 `[rows, cols]`, one row per token;
//! weight matrices are row-major `[out, in]` and `matmul` computes
//! `x · Wᵀ`. Every op checks the shapes it is given and answers a typed
//! [`BackendError`], never a panic.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub(crate) mod quant;
mod rope;

use std::ops::Range;

pub use crate::format::gguf::GgmlType;
pub use cpu::{CpuBackend, DEFAULT_PARALLEL_WORK, GROUP_WEIGHT_BYTES, Isa};
pub use error::BackendError;
pub use quant::{QuantError, QuantMatrix};
pub use rope::{InvalidRopeScaling, RopeScaling, RopeStyle};

use crate::kv::{KvSeq, LayerView, Writable};
use crate::sampling::{
    Draw, SamplingError, TokenLogprobs, sample_row, token_logprobs, with_row_scratch,
};

/// The queries of one sequence inside a batched activation buffer: rows
/// `first_row .. first_row + rows` hold positions `first_pos ..`, and each
/// query attends causally to its own sequence's positions `0 ..= pos`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    pub first_row: usize,
    pub rows: usize,
    pub first_pos: usize,
}

impl SeqSpan {
    /// Rows of this span in the batched buffer.
    pub fn row_range(&self) -> Range<usize> {
        self.first_row..self.first_row + self.rows
    }
    /// One past the last position this span's queries attend to.
    pub fn end_pos(&self) -> usize {
        self.first_pos + self.rows
    }
}

/// How the model runs one forward pass on a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassPlan {
    /// On the calling thread; ops may still split their own work (large
    /// models: each op's weight rows over the threads, so each weight is
    /// read once per step).
    Here,
    /// The batch's sequences split into this many groups of about equal
    /// rows, each a whole pass of its own, through [`Backend::run_groups`]:
    /// for models whose weights sit in cache, where one pass per thread
    /// beats splitting every small op.
    Groups(usize),
}

/// Head layout of attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Width of a query row.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    /// Width of a K (or V) row.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    fn check(&self) -> Result<(), BackendError> {
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || self.head_dim == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return Err(BackendError::Shape {
                op: "attention",
                what: "n_kv_heads must be non-zero and divide n_heads",
                expected: self.n_heads,
                got: self.n_kv_heads,
            });
        }
        Ok(())
    }
}

/// Rotary embedding parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    pub n_heads: usize,
    pub head_dim: usize,
    pub theta: f32,
    pub style: RopeStyle,
    pub scaling: RopeScaling,
}

impl Rope {
    /// Rotation frequency of pair `i` (see [`RopeScaling::inv_freq`]).
    pub fn inv_freq(&self, i: usize) -> f64 {
        self.scaling.inv_freq(self.theta, i, self.head_dim)
    }
}

/// An RMSNorm to apply ([`Backend::rms_norm`]'s weight and epsilon), for
/// the operations that may carry it in their pass.
#[derive(Debug)]
pub struct Norm<'a, M> {
    /// `[cols]`, one factor per element of a row.
    pub weight: &'a M,
    /// Added to the mean square before the square root.
    pub eps: f32,
}

impl<M> Clone for Norm<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M> Copy for Norm<'_, M> {}

/// The operations of a Llama forward pass.
///
/// Output buffers are sized by the op (grow-only: a reused buffer does not
/// reallocate once it is large enough). Nothing here schedules, allocates KV
/// pages or knows about requests; the orchestration lives above.
pub trait Backend: Send + Sync + 'static {
    /// An activation buffer: f32 `[rows, cols]`, where the backend computes.
    type Buf: Default + Send;
    /// A weight tensor placed on the backend: a matrix `[rows, cols]` or a
    /// vector (`rows == 1`).
    type Mat: Send + Sync;

    /// A short name for logs.
    fn name(&self) -> &'static str;

    /// True when this backend computes on KV pages that live at `r`: a
    /// worker refuses a pool whose pages live elsewhere. Default: host
    /// memory only.
    fn accepts_kv(&self, r: crate::kv::Residence) -> bool {
        r == crate::kv::Residence::Host
    }

    /// The KV pool a worker or engine built with `new` gets for `cfg`:
    /// its page bytes where this backend computes on them. Default: host
    /// memory ([`crate::KvPool::new`]); the CUDA backend gives device pages
    /// when asked to (`CudaBackend::device_kv`). A host that builds its own
    /// pool passes it to `with_pool` instead.
    fn new_pool(&self, cfg: crate::kv::PoolConfig) -> Result<crate::KvPool, crate::kv::PoolError> {
        crate::KvPool::new(cfg)
    }

    /// How to run a forward pass of `rows` token rows through a model of
    /// `weights` weight elements (see [`PassPlan`]). Default: here.
    fn plan_pass(&self, rows: usize, weights: usize) -> PassPlan {
        let _ = (rows, weights);
        PassPlan::Here
    }

    /// Runs the group passes of [`PassPlan::Groups`], concurrently where the
    /// backend can, and returns their results in order. A backend should
    /// not let the thread running one pick up other work meanwhile (with
    /// rayon: no nested parallelism inside a group, which could steal
    /// another group's whole pass and hold its caller up for it). Default:
    /// one after the other.
    fn run_groups<R: Send, F: FnOnce() -> R + Send>(&self, tasks: Vec<F>) -> Vec<R> {
        tasks.into_iter().map(|f| f()).collect()
    }

    /// Runs one whole forward pass (`f`) of `rows` token rows through
    /// `weights` weight elements where its ops split their work cheapest:
    /// a backend with a thread pool runs a pass large enough to split on
    /// one of the pool's threads, so that each op's split is a fork inside
    /// the pool rather than a hand-off from an outside thread and back.
    /// Default: here.
    fn run_pass<R: Send, F: FnOnce() -> R + Send>(&self, rows: usize, weights: usize, f: F) -> R {
        let _ = (rows, weights);
        f()
    }

    /// Refuses attention shapes this backend has no kernels for, when a
    /// model is placed, so that no request is admitted only to fail at its
    /// first pass. Default: every shape runs.
    fn supports(&self, shape: AttnShape) -> Result<(), BackendError> {
        let _ = shape;
        Ok(())
    }

    /// Refuses per-head q/k RMS norms (Qwen3: [`Backend::rms_norm`] over
    /// rows of `head_dim`) where this backend has not been checked to run
    /// them, when a model is placed. Default: they run.
    fn supports_qk_norm(&self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Refuses Gemma 3's block (the model layer's `Gemma`:
    /// [`Backend::scale`], [`Backend::gelu_glu`], [`Backend::softcap`] and
    /// windowed attention) where this backend has not been checked to run
    /// it, when a model is placed. Default: refused, as are those ops.
    fn supports_gemma(&self) -> Result<(), BackendError> {
        Err(no_gemma(self.name()))
    }

    /// `x *= by` (Gemma's embedding scale). Default: refused.
    fn scale(&self, x: &mut Self::Buf, by: f32) -> Result<(), BackendError> {
        let _ = (x, by);
        Err(no_gemma(self.name()))
    }

    /// GELU-gated feed-forward input: `gate = gelu_tanh(gate) ⊙ up`
    /// (Gemma's MLP). Default: refused.
    fn gelu_glu(&self, gate: &mut Self::Buf, up: &Self::Buf) -> Result<(), BackendError> {
        let _ = (gate, up);
        Err(no_gemma(self.name()))
    }

    /// Logit soft-capping: `x = cap · tanh(x / cap)`. Default: refused.
    fn softcap(&self, x: &mut Self::Buf, cap: f32) -> Result<(), BackendError> {
        let _ = (x, cap);
        Err(no_gemma(self.name()))
    }

    /// [`Backend::attention_prefill`] where each query at position `p`
    /// attends only to positions `p + 1 - window ..= p` (a local layer's
    /// sliding window). Default: refused.
    fn attention_prefill_window(
        &self,
        q: &Self::Buf,
        kv: &[LayerView<'_>],
        spans: &[SeqSpan],
        shape: AttnShape,
        window: usize,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        let _ = (q, kv, spans, shape, window, out);
        Err(no_gemma(self.name()))
    }

    /// [`Backend::attention_decode`] over the last `window` positions of
    /// each view. Default: refused.
    fn attention_decode_window(
        &self,
        q: &Self::Buf,
        kv: &[LayerView<'_>],
        shape: AttnShape,
        window: usize,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        let _ = (q, kv, shape, window, out);
        Err(no_gemma(self.name()))
    }

    /// Places a weight tensor (row-major `[rows, cols]`).
    fn upload(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<Self::Mat, BackendError>;

    /// Places a weight matrix kept in a ggml block format (a GGUF
    /// checkpoint's). Default: dequantized to f32 and [`Backend::upload`]ed;
    /// a backend with kernels for the format keeps it quantized.
    fn upload_quant(&self, q: QuantMatrix) -> Result<Self::Mat, BackendError> {
        let (rows, cols) = (q.rows(), q.cols());
        self.upload(q.dequantize(), rows, cols)
    }

    /// `(rows, cols)` of a placed tensor.
    fn shape(&self, m: &Self::Mat) -> (usize, usize);

    /// Bytes a placed tensor holds on the backend, spare capacity
    /// included. Default: f32 elements.
    fn mat_bytes(&self, m: &Self::Mat) -> usize {
        let (rows, cols) = self.shape(m);
        rows * cols * std::mem::size_of::<f32>()
    }

    /// Elements in an activation buffer.
    fn len(&self, buf: &Self::Buf) -> usize;

    /// Copies an activation buffer to host memory (`out` is resized).
    fn to_host(&self, buf: &Self::Buf, out: &mut Vec<f32>) -> Result<(), BackendError>;

    /// `out[i] = table[tokens[i]]`: `[tokens.len(), cols]`.
    fn embed(
        &self,
        table: &Self::Mat,
        tokens: &[u32],
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// Row-wise RMSNorm: `out = x / sqrt(mean(x²) + eps) ⊙ weight`, with
    /// `cols = weight.len()`.
    fn rms_norm(
        &self,
        x: &Self::Buf,
        weight: &Self::Mat,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// `out = x · Wᵀ` for `x: [rows, in]`, `W: [out, in]`. Each output
    /// element is computed the same way whatever the number of rows, so a
    /// sequence's result does not depend on what it is batched with.
    fn matmul(&self, x: &Self::Buf, w: &Self::Mat, out: &mut Self::Buf)
    -> Result<(), BackendError>;

    /// `outs[i] = x · ws[i]ᵀ` for products of one input (q, k and v; gate
    /// and up), each with the bits of its own [`Backend::matmul`]. A
    /// backend may run them in one pass.
    fn matmul_many<const N: usize>(
        &self,
        x: &Self::Buf,
        ws: [&Self::Mat; N],
        outs: [&mut Self::Buf; N],
    ) -> Result<(), BackendError> {
        for (w, out) in ws.into_iter().zip(outs) {
            self.matmul(x, w, out)?;
        }
        Ok(())
    }

    /// `outs[i] = RMSNorm(x) · ws[i]ᵀ` (q, k and v of the attention norm's
    /// output): the bits of [`Backend::rms_norm`] into `xn`, then
    /// [`Backend::matmul_many`] of `xn`. A backend may carry the norm in
    /// the products' pass; `xn` then holds nothing of use.
    fn norm_matmul_many<const N: usize>(
        &self,
        x: &Self::Buf,
        norm: Norm<'_, Self::Mat>,
        xn: &mut Self::Buf,
        ws: [&Self::Mat; N],
        outs: [&mut Self::Buf; N],
    ) -> Result<(), BackendError> {
        self.rms_norm(x, norm.weight, norm.eps, xn)?;
        self.matmul_many(xn, ws, outs)
    }

    /// The feed-forward's input: `gate = SwiGLU(RMSNorm(x) · w_gateᵀ,
    /// RMSNorm(x) · w_upᵀ)` with `ws = [w_gate, w_up]` and `outs = [gate,
    /// up]`: the bits of [`Backend::norm_matmul_many`] then
    /// [`Backend::swiglu`]. `xn` and `up` are scratch: a backend may carry
    /// the norm and the SwiGLU in the products' pass and leave them as
    /// they were.
    fn norm_swiglu(
        &self,
        x: &Self::Buf,
        norm: Norm<'_, Self::Mat>,
        xn: &mut Self::Buf,
        ws: [&Self::Mat; 2],
        outs: [&mut Self::Buf; 2],
    ) -> Result<(), BackendError> {
        let [gate, up] = outs;
        self.norm_matmul_many(x, norm, xn, ws, [&mut *gate, &mut *up])?;
        self.swiglu(gate, up)
    }

    /// `x += a · Wᵀ`: a projection added to the residual stream, with the
    /// bits of [`Backend::matmul`] into `tmp` followed by
    /// [`Backend::add_assign`]. A backend may do it in one pass and leave
    /// `tmp` as it was.
    fn matmul_add(
        &self,
        a: &Self::Buf,
        w: &Self::Mat,
        tmp: &mut Self::Buf,
        x: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        self.matmul(a, w, tmp)?;
        self.add_assign(x, tmp)
    }

    /// `x[r] += bias` for every row.
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Mat) -> Result<(), BackendError>;

    /// `x += y` (the residual connection).
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<(), BackendError>;

    /// Rotary embedding of `x: [positions.len(), n_heads * head_dim]`, row
    /// `i` rotated for position `positions[i]`.
    fn rope(&self, x: &mut Self::Buf, positions: &[usize], rope: Rope) -> Result<(), BackendError>;

    /// [`Backend::rope`] of `q` with `rope` and of `k` with `rope` for
    /// `k_heads` heads: the same rotation of each row's position, each with
    /// the bits of its own call. A backend may do both in one pass.
    fn rope_qk(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        positions: &[usize],
        rope: Rope,
        k_heads: usize,
    ) -> Result<(), BackendError> {
        self.rope(q, positions, rope)?;
        self.rope(
            k,
            positions,
            Rope {
                n_heads: k_heads,
                ..rope
            },
        )
    }

    /// SwiGLU: `gate = silu(gate) ⊙ up`.
    fn swiglu(&self, gate: &mut Self::Buf, up: &Self::Buf) -> Result<(), BackendError>;

    /// `out[i] = x[rows[i]]` for `x: [_, cols]`.
    fn gather_rows(
        &self,
        x: &Self::Buf,
        cols: usize,
        rows: &[usize],
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// Appends rows `rows` of `k` and `v` (`[_, kv_dim]`) to `layer` of `seq`,
    /// at its next positions. Bounded by the sequence's reservation.
    fn kv_append<S: Writable>(
        &self,
        seq: &mut KvSeq<S>,
        layer: usize,
        k: &Self::Buf,
        v: &Self::Buf,
        rows: Range<usize>,
    ) -> Result<(), BackendError>;

    /// [`Backend::kv_append`] for every sequence of a pass: `seqs[i]` gets
    /// rows `spans[i].row_range()` of `k` and `v`. An error names the
    /// sequence. Default: one `kv_append` per sequence.
    fn kv_append_each<S: Writable>(
        &self,
        seqs: &mut [&mut KvSeq<S>],
        layer: usize,
        k: &Self::Buf,
        v: &Self::Buf,
        spans: &[SeqSpan],
    ) -> Result<(), (usize, BackendError)> {
        for (i, (seq, span)) in seqs.iter_mut().zip(spans).enumerate() {
            self.kv_append(seq, layer, k, v, span.row_range())
                .map_err(|e| (i, e))?;
        }
        Ok(())
    }

    /// [`Backend::rope_qk`] of `q` and `k` for the pass's `positions`,
    /// then [`Backend::kv_append_each`] of the rotated `k` and of `v`: the
    /// same bits in `q`, `k` and the pages. A backend may do both in one
    /// pass. An error that is not a sequence's names sequence 0 (it is
    /// never [`BackendError::Kv`]).
    #[allow(clippy::too_many_arguments)]
    fn rope_qk_append_each<S: Writable>(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        positions: &[usize],
        rope: Rope,
        k_heads: usize,
        seqs: &mut [&mut KvSeq<S>],
        layer: usize,
        spans: &[SeqSpan],
    ) -> Result<(), (usize, BackendError)> {
        self.rope_qk(q, k, positions, rope, k_heads)
            .map_err(|e| (0, e))?;
        self.kv_append_each(seqs, layer, k, v, spans)
    }

    /// Causal attention for many query positions per sequence (prefill):
    /// `q: [rows, q_dim]`, span `s` reads `kv[s]`, which must already hold
    /// every position up to `spans[s].end_pos()`. `out: [rows, q_dim]`.
    fn attention_prefill(
        &self,
        q: &Self::Buf,
        kv: &[LayerView<'_>],
        spans: &[SeqSpan],
        shape: AttnShape,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// Attention for one query per sequence (decode), batched over
    /// sequences: row `i` of `q` is the newest position of `kv[i]` and
    /// attends to all of its written positions.
    fn attention_decode(
        &self,
        q: &Self::Buf,
        kv: &[LayerView<'_>],
        shape: AttnShape,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// Chooses one token per row of `logits` (`[draws.len(), vocab]`), each
    /// by its draw and [`crate::sampling::sample_row`]'s rule, into `out`
    /// (cleared first): a row whose logits are not all finite gets its
    /// [`SamplingError`] and harms no other row. When any draw asks for
    /// log-probabilities ([`Draw::logprobs`]), `logprobs` gets one entry per
    /// row ([`crate::sampling::token_logprobs`] of its token, `None` where
    /// the row did not ask or failed); otherwise it is left empty. Default:
    /// the logits copied to the host and sampled there. A backend samples
    /// where its logits are (the CUDA backend on the device, so only token
    /// ids and the log-probabilities asked for cross).
    fn sample(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        draws: &[Draw],
        out: &mut Vec<Result<u32, SamplingError>>,
        logprobs: &mut Vec<Option<TokenLogprobs>>,
    ) -> Result<(), BackendError> {
        // One host buffer per thread, reused step after step.
        HOST_LOGITS.with_borrow_mut(|host| {
            self.to_host(logits, host)?;
            sample_host(host, vocab, draws, out, logprobs, false)
        })
    }

    /// Output logits of selected rows: `rms_norm(x[rows]) · Wᵀ`, `[rows.len(),
    /// vocab]`. `tmp` and `tmp2` are scratch.
    #[allow(clippy::too_many_arguments)]
    fn logits(
        &self,
        x: &Self::Buf,
        rows: &[usize],
        norm: &Self::Mat,
        eps: f32,
        output: &Self::Mat,
        tmp: &mut Self::Buf,
        tmp2: &mut Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        let cols = self.shape(norm).1;
        // Every row of x in order (a decode step's): the norm reads x
        // itself, a gather (and its launch) fewer.
        let every_row =
            self.len(x) == rows.len() * cols && rows.iter().enumerate().all(|(i, &r)| i == r);
        if every_row {
            self.rms_norm(x, norm, eps, tmp2)?;
        } else {
            self.gather_rows(x, cols, rows, tmp)?;
            self.rms_norm(tmp, norm, eps, tmp2)?;
        }
        self.matmul(tmp2, output, out)
    }
}

thread_local! {
    /// The default [`Backend::sample`]'s copy of the logits.
    static HOST_LOGITS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`Backend::sample`] over logits in host memory: the tokens, then the
/// log-probabilities asked for, the rows split over the current rayon pool
/// when `parallel`.
pub(crate) fn sample_host(
    logits: &[f32],
    vocab: usize,
    draws: &[Draw],
    out: &mut Vec<Result<u32, SamplingError>>,
    logprobs: &mut Vec<Option<TokenLogprobs>>,
    parallel: bool,
) -> Result<(), BackendError> {
    sample_host_rows(logits, vocab, draws, out, parallel)?;
    host_logprobs(logits, vocab, draws, out, logprobs, parallel);
    Ok(())
}

/// The tokens of [`sample_host`], the rows split over the current rayon pool
/// when `parallel` (each row is drawn by its own rule from its own logits,
/// so the split changes no token).
fn sample_host_rows(
    logits: &[f32],
    vocab: usize,
    draws: &[Draw],
    out: &mut Vec<Result<u32, SamplingError>>,
    parallel: bool,
) -> Result<(), BackendError> {
    if vocab == 0 || logits.len() != draws.len().saturating_mul(vocab) {
        return Err(shape_err(
            "sample",
            "logits ([draws, vocab])",
            draws.len().saturating_mul(vocab),
            logits.len(),
        ));
    }
    let one = |(row, d): (&[f32], &Draw)| with_row_scratch(|s| sample_row(row, d, s));
    if parallel {
        use rayon::prelude::*;
        logits
            .par_chunks_exact(vocab)
            .zip(draws)
            .map(one)
            .collect_into_vec(out);
    } else {
        out.clear();
        out.extend(logits.chunks_exact(vocab).zip(draws).map(one));
    }
    Ok(())
}

/// The log-probabilities of [`sample_host`], from logits already sampled
/// into `tokens` (so the shapes hold); the rows split over the current
/// rayon pool when `parallel`.
fn host_logprobs(
    logits: &[f32],
    vocab: usize,
    draws: &[Draw],
    tokens: &[Result<u32, SamplingError>],
    out: &mut Vec<Option<TokenLogprobs>>,
    parallel: bool,
) {
    out.clear();
    if draws.iter().all(|d| d.logprobs().is_none()) {
        return;
    }
    let one =
        |((row, d), t): ((&[f32], &Draw), &Result<u32, SamplingError>)| match (d.logprobs(), t) {
            (Some(top), Ok(t)) => Some(token_logprobs(row, *t, top as usize)),
            _ => None,
        };
    if parallel {
        use rayon::prelude::*;
        logits
            .par_chunks_exact(vocab.max(1))
            .zip(draws)
            .zip(tokens)
            .map(one)
            .collect_into_vec(out);
    } else {
        out.extend(
            logits
                .chunks_exact(vocab.max(1))
                .zip(draws)
                .zip(tokens)
                .map(one),
        );
    }
}

/// The refusal of Gemma's ops by a backend that has not implemented them.
fn no_gemma(backend: &'static str) -> BackendError {
    BackendError::Unsupported {
        what: "Gemma 3 models",
        detail: format!(
            "(the {backend} backend has no kernels for windowed attention, GELU gating, \
             scaling and soft-capping; serve Gemma on the CPU backend)"
        ),
    }
}

/// A shape error of `op`.
pub(crate) fn shape_err(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> BackendError {
    BackendError::Shape {
        op,
        what,
        expected,
        got,
    }
}

/// `len` values make one RoPE row of `row_len` per position.
pub(crate) fn check_rope_rows(
    len: usize,
    positions: &[usize],
    row_len: usize,
) -> Result<(), BackendError> {
    let rows = rows_of("rope", len, row_len)?;
    if rows != positions.len() {
        return Err(shape_err(
            "rope",
            "one position per row",
            rows,
            positions.len(),
        ));
    }
    Ok(())
}

/// Rows of a buffer of `len` elements given `cols`; errors unless `len` is a
/// multiple of `cols`.
pub(crate) fn rows_of(op: &'static str, len: usize, cols: usize) -> Result<usize, BackendError> {
    if cols == 0 || !len.is_multiple_of(cols) {
        return Err(shape_err(
            op,
            "buffer length (multiple of the row width)",
            cols,
            len,
        ));
    }
    Ok(len / cols)
}

/// Checks that `view` has the attention's KV row width and holds at least
/// `needed` written positions (span `span` of the batch).
pub(crate) fn check_view(
    view: &LayerView<'_>,
    shape: AttnShape,
    span: usize,
    needed: usize,
) -> Result<(), BackendError> {
    if view.kv_dim() != shape.kv_dim() {
        return Err(shape_err(
            "attention",
            "KV row width (n_kv_heads * head_dim)",
            shape.kv_dim(),
            view.kv_dim(),
        ));
    }
    if view.len() < needed {
        return Err(BackendError::KvNotWritten {
            span,
            needed,
            written: view.len(),
        });
    }
    Ok(())
}
