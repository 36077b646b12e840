//! The CPU backend: f32 compute, KV read straight from the pool's pages.
//!
//! Small ops run on the calling thread (no pool hand-off, no allocation once
//! the buffers have grown); matmuls and attention big enough to pay for it
//! are split over a private rayon pool.

mod attend;
mod attention;
mod fastmath;
mod flash;
mod kernel;
pub(crate) use kernel::{Bf16, F16};
pub(crate) mod matmul;
mod ops;
mod quant;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_blocks;
#[cfg(target_arch = "x86_64")]
mod x86_blocks512;
#[cfg(target_arch = "x86_64")]
mod x86_quant;
#[cfg(target_arch = "x86_64")]
mod x86_quant512;

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::backend::QuantMatrix;
use crate::backend::cpu::kernel::{Elem, Half, WeightRows};
use crate::backend::{
    AttnShape, Backend, BackendError, PassPlan, Rope, SeqSpan, check_rope_rows, check_view,
    rows_of, shape_err,
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

/// Fewest token rows worth a group of their own.
const MIN_GROUP_ROWS: usize = 4;

/// A weight tensor in host memory.
#[derive(Debug, Clone)]
pub struct CpuMat {
    data: Stored,
    rows: usize,
    cols: usize,
    /// The same weights in column panels for the AVX2 kernel of short dot
    /// products (see [`matmul::pack`]); `None` where the row-major tiles
    /// are used.
    packed: Option<Vec<f32>>,
}

/// How a matrix's row-major elements are kept.
#[derive(Debug, Clone)]
enum Stored {
    F32(Vec<f32>),
    /// Every element was exactly a bf16 value (a bf16 checkpoint): the
    /// upper halves only, widened back exactly by every kernel.
    Bf16(Vec<Bf16>),
    /// Every element was exactly an f16 value (an f16 checkpoint).
    F16(Vec<F16>),
    /// A ggml block format (a GGUF checkpoint's), dequantized tile by tile
    /// inside the matmul.
    Quant(QuantMatrix),
    /// Q8_0 or Q4_1 with the scales out of the blocks, for the AVX2
    /// kernels (see [`quant::SplitQuant`]).
    Split(quant::SplitQuant),
}

impl CpuMat {
    /// The row-major elements (widened to f32, a copy, when kept as bf16).
    pub fn data(&self) -> Cow<'_, [f32]> {
        match &self.data {
            Stored::F32(v) => Cow::Borrowed(v),
            Stored::Bf16(v) => Cow::Owned(v.iter().map(|b| b.f32()).collect()),
            Stored::F16(v) => Cow::Owned(v.iter().map(|h| h.f32()).collect()),
            Stored::Quant(q) => Cow::Owned(q.dequantize()),
            Stored::Split(q) => Cow::Owned(q.dequantize()),
        }
    }

    /// How the elements are kept: 4 bytes (f32), or 2 when every element
    /// was exactly a bf16 or an f16 value, so nothing was rounded (see
    /// [`CpuBackend::compact_weights`]); 0 for a ggml block format, whose
    /// elements take a fraction of a byte ([`CpuMat::quant_type`]).
    pub fn bytes_per_element(&self) -> usize {
        match self.data {
            Stored::F32(_) => 4,
            Stored::Bf16(_) | Stored::F16(_) => 2,
            Stored::Quant(_) | Stored::Split(_) => 0,
        }
    }

    /// The ggml block format the matrix is kept in, if it is quantized.
    pub fn quant_type(&self) -> Option<crate::backend::GgmlType> {
        match &self.data {
            Stored::Quant(q) => Some(q.ggml_type()),
            Stored::Split(q) => Some(q.ggml_type()),
            _ => None,
        }
    }

    /// Calls `f` with the row-major weights as stored.
    fn with_rows<R>(&self, f: impl FnOnce(Rows<'_>) -> R) -> R {
        match &self.data {
            Stored::F32(v) => f(Rows::Plain(WeightRows::F32(v))),
            Stored::Bf16(v) => f(Rows::Plain(WeightRows::Bf16(v))),
            Stored::F16(v) => f(Rows::Plain(WeightRows::F16(v))),
            Stored::Quant(q) => f(Rows::Quant(q)),
            Stored::Split(q) => f(Rows::Split(q)),
        }
    }
}

/// A matrix's rows as the matmul reads them.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Plain(WeightRows<'a>),
    Quant(&'a QuantMatrix),
    Split(&'a quant::SplitQuant),
}

impl Rows<'_> {
    /// `matmul::matmul_cols` over these rows.
    #[allow(clippy::too_many_arguments)]
    fn matmul_cols(
        self,
        isa: Isa,
        x: &[f32],
        m: usize,
        k: usize,
        cols: Range<usize>,
        out: &mut [f32],
        row_stride: usize,
        col_stride: usize,
    ) {
        match self {
            Rows::Plain(w) => {
                matmul::matmul_cols(isa, x, m, k, w, cols, out, row_stride, col_stride)
            }
            Rows::Quant(q) => {
                quant::matmul_cols_quant(isa, x, m, k, q, cols, out, row_stride, col_stride)
            }
            Rows::Split(q) => {
                quant::matmul_cols_split(isa, x, m, k, q, cols, out, row_stride, col_stride)
            }
        }
    }
}

/// The instruction set the CPU kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Baseline code for the target (SSE2 on x86-64).
    Portable,
    /// AVX2 with fused multiply-add (x86-64 CPUs since ~2013), and F16C
    /// (which every such CPU has) to widen f16 weights.
    Avx2Fma,
    /// Everything of [`Isa::Avx2Fma`], and AVX-512 (F, BW, DQ, VL): the
    /// quantized decode kernels (Q8_0 and Q4_1 at one to eight activation
    /// rows, the other block types at five to eight) run 16 lanes wide, two
    /// weight rows at once. The same bits as `Avx2Fma`: each lane does the
    /// same operations in the same order.
    Avx512,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512dq")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return Isa::Avx512;
            }
            return Isa::Avx2Fma;
        }
        Isa::Portable
    }

    /// Every instruction set this CPU supports.
    pub fn available() -> Vec<Isa> {
        match Isa::detect() {
            Isa::Portable => vec![Isa::Portable],
            Isa::Avx2Fma => vec![Isa::Portable, Isa::Avx2Fma],
            Isa::Avx512 => vec![Isa::Portable, Isa::Avx2Fma, Isa::Avx512],
        }
    }

    /// Whether the AVX2, FMA and F16C kernels may run (a backend holds
    /// such an `Isa` only after the CPU reported those features).
    pub(crate) fn avx2(self) -> bool {
        matches!(self, Isa::Avx2Fma | Isa::Avx512)
    }
}

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

