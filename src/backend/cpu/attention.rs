//! Paged attention on the CPU: one query row against the written positions
//! of one sequence, streamed page by page through its [`LayerView`].
//!
//! Scores, softmax and the weighted sum run over positions in order, so the
//! result does not depend on the page size, on the batch, or on whether the
//! query came from a prefill or a decode step.

use rayon::prelude::*;

use crate::backend::cpu::attend::{SCRATCH, attend_row_with};
use crate::backend::cpu::kernel::Portable;
use crate::backend::cpu::{CpuBackend, Isa, resize};
use crate::backend::{AttnShape, BackendError, SeqSpan, check_view, rows_of, shape_err};
use crate::kv::LayerView;

/// `out[h] = softmax(q[h] · K[0..n_keys]ᵀ / sqrt(d)) · V[0..n_keys]` for
/// every query head `h`, with K/V of the head's group.
pub(crate) fn attend_row(
    isa: Isa,
    q: &[f32],
    kv: &LayerView<'_>,
    n_keys: usize,
    shape: AttnShape,
    out: &mut [f32],
) {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma | Isa::Avx512 if crate::backend::cpu::x86_hd8::has_hd8_kernel(shape) => {
                // SAFETY: as below (AVX2 and FMA were detected).
                unsafe {
                    crate::backend::cpu::x86_hd8::attend_row_hd8(q, kv, n_keys, shape, out, &mut s)
                }
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma | Isa::Avx512 => {
                // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the
                // CPU reported AVX2 and FMA (see `Isa::detect`).
                unsafe { crate::backend::cpu::x86::attend_row(q, kv, n_keys, shape, out, &mut s) }
            }
            _ => attend_row_with::<Portable>(q, kv, n_keys, shape, out, &mut s),
        }
    })
}

impl CpuBackend {
    /// `Backend::attention_prefill`.
    pub(super) fn prefill_attention(
        &self,
        q: &[f32],
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
        let row = |r: usize, o: &mut [f32]| {
            // Spans are contiguous and sorted by first_row.
            let s = spans.partition_point(|sp| sp.first_row + sp.rows <= r);
            let sp = spans[s];
            let pos = sp.first_pos + (r - sp.first_row);
            attend_row(
                self.isa,
                &q[r * qd..(r + 1) * qd],
                &kv[s],
                pos + 1,
                shape,
                o,
            );
        };
        match self.par_pool(work) {
            Some(pool) => pool.install(|| {
                out.par_chunks_mut(qd)
                    .enumerate()
                    .for_each(|(r, o)| row(r, o))
            }),
            None => out
                .chunks_exact_mut(qd)
                .enumerate()
                .for_each(|(r, o)| row(r, o)),
        }
        Ok(())
    }

    /// `Backend::attention_decode`.
    pub(super) fn decode_attention(
        &self,
        q: &[f32],
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
        let row = |r: usize, o: &mut [f32]| {
            attend_row(
                self.isa,
                &q[r * qd..(r + 1) * qd],
                &kv[r],
                kv[r].len(),
                shape,
                o,
            );
        };
        match self.par_pool(work) {
            Some(pool) => pool.install(|| {
                out.par_chunks_mut(qd)
                    .enumerate()
                    .for_each(|(r, o)| row(r, o))
            }),
            None => out
                .chunks_exact_mut(qd)
                .enumerate()
                .for_each(|(r, o)| row(r, o)),
        }
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
