//! Paged attention on the CPU, one position tile of one query row at a
//! time: the instruction set's kernel for a tile's partial result (see
//! `attend::tile_with`). `flash` runs the tiles and merges them.
//!
//! Within a tile, scores, softmax and the weighted sum run over positions
//! in order, and tiles are fixed ranges of positions, so the result does
//! not depend on the page size, on the batch, on the threads, or on
//! whether the query came from a prefill or a decode step.

use crate::backend::AttnShape;
use crate::backend::cpu::Isa;
use crate::backend::cpu::attend::{ROWS, Seg, tile_rows_with, tile_with};
use crate::backend::cpu::kernel::Portable;

/// One query row's partial result over the first `n` positions of a
/// tile's segments (`qs` pre-scaled, `koff` each head's KV offset; see
/// `attend::prepare`), into `part` (`attend::partial_len` floats).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile(
    isa: Isa,
    qs: &[f32],
    koff: &[usize],
    segs: &[Seg<'_>],
    n: usize,
    shape: AttnShape,
    part: &mut [f32],
    scores: &mut Vec<f32>,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 if crate::backend::cpu::x86::has_hd8_kernel(shape) => {
            // SAFETY: as below (AVX2 and FMA were detected).
            unsafe { crate::backend::cpu::x86::tile_hd8(qs, koff, segs, n, shape, part, scores) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the
            // CPU reported AVX2 and FMA (see `Isa::detect`).
            unsafe { crate::backend::cpu::x86::tile(qs, koff, segs, n, shape, part, scores) }
        }
        _ => tile_with::<Portable>(qs, koff, segs, n, shape, part, scores),
    }
}

/// [`tile`] for [`ROWS`] query rows that all see the first `n` positions
/// of the tile: the bits `tile` gives each of them alone (see
/// `attend::tile_rows_with`). `head_dim` must be a multiple of 8.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile_rows(
    isa: Isa,
    qs: [&[f32]; ROWS],
    koff: &[usize],
    segs: &[Seg<'_>],
    n: usize,
    shape: AttnShape,
    parts: [&mut [f32]; ROWS],
    scores: &mut Vec<f32>,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma | Isa::Avx512 => {
            // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the
            // CPU reported AVX2 and FMA (see `Isa::detect`).
            unsafe { crate::backend::cpu::x86::tile_rows(qs, koff, segs, n, shape, parts, scores) }
        }
        _ => tile_rows_with::<Portable>(qs, koff, segs, n, shape, parts, scores),
    }
}