thread_local! {
    static TRANSPOSED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Set while this thread runs a group pass: its ops stay serial.
    static SERIAL_OPS: Cell<bool> = const { Cell::new(false) };
}

/// Logits in a batch from which sampling splits its rows over the threads
/// (below, one thread samples them in well under a millisecond).
const PARALLEL_SAMPLE_LOGITS: usize = 1 << 18;

/// Longest a worker polls without finding work before it goes back to
/// sleeping until woken: a pass stuck in a long serial stretch (or a
/// machine with more runnable threads than cores) does not keep it busy.
const POLL_IDLE: std::time::Duration = std::time::Duration::from_micros(500);

/// Runs the pool's pending work on this worker as soon as there is any,
/// until `done`: a worker that sleeps when idle takes tens of microseconds
/// to wake, once per op of a pass, which on two cores cost a quarter of a
/// decode step. Between polls it yields its core to any other runnable
/// thread, and it gives up after [`POLL_IDLE`] without work. Returns at
/// once on the thread running the pass itself (which could pick this job
/// up while it waits), so it never waits for its own end.
fn poll_until(done: &AtomicBool, pass_thread: Option<usize>) {
    if rayon::current_thread_index() == pass_thread {
        return;
    }
    let mut idle_since = std::time::Instant::now();
    let mut polls = 0u32;
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            polls = 0;
            idle_since = std::time::Instant::now();
            continue;
        }
        polls += 1;
        if polls < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
            if polls.is_multiple_of(64) && idle_since.elapsed() > POLL_IDLE {
                return;
            }
        }
    }
}

/// Sets its flag when dropped, so a pass that unwinds still ends the
/// workers polling for it.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Marks this thread as running a group pass until dropped (restoring the
/// previous mark, so nesting and unwinding leave it right).
struct SerialOps(bool);

impl SerialOps {
    fn enter() -> Self {
        SerialOps(SERIAL_OPS.replace(true))
    }
}

