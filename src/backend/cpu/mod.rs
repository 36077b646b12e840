//! The CPU backend: f32 compute, KV read straight from the pool's pages.
//!
//! Small ops run on the calling thread (no pool hand-off, no allocation once
//! the buffers have grown); matmuls and attention big enough to pay for it
//! are split over a private rayon pool.

mod attend;
mod attention;
mod fastmath;
mod flash;
mod isa;
mod kernel;
mod mat;
pub(crate) mod matmul;
mod ops;
mod pass;
mod quant;
mod window;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;
#[cfg(target_arch = "x86_64")]
mod x86_blocks;
#[cfg(target_arch = "x86_64")]
mod x86_drive;
#[cfg(target_arch = "x86_64")]
mod x86_hd8;
#[cfg(target_arch = "x86_64")]
mod x86_quant;

use std::ops::Range;

pub use isa::Isa;
// The CUDA backend places 16-bit weights by the CPU's rule.
#[cfg(feature = "cuda")]
pub(crate) use kernel::{Bf16, F16};
pub use mat::CpuMat;
#[cfg(feature = "cuda")]
pub(crate) use mat::exact_in;

use crate::backend::QuantMatrix;
use crate::backend::{
    AttnShape, Backend, BackendError, PassPlan, Rope, SeqSpan, check_rope_rows, rows_of, shape_err,
};
use crate::kv::{KvSeq, LayerView, Writable};

/// Multiply-adds below which an op stays on the calling thread by default:
/// handing work to the pool and joining costs tens of microseconds on a
/// busy machine.
pub const DEFAULT_PARALLEL_WORK: usize = 1 << 18;

/// Models with at most this many bytes of f32 weights run a batch as one
/// whole pass per thread ([`PassPlan::Groups`]): their weights stay in cache,
/// so each thread reading all of them costs little, while splitting each
/// small op would pay a hand-off per op. Larger models split each op's
/// weight rows over the threads instead, so each weight is read once.
pub const GROUP_WEIGHT_BYTES: usize = 8 << 20;

/// The CPU backend. Cheap to share (`&CpuBackend` is `Sync`).
///
/// All of its ops use one instruction set for its whole life, so results are
/// reproducible for a backend; the portable and AVX2+FMA sets round
/// differently in the last bits.
pub struct CpuBackend {
    pool: Option<rayon::ThreadPool>,
    threads: usize,
    /// Validated against the CPU: `Avx2Fma` only when it is supported.
    isa: Isa,
    min_parallel_work: usize,
    group_weight_bytes: usize,
    compact_weights: bool,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .field("isa", &self.isa)
            .finish()
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// Logits in a batch from which sampling splits its rows over the threads
/// (below, one thread samples them in well under a millisecond).
const PARALLEL_SAMPLE_LOGITS: usize = 1 << 18;

impl CpuBackend {
    /// A backend using every available core.
    pub fn new() -> Self {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_threads(n)
    }

    /// A backend using `threads` threads (1: everything on the caller's
    /// thread) and the best instruction set of this CPU. Falls back to one
    /// thread if a pool cannot be built.
    pub fn with_threads(threads: usize) -> Self {
        Self::build(threads, Isa::detect())
    }

    /// A backend using `isa`, refused when this CPU lacks it.
    pub fn with_isa(threads: usize, isa: Isa) -> Result<Self, BackendError> {
        if !Isa::available().contains(&isa) {
            return Err(BackendError::Device(format!(
                "this CPU does not support {isa:?}"
            )));
        }
        Ok(Self::build(threads, isa))
    }

    fn build(threads: usize, isa: Isa) -> Self {
        let threads = threads.max(1);
        let pool = if threads > 1 {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("handoff-cpu-{i}"))
                .build()
                .ok()
        } else {
            None
        };
        let threads = if pool.is_some() { threads } else { 1 };
        CpuBackend {
            pool,
            threads,
            isa,
            min_parallel_work: DEFAULT_PARALLEL_WORK,
            group_weight_bytes: GROUP_WEIGHT_BYTES,
            compact_weights: true,
        }
    }

    /// The instruction set of the kernels.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Threads used for large ops.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Ops with fewer multiply-adds than this run on the calling thread
    /// (default [`DEFAULT_PARALLEL_WORK`]).
    #[must_use]
    pub fn min_parallel_work(mut self, macs: usize) -> Self {
        self.min_parallel_work = macs.max(1);
        self
    }

    /// Whether a weight matrix whose every element is exactly a bf16 value
    /// (one loaded from a bf16 checkpoint) is kept as bf16, and one whose
    /// every element is exactly an f16 value as f16 (default: yes).
    /// It then takes half the memory, and a decode step that streams the
    /// weights from memory reads half the bytes; every kernel widens each
    /// element exactly before the same arithmetic, so the numbers are the
    /// same bit for bit. Matrices packed for short dot products, vectors,
    /// and anything with one inexact element stay f32.
    #[must_use]
    pub fn compact_weights(mut self, on: bool) -> Self {
        self.compact_weights = on;
        self
    }

