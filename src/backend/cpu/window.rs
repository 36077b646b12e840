//! Sliding-window attention (Gemma's local layers): a query at position
//! `p` attends to positions `p + 1 - window ..= p` only.
//!
//! Each row walks the same fixed tiles as `flash` (counted from position
//! 0), the first one clipped at the window's start, and merges their
//! partials in order; a row's bits depend only on its query and the
//! positions it attends to, so a prefill and a decode step, any batch and
//! any split over threads give the same result.

use rayon::prelude::*;

use crate::backend::AttnShape;
use crate::backend::cpu::attend::{TILE, TileKv, tile_segs};
use crate::backend::cpu::flash::{Work, finish, merge, seg_len, with_work};
use crate::backend::cpu::{Isa, attention};
use crate::kv::LayerView;

/// Query row `r` of `q` (`rows.len() × q_dim`) reads view `rows[r].0` at
/// position `rows[r].1` over the last `window` positions (`window >= 1`;
/// every view holds its rows' positions, as the backend checked), rows
/// over `pool`'s threads when given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows(
    isa: Isa,
    pool: Option<&rayon::ThreadPool>,
    q: &[f32],
    kv: &[LayerView<'_>],
    rows: &[(usize, usize)],
    window: usize,
    shape: AttnShape,
    out: &mut [f32],
) {
    let qd = shape.q_dim();
    let run = |(r, o): (usize, &mut [f32])| {
        let (s, pos) = rows[r];
        row(isa, &q[r * qd..(r + 1) * qd], &kv[s], pos, window, shape, o);
    };
    match pool {
        Some(pool) => pool.install(|| out.par_chunks_mut(qd).enumerate().for_each(run)),
        None => out.chunks_mut(qd).enumerate().for_each(run),
    }
}

/// One query row at `pos` over positions `pos + 1 - window ..= pos`.
fn row(
    isa: Isa,
    q: &[f32],
    kv: &LayerView<'_>,
    pos: usize,
    window: usize,
    shape: AttnShape,
    out: &mut [f32],
) {
    let end = pos + 1;
    let lo = end.saturating_sub(window.max(1));
    with_work(q, shape, 1, 1, |w: &mut Work| {
        let mut t = lo;
        while t < end {
            let t1 = ((t / TILE + 1) * TILE).min(end);
            let mut segs = Vec::new();
            tile_segs(kv, t, t1, &mut w.buf, &mut segs);
            let n = seg_len(&segs);
            let tkv = TileKv {
                koff: &w.koff,
                segs: &segs,
                n,
                shape,
            };
            attention::tile(isa, &w.qs, &tkv, &mut w.part, &mut w.scores);
            merge(&mut w.state, &w.part, shape, t == lo);
            t = t1;
        }
        finish(&w.state, shape, out);
    });
}
