//! Paged attention on the CPU, one position tile of one query row at a
//! time: the instruction set's kernel for a tile's partial result (see
//! `attend::tile_with`). `flash` runs the tiles and merges them.
//!
//! Within a tile, scores, softmax and the weighted sum run over positions
//! in order, and tiles are fixed ranges of positions, so the result does
//! not depend on the page size, on the batch, on the threads, or on
//! whether the query came from a prefill or a decode step.

use crate::backend::cpu::attend::{ROWS, TileKv, tile_rows_with, tile_with};
use crate::backend::cpu::kernel::Portable;
use crate::backend::cpu::{CpuBackend, Isa, flash, resize, window};
use crate::backend::{AttnShape, BackendError, SeqSpan, check_view, rows_of, shape_err};
use crate::kv::LayerView;

/// One query row's partial result over the first `n` positions of a
/// tile's segments (`qs` pre-scaled, `koff` each head's KV offset; see
/// `attend::prepare`), into `part` (`attend::partial_len` floats).
pub(crate) fn tile(isa: Isa, qs: &[f32], kv: &TileKv<'_>, part: &mut [f32], scores: &mut Vec<f32>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 if crate::backend::cpu::x86_hd8::has_hd8_kernel(kv.shape) => {
            // SAFETY: as below (AVX2 and FMA were detected).
            unsafe { crate::backend::cpu::x86_hd8::tile_hd8(qs, kv, part, scores) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the
            // CPU reported AVX2 and FMA (see `Isa::detect`).
            unsafe { crate::backend::cpu::x86::tile(qs, kv, part, scores) }
        }
        _ => tile_with::<Portable>(qs, kv, part, scores),
    }
}

/// [`tile`] for [`ROWS`] query rows that all see the first `n` positions
/// of the tile: the bits `tile` gives each of them alone (see
/// `attend::tile_rows_with`). `head_dim` must be a multiple of 8.
pub(crate) fn tile_rows(
    isa: Isa,
    qs: [&[f32]; ROWS],
    kv: &TileKv<'_>,
    parts: [&mut [f32]; ROWS],
    scores: &mut Vec<f32>,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the
            // CPU reported AVX2 and FMA (see `Isa::detect`).
            unsafe { crate::backend::cpu::x86::tile_rows(qs, kv, parts, scores) }
        }
        _ => tile_rows_with::<Portable>(qs, kv, parts, scores),
    }
}

impl CpuBackend {
    /// `Backend::attention_prefill`, or with a sliding `window`
    /// `Backend::attention_prefill_window`.
    pub(super) fn prefill_attention(
        &self,
        q: &[f32],
        kv: &[LayerView<'_>],
        spans: &[SeqSpan],
        shape: AttnShape,
        window: Option<usize>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        shape.check()?;
        no_empty_window(window)?;
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
        match window {
            None => flash::prefill(self.isa, self.par_pool(work), q, kv, spans, shape, out),
            Some(w) => {
                let rows = spans
                    .iter()
                    .enumerate()
                    .flat_map(|(s, sp)| (0..sp.rows).map(move |i| (s, sp.first_pos + i)));
                let rows: Vec<(usize, usize)> = rows.collect();
                let pool = self.par_pool(work.min(rows.len() * w * 2 * qd));
                window::rows(self.isa, pool, q, kv, &rows, w, shape, out);
            }
        }
        Ok(())
    }

    /// `Backend::attention_decode`, or with a sliding `window`
    /// `Backend::attention_decode_window`.
    pub(super) fn decode_attention(
        &self,
        q: &[f32],
        kv: &[LayerView<'_>],
        shape: AttnShape,
        window: Option<usize>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        shape.check()?;
        no_empty_window(window)?;
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
        match window {
            None => flash::decode(self.isa, self.par_pool(work), q, kv, shape, out),
            Some(w) => {
                // Each row's newest position, the one its query is for.
                let rows: Vec<(usize, usize)> = kv
                    .iter()
                    .enumerate()
                    .map(|(s, v)| (s, v.len().saturating_sub(1)))
                    .collect();
                let pool = self.par_pool(work.min(rows.len() * w * 2 * qd));
                window::rows(self.isa, pool, q, kv, &rows, w, shape, out);
            }
        }
        Ok(())
    }
}

/// A sliding window must hold at least the query's own position.
fn no_empty_window(window: Option<usize>) -> Result<(), BackendError> {
    match window {
        Some(0) => Err(shape_err("attention", "window positions", 1, 0)),
        _ => Ok(()),
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