    /// Models with at most this many bytes of f32 weights run batches as
    /// one pass per thread, larger ones split each op (default
    /// [`GROUP_WEIGHT_BYTES`]; 0: always split ops).
    #[must_use]
    pub fn group_weight_bytes(mut self, bytes: usize) -> Self {
        self.group_weight_bytes = bytes;
        self
    }
}

fn resize(buf: &mut Vec<f32>, len: usize) {
    // Grow-only capacity: shrinking the length keeps the allocation.
    buf.resize(len, 0.0);
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Mat = CpuMat;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn plan_pass(&self, rows: usize, weights: usize) -> PassPlan {
        self.plan(rows, weights)
    }

    fn run_pass<R: Send, F: FnOnce() -> R + Send>(&self, rows: usize, weights: usize, f: F) -> R {
        self.pass(rows, weights, f)
    }

    fn run_groups<R: Send, F: FnOnce() -> R + Send>(&self, tasks: Vec<F>) -> Vec<R> {
        self.groups(tasks)
    }

    fn upload(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<CpuMat, BackendError> {
        self.upload_f32(data, rows, cols)
    }

    fn upload_quant(&self, q: QuantMatrix) -> Result<CpuMat, BackendError> {
        self.upload_blocks(q)
    }

    fn shape(&self, m: &CpuMat) -> (usize, usize) {
        (m.rows, m.cols)
    }

    fn mat_bytes(&self, m: &CpuMat) -> usize {
        Self::held_bytes(m)
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    /// Samples the logits where they are (no copy), the rows of a large
    /// batch over the threads: each row is drawn by its own rule from its
    /// own logits, so the split changes no token.
    fn sample(
        &self,
        logits: &Vec<f32>,
        vocab: usize,
        draws: &[crate::sampling::Draw],
        out: &mut Vec<Result<u32, crate::sampling::SamplingError>>,
        logprobs: &mut Vec<Option<crate::sampling::TokenLogprobs>>,
    ) -> Result<(), BackendError> {
        let pool = self.pool.as_ref().filter(|_| {
            !Self::in_group() && draws.len() > 1 && logits.len() >= PARALLEL_SAMPLE_LOGITS
        });
        let mut run = |parallel| super::sample_host(logits, vocab, draws, out, logprobs, parallel);
        match pool {
            Some(pool) => pool.install(|| run(true)),
            None => run(false),
        }
    }

    fn to_host(&self, buf: &Vec<f32>, out: &mut Vec<f32>) -> Result<(), BackendError> {
        out.clear();
        out.extend_from_slice(buf);
        Ok(())
    }

    fn embed(
        &self,
        table: &CpuMat,
        tokens: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.embed_rows(table, tokens, out)
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        weight: &CpuMat,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        // Vectors are never compacted; `data` borrows.
        let weight = weight.data();
        let d = weight.len();
        rows_of("rms_norm", x.len(), d)?;
        resize(out, x.len());
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            match self.isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the
                // CPU reported AVX2 and FMA.
                Isa::Avx2Fma | Isa::Avx512 => unsafe { x86::rms_norm_row(xr, &weight, eps, or) },
                _ => ops::rms_norm_row(xr, &weight, eps, or),
            }
        }
        Ok(())
    }

    fn matmul(&self, x: &Vec<f32>, w: &CpuMat, out: &mut Vec<f32>) -> Result<(), BackendError> {
        self.matmul_mat(x, w, out)
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &CpuMat) -> Result<(), BackendError> {
        // Vectors are never compacted; `data` borrows.
        let bias = bias.data();
        let d = bias.len();
        rows_of("add_bias", x.len(), d)?;
        for r in x.chunks_exact_mut(d) {
            for (v, b) in r.iter_mut().zip(bias.iter()) {
                *v += b;
            }
        }
        Ok(())
    }

    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<(), BackendError> {
        if x.len() != y.len() {
            return Err(shape_err("add_assign", "lengths", x.len(), y.len()));
        }
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
        Ok(())
    }

    fn rope(&self, x: &mut Vec<f32>, positions: &[usize], rope: Rope) -> Result<(), BackendError> {
        let width = rope.n_heads * rope.head_dim;
        if !rope.head_dim.is_multiple_of(2) {
            return Err(shape_err("rope", "even head_dim", 2, rope.head_dim));
        }
        check_rope_rows(x.len(), positions, width)?;
        ops::rope_rows(self.isa, x, positions, rope);
        Ok(())
    }

    fn swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>) -> Result<(), BackendError> {
        if gate.len() != up.len() {
            return Err(shape_err("swiglu", "lengths", gate.len(), up.len()));
        }
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the CPU
            // reported AVX2 and FMA.
            Isa::Avx2Fma | Isa::Avx512 => unsafe { x86::swiglu(gate, up) },
            _ => ops::swiglu(gate, up),
        }
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &Vec<f32>,
        cols: usize,
        rows: &[usize],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let n = rows_of("gather_rows", x.len(), cols)?;
        resize(out, rows.len() * cols);
        for (i, &r) in rows.iter().enumerate() {
            if r >= n {
                return Err(shape_err("gather_rows", "row index below", n, r));
            }
            out[i * cols..(i + 1) * cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
        }
        Ok(())
    }

    fn kv_append<S: Writable>(
        &self,
        seq: &mut KvSeq<S>,
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        rows: Range<usize>,
    ) -> Result<(), BackendError> {
        if rows.start > rows.end {
            let e = shape_err("kv_append", "row range start <= end", rows.end, rows.start);
            return Err(e);
        }
        let span = SeqSpan {
            first_row: rows.start,
            rows: rows.len(),
            first_pos: 0,
        };
        self.kv_append_each(&mut [seq], layer, k, v, &[span])
            .map_err(|(_, e)| e)
    }

    fn kv_append_each<S: Writable>(
        &self,
        seqs: &mut [&mut KvSeq<S>],
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        spans: &[SeqSpan],
    ) -> Result<(), (usize, BackendError)> {
        let Some(first) = seqs.first() else {
            return Ok(());
        };
        let kvd = first.pool().config().geometry().kv_dim();
        let n = rows_of("kv_append", k.len(), kvd).map_err(|e| (0, e))?;
        if v.len() != k.len() {
            let e = shape_err("kv_append", "V length (= K length)", k.len(), v.len());
            return Err((0, e));
        }
        if spans.len() != seqs.len() {
            let e = shape_err(
                "kv_append",
                "one span per sequence",
                seqs.len(),
                spans.len(),
            );
            return Err((0, e));
        }
        if let Some(i) = spans.iter().position(|s| s.first_row + s.rows > n) {
            let end = spans[i].first_row + spans[i].rows;
            return Err((i, shape_err("kv_append", "row range within", n, end)));
        }
        KvSeq::append_each(layer, seqs, |i| {
            let r = spans[i].first_row * kvd..(spans[i].first_row + spans[i].rows) * kvd;
            (&k[r.clone()], &v[r])
        })
        .map_err(|(i, e)| (i, BackendError::Kv(e)))
    }

    fn attention_prefill(
        &self,
        q: &Vec<f32>,
        kv: &[LayerView<'_>],
        spans: &[SeqSpan],
        shape: AttnShape,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.prefill_attention(q, kv, spans, shape, None, out)
    }

    fn attention_decode(
        &self,
        q: &Vec<f32>,
        kv: &[LayerView<'_>],
        shape: AttnShape,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.decode_attention(q, kv, shape, None, out)
    }

    fn supports_gemma(&self) -> Result<(), BackendError> {
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, by: f32) -> Result<(), BackendError> {
        ops::scale(x, by);
        Ok(())
    }

    fn gelu_glu(&self, gate: &mut Vec<f32>, up: &Vec<f32>) -> Result<(), BackendError> {
        if gate.len() != up.len() {
            return Err(shape_err("gelu_glu", "lengths", gate.len(), up.len()));
        }
        ops::gelu_glu(gate, up);
        Ok(())
    }

    fn softcap(&self, x: &mut Vec<f32>, cap: f32) -> Result<(), BackendError> {
        ops::softcap(x, cap);
        Ok(())
    }

    fn attention_prefill_window(
        &self,
        q: &Vec<f32>,
        kv: &[LayerView<'_>],
        spans: &[SeqSpan],
        shape: AttnShape,
        window: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.prefill_attention(q, kv, spans, shape, Some(window), out)
    }

    fn attention_decode_window(
        &self,
        q: &Vec<f32>,
        kv: &[LayerView<'_>],
        shape: AttnShape,
        window: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.decode_attention(q, kv, shape, Some(window), out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_sampled_over_the_threads_draws_each_rows_own_token() {
        use crate::sampling::{Draw, RowScratch, sample_row};
        let (rows, vocab) = (9, 40_000);
        let mut x = 0x2026u64;
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 1000) as f32 * 0.01
            })
            .collect();
        let draws: Vec<Draw> = (0..rows)
            .map(|i| {
                let p = crate::SamplingParams {
                    temperature: [0.0, 0.7, 1.3][i % 3],
                    top_k: (i % 2 == 0).then_some(50),
                    top_p: (i % 4 != 3).then_some(0.9),
                    seed: i as u64,
                    stop_ids: Vec::new(),
                    logprobs: None,
                };
                Draw::new(&p, x.wrapping_mul(i as u64 + 1)).unwrap()
            })
            .collect();
        let want: Vec<_> = logits
            .chunks_exact(vocab)
            .zip(&draws)
            .map(|(r, d)| sample_row(r, d, &mut RowScratch::default()))
            .collect();
        for threads in [1, 2, 4] {
            let mut got = Vec::new();
            CpuBackend::with_threads(threads)
                .sample(&logits, vocab, &draws, &mut got, &mut Vec::new())
                .unwrap();
            assert_eq!(got, want, "{threads} threads");
        }
        let mut got = Vec::new();
        let short = CpuBackend::with_threads(2).sample(
            &logits[1..].to_vec(),
            vocab,
            &draws,
            &mut got,
            &mut Vec::new(),
        );
        assert!(short.is_err(), "a batch of the wrong shape is refused");
    }
}
