//! Weight matrices on the CPU backend: how each is kept (f32, exact 16-bit
//! halves, ggml blocks, split blocks), uploaded, embedded from and
//! multiplied by.

use std::borrow::Cow;
use std::cell::RefCell;
use std::ops::Range;

use rayon::prelude::*;

use crate::backend::QuantMatrix;
use crate::backend::cpu::kernel::{Bf16, Elem, F16, Half, WeightRows};
use crate::backend::cpu::{CpuBackend, Isa, matmul, quant, resize};
use crate::backend::{BackendError, rows_of, shape_err};

/// A weight tensor in host memory.
#[derive(Debug, Clone)]
pub struct CpuMat {
    data: Stored,
    pub(super) rows: usize,
    pub(super) cols: usize,
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

thread_local! {
    static TRANSPOSED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
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

impl CpuBackend {
    /// `Backend::upload`.
    pub(super) fn upload_f32(
        &self,
        data: Vec<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<CpuMat, BackendError> {
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

    /// `Backend::upload_quant`.
    pub(super) fn upload_blocks(&self, q: QuantMatrix) -> Result<CpuMat, BackendError> {
        let (rows, cols) = (q.rows(), q.cols());
        if self.isa.avx2() && matmul::packs(rows, cols) {
            // Short dot products run from packed f32 panels.
            return self.upload_f32(q.dequantize(), rows, cols);
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

    /// `Backend::mat_bytes`.
    pub(super) fn held_bytes(m: &CpuMat) -> usize {
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

    /// `Backend::embed`.
    pub(super) fn embed_rows(
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

    /// `Backend::matmul`.
    pub(super) fn matmul_mat(
        &self,
        x: &[f32],
        w: &CpuMat,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
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
}