impl Drop for SerialOps {
    fn drop(&mut self) {
        SERIAL_OPS.set(self.0);
    }
}

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

    /// The pool, when `work` multiply-adds are worth splitting.
    fn par_pool(&self, work: usize) -> Option<&rayon::ThreadPool> {
        self.pool
            .as_ref()
            .filter(|_| work >= self.min_parallel_work && !SERIAL_OPS.get())
    }

    /// Whether a pass of `rows` token rows through `weights` weight
    /// elements is large enough for any of its ops to split over threads.
    fn splits(&self, rows: usize, weights: usize) -> bool {
        self.pool.is_some() && rows.saturating_mul(weights) >= 4 * self.min_parallel_work
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

/// `data` in the 16-bit format `H` when every element is exactly such a
/// value (the CUDA backend places 16-bit weights by the same rule).
pub(crate) fn exact_in<H: Half>(data: &[f32]) -> Option<Vec<H>> {
    // Sized up front: collecting `Option`s would grow the vector by
    // doubling (their iterator gives no length) and keep up to twice the
    // bytes the halves need.
    let mut out = Vec::with_capacity(data.len());
    for &v in data {
        out.push(H::exact(v)?);
    }
    Some(out)
}

/// `v` without spare capacity: it is kept for the model's lifetime.
fn shrunk(mut v: Vec<f32>) -> Vec<f32> {
    v.shrink_to_fit();
    v
}

/// `dst[i] = src[i]` widened to f32.
fn widen<W: Elem>(src: &[W], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.f32();
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
        if !self.splits(rows, weights) {
            // Too small for any op to pay for another thread.
            return PassPlan::Here;
        }
        if weights.saturating_mul(4) <= self.group_weight_bytes && rows >= 2 * MIN_GROUP_ROWS {
            PassPlan::Groups(self.threads.min(rows / MIN_GROUP_ROWS))
        } else {
            PassPlan::Here
        }
    }

    fn run_pass<R: Send, F: FnOnce() -> R + Send>(&self, rows: usize, weights: usize, f: F) -> R {
        // A pass no op of which splits (or one inside a group pass) runs
        // here: handing it to the pool would only add a hand-off.
        let Some(pool) =
            (self.pool.as_ref()).filter(|_| !SERIAL_OPS.get() && self.splits(rows, weights))
        else {
            return f();
        };
        // From inside the pool, an op's split pushes its halves on this
        // worker's own queue and the caller works on them too; the other
        // workers poll for them for the whole pass (see `poll_until`)
        // instead of falling asleep between two ops and being woken for
        // each.
        pool.install(|| {
            let done = AtomicBool::new(false);
            let pass_thread = rayon::current_thread_index();
            rayon::scope(|s| {
                for _ in 1..self.threads {
                    s.spawn(|_| poll_until(&done, pass_thread));
                }
                let _end = SetOnDrop(&done);
                f()
            })
        })
    }

    fn run_groups<R: Send, F: FnOnce() -> R + Send>(&self, tasks: Vec<F>) -> Vec<R> {
        match &self.pool {
            // Each group runs with its ops serial (see `par_pool`): a
            // group is one thread's work, and a worker waiting in a join
            // could pick up another group's whole pass meanwhile.
            Some(pool) => pool.install(|| {
                tasks
                    .into_par_iter()
                    .map(|f| {
                        let _serial = SerialOps::enter();
                        f()
                    })
                    .collect()
            }),
            None => tasks.into_iter().map(|f| f()).collect(),
        }
    }

    fn upload(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<CpuMat, BackendError> {
        let want =
            rows.checked_mul(cols)
                .ok_or(shape_err("upload", "rows * cols overflows", 0, 0))?;
        if data.len() != want {
            return Err(shape_err("upload", "rows * cols", want, data.len()));
        }
        let packed =
            (self.isa.avx2() && matmul::packs(rows, cols)).then(|| matmul::pack(&data, rows, cols));
        let compact = self.compact_weights && packed.is_none() && rows > 1;
        let data = if !compact {
            Stored::F32(shrunk(data))
        } else if let Some(halves) = exact_in::<Bf16>(&data) {
            Stored::Bf16(halves)
        } else if let Some(halves) = exact_in::<F16>(&data) {
            Stored::F16(halves)
        } else {
            Stored::F32(shrunk(data))
        };
        Ok(CpuMat {
            data,
            rows,
            cols,
            packed,
        })
    }

    fn upload_quant(&self, q: QuantMatrix) -> Result<CpuMat, BackendError> {
        let (rows, cols) = (q.rows(), q.cols());
        if self.isa.avx2() && matmul::packs(rows, cols) {
            // Short dot products run from packed f32 panels.
            return self.upload(q.dequantize(), rows, cols);
        }
        // The AVX2 kernels read Q8_0 and Q4_1 with their scales split out.
        let data = match self.isa {
            Isa::Avx2Fma | Isa::Avx512 => {
                quant::SplitQuant::split(q).map_or_else(Stored::Quant, Stored::Split)
            }
            Isa::Portable => Stored::Quant(q),
        };
        Ok(CpuMat {
            data,
            rows,
            cols,
            packed: None,
        })
    }

    fn shape(&self, m: &CpuMat) -> (usize, usize) {
        (m.rows, m.cols)
    }

    fn mat_bytes(&self, m: &CpuMat) -> usize {
        // What the allocations hold, spare capacity included.
        fn held<T>(v: &Vec<T>) -> usize {
            v.capacity() * std::mem::size_of::<T>()
        }
        let rows = match &m.data {
            Stored::F32(v) => held(v),
            Stored::Bf16(v) => held(v),
            Stored::F16(v) => held(v),
            Stored::Quant(q) => q.bytes().len(),
            Stored::Split(q) => q.bytes(),
        };
        rows + m.packed.as_ref().map_or(0, held)
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
            !SERIAL_OPS.get() && draws.len() > 1 && logits.len() >= PARALLEL_SAMPLE_LOGITS
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
        let d = table.cols;
        resize(out, tokens.len() * d);
        for (i, &t) in tokens.iter().enumerate() {
            let r = t as usize;
            if r >= table.rows {
                return Err(BackendError::TokenOutOfRange {
                    token: t,
                    vocab: table.rows,
                });
            }
            let o = &mut out[i * d..(i + 1) * d];
            match &table.data {
                Stored::F32(v) => o.copy_from_slice(&v[r * d..(r + 1) * d]),
                Stored::Bf16(v) => widen(&v[r * d..(r + 1) * d], o),
                Stored::F16(v) => widen(&v[r * d..(r + 1) * d], o),
                Stored::Quant(q) => q.dequantize_row(r, o),
                Stored::Split(q) => q.dequantize_row(self.isa, r, o),
            }
        }
        Ok(())
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
        let (n, k) = (w.rows, w.cols);
        let m = rows_of("matmul", x.len(), k)?;
        resize(out, m * n);
        let work = m.saturating_mul(n).saturating_mul(k);
        if let Some(packed) = &w.packed {
            // Small weights (cache-resident): threads split the activation
            // rows, each reading all of the weights.
            let per = m.div_ceil(self.threads * 4).max(1);
            match self.par_pool(work).filter(|_| m > 1) {
                Some(pool) => pool.install(|| {
                    out.par_chunks_mut(per * n)
                        .zip(x.par_chunks(per * k))
                        .for_each(|(o, xs)| {
                            matmul::matmul_packed(self.isa, xs, xs.len() / k, k, packed, n, o)
                        })
                }),
                None => matmul::matmul_packed(self.isa, x, m, k, packed, n, out),
            }
            return Ok(());
        }
        let Some(pool) = self.par_pool(work) else {
            w.with_rows(|w| w.matmul_cols(self.isa, x, m, k, 0..n, out, n, 1));
            return Ok(());
        };
        // Split the weight rows over threads: each weight byte is read once
        // for all activation rows. Blocks write a transposed [n, m] buffer
        // (contiguous per block), transposed back afterwards.
        let blocks = self.threads * 4;
        let nb = n.div_ceil(blocks).next_multiple_of(4).max(4);
        if m == 1 {
            pool.install(|| {
                out.par_chunks_mut(nb).enumerate().for_each(|(b, o)| {
                    let j0 = b * nb;
                    let cols = j0..j0 + o.len();
                    w.with_rows(|w| w.matmul_cols(self.isa, x, 1, k, cols, o, 0, 1));
                })
            });
            return Ok(());
        }
        TRANSPOSED.with(|t| {
            let mut t = t.borrow_mut();
            resize(&mut t, n * m);
            let t: &mut [f32] = &mut t;
            pool.install(|| {
                t.par_chunks_mut(nb * m).enumerate().for_each(|(b, o)| {
                    let j0 = b * nb;
                    let cols = j0..j0 + o.len() / m;
                    w.with_rows(|w| w.matmul_cols(self.isa, x, m, k, cols, o, 1, m));
                })
            });
            for (j, col) in t.chunks_exact(m).enumerate() {
                for (i, &v) in col.iter().enumerate() {
                    out[i * n + j] = v;
                }
            }
        });
        Ok(())
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
        shape.check()?;
        let qd = shape.q_dim();
        let rows = rows_of("attention_prefill", q.len(), qd)?;
        if kv.len() != spans.len() {
            return Err(shape_err(
                "attention_prefill",
                "one KV view per span",
                spans.len(),
                kv.len(),
            ));
        }
        let mut next_row = 0;
        for (s, (span, view)) in spans.iter().zip(kv).enumerate() {
            if span.first_row != next_row {
                return Err(shape_err(
                    "attention_prefill",
                    "spans contiguous from row 0",
                    next_row,
                    span.first_row,
                ));
            }
            next_row += span.rows;
            check_view(view, shape, s, span.end_pos())?;
            host_rows(view)?;
        }
        if next_row != rows {
            return Err(shape_err(
                "attention_prefill",
                "rows covered by spans",
                rows,
                next_row,
            ));
        }
        resize(out, q.len());
        let work: usize = spans
            .iter()
            .map(|s| s.rows * s.end_pos())
            .sum::<usize>()
            .saturating_mul(2 * qd);
        flash::prefill(self.isa, self.par_pool(work), q, kv, spans, shape, out);
        Ok(())
    }

    fn attention_decode(
        &self,
        q: &Vec<f32>,
        kv: &[LayerView<'_>],
        shape: AttnShape,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        shape.check()?;
        let qd = shape.q_dim();
        let rows = rows_of("attention_decode", q.len(), qd)?;
        if kv.len() != rows {
            return Err(shape_err(
                "attention_decode",
                "one KV view per query row",
                rows,
                kv.len(),
            ));
        }
        for (s, view) in kv.iter().enumerate() {
            check_view(view, shape, s, 1)?;
            host_rows(view)?;
        }
        resize(out, q.len());
        let work = kv
            .iter()
            .map(|v| v.len())
            .sum::<usize>()
            .saturating_mul(2 * qd);
        flash::decode(self.isa, self.par_pool(work), q, kv, shape, out);
        Ok(())
    }
}

/// This backend reads KV rows in host memory: a view of device-resident
/// pages lends none, so attention over it is refused, not computed on
/// nothing.
fn host_rows(view: &LayerView<'_>) -> Result<(), BackendError> {
    if view.residence() == crate::kv::Residence::Host {
        return Ok(());
    }
    Err(BackendError::Unsupported {
        what: "KV pages in device memory",
        detail: "(the CPU backend reads KV rows in host memory: build its pool with KvPool::new)"
            .into(),
    })
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

    #[test]
    fn ops_inside_a_group_pass_never_split() {
        let b = CpuBackend::with_threads(2).min_parallel_work(1);
        assert!(b.par_pool(1).is_some(), "outside a group, ops split");
        let inside = b.run_groups(vec![|| b.par_pool(1).is_some(); 4]);
        assert_eq!(inside, vec![false; 4], "a group's ops must stay serial");
        assert!(b.par_pool(1).is_some(), "the mark is lifted afterwards");
    }

    #[test]
    fn a_pass_that_unwinds_releases_the_polling_workers() {
        let b = CpuBackend::with_threads(2).min_parallel_work(1);
        // A pass whose split ops run on both threads, then panics.
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            b.run_pass(1, usize::MAX, || {
                let mut v = vec![0u32; 1 << 12];
                if let Some(pool) = b.par_pool(1) {
                    pool.install(|| v.par_iter_mut().for_each(|x| *x += 1));
                }
                assert_eq!(v.iter().sum::<u32>(), 1 << 12);
                panic!("a pass that fails");
            })
        }));
        assert!(unwound.is_err());
        // The pool is free again: a pass needing both threads completes.
        let sum: u64 = b.run_pass(1, usize::MAX, || {
            b.par_pool(1)
                .map(|p| p.install(|| (0..1u64 << 16).into_par_iter().sum()))
                .unwrap_or(0)
        });
        assert_eq!(sum, (1u64 << 16) * ((1u64 << 16) - 1) / 2);
    }
}
