//! Attention over long contexts: position tiles ([`TILE`]) computed apart
//! and merged in tile order with an online softmax.
//!
//! A tile's partial result for one query row (per head: the max of its
//! scores, the sum of `exp(score - max)`, and the weighted sum of values)
//! comes from `attention::tile`. Partials merge into a running state, tile
//! 0 first: `M = max(M, m)`, `L = L·e^(M_old−M) + l·e^(m−M)`, likewise the
//! weighted sums; the row's output is its sum times `1 / L`. Every row,
//! whether it came from a prefill or a decode step, merges the same tiles
//! by the same operations in the same order, so the bits depend on nothing
//! but the row's query and the positions it attends to.
//!
//! - Decode splits each row's context over the threads (split-KV): every
//!   (row, tile) is a task writing its partial, and each row then merges
//!   its partials in order, so the split does not change the bits.
//! - Prefill runs blocks of [`BLOCK`] consecutive query rows of a
//!   sequence (the blocks over the threads); each block walks the tiles
//!   once, widening a narrow tile's K/V rows once for all its rows and
//!   reading them from cache for each row, instead of each row streaming
//!   the whole context.
//!
//! A context of at most one tile gives the bits of a single pass (the
//! merge starts from tile 0's partial as is).

use std::cell::RefCell;

use rayon::prelude::*;

use crate::backend::cpu::attend::{ROWS, Seg, TILE, TileBuf, TileKv, partial_len, tile_segs};
use crate::backend::cpu::{Isa, attention, fastmath};
use crate::backend::{AttnShape, SeqSpan};
use crate::kv::LayerView;

/// Query rows of one sequence per prefill task: each tile's K/V rows are
/// read from memory once per block and from cache for the rest.
pub(crate) const BLOCK: usize = 32;

/// One thread's buffers, reused across calls (no allocation per token
/// once grown); `window` uses them too.
#[derive(Default)]
pub(super) struct Work {
    pub(super) buf: TileBuf,
    pub(super) scores: Vec<f32>,
    pub(super) qs: Vec<f32>,
    pub(super) koff: Vec<usize>,
    pub(super) part: Vec<f32>,
    pub(super) state: Vec<f32>,
}

thread_local! {
    static WORK: RefCell<Work> = RefCell::new(Work::default());
    /// The calling thread's partials of a decode step.
    static PARTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's buffers, `qs` holding `q` pre-scaled,
/// `koff` the head offsets, room for `parts` partials and `rows` states.
pub(super) fn with_work<R>(
    q: &[f32],
    shape: AttnShape,
    parts: usize,
    rows: usize,
    f: impl FnOnce(&mut Work) -> R,
) -> R {
    WORK.with(|w| {
        let w = &mut *w.borrow_mut();
        let pl = partial_len(shape);
        w.qs.resize(q.len(), 0.0);
        scale_query(q, shape, &mut w.qs);
        head_offsets(shape, &mut w.koff);
        w.part.resize(parts * pl, 0.0);
        w.state.resize(rows * pl, 0.0);
        f(w)
    })
}

/// `q` scaled by 1/sqrt(head_dim) into `out`.
fn scale_query(q: &[f32], shape: AttnShape, out: &mut [f32]) {
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    for (o, &x) in out.iter_mut().zip(q) {
        *o = x * scale;
    }
}

/// Per query head, the offset of its KV head in a K/V row.
fn head_offsets(shape: AttnShape, koff: &mut Vec<usize>) {
    let group = (shape.n_heads / shape.n_kv_heads.max(1)).max(1);
    koff.clear();
    koff.extend((0..shape.n_heads).map(|h| (h / group) * shape.head_dim));
}

/// Merges a tile's partial into a row's running state (both
/// `[max; nh] [sum; nh] [acc; nh * hd]`); `first`: the state is empty and
/// becomes the partial as is.
pub(super) fn merge(state: &mut [f32], part: &[f32], shape: AttnShape, first: bool) {
    if first {
        state.copy_from_slice(part);
        return;
    }
    let (nh, hd) = (shape.n_heads, shape.head_dim);
    let (sm, rest) = state.split_at_mut(nh);
    let (sl, sa) = rest.split_at_mut(nh);
    let (pm, rest) = part.split_at(nh);
    let (pl, pa) = rest.split_at(nh);
    for h in 0..nh {
        let m = if pm[h] > sm[h] { pm[h] } else { sm[h] };
        let a = fastmath::exp(sm[h] - m);
        let b = fastmath::exp(pm[h] - m);
        sm[h] = m;
        sl[h] = sl[h] * a + pl[h] * b;
        for (s, &p) in sa[h * hd..(h + 1) * hd]
            .iter_mut()
            .zip(&pa[h * hd..(h + 1) * hd])
        {
            *s = *s * a + p * b;
        }
    }
}

/// A row's output from its merged state: each head's sum times `1 / L`.
pub(super) fn finish(state: &[f32], shape: AttnShape, out: &mut [f32]) {
    let (nh, hd) = (shape.n_heads, shape.head_dim);
    let (l, acc) = state[nh..].split_at(nh);
    for h in 0..nh {
        let inv = 1.0 / l[h];
        for (o, &a) in out[h * hd..(h + 1) * hd]
            .iter_mut()
            .zip(&acc[h * hd..(h + 1) * hd])
        {
            *o = a * inv;
        }
    }
}

/// Positions in the tile's segments.
pub(super) fn seg_len(segs: &[Seg<'_>]) -> usize {
    segs.iter().map(|s| s.n).sum()
}

/// One decode query row per view against all its written positions,
/// tiles over `pool`'s threads when given. `out`: `q.len()` floats.
pub(crate) fn decode(
    isa: Isa,
    pool: Option<&rayon::ThreadPool>,
    q: &[f32],
    kv: &[LayerView<'_>],
    shape: AttnShape,
    out: &mut [f32],
) {
    let qd = shape.q_dim();
    let pl = partial_len(shape);
    // starts[r]: row r's first tile among all rows' tiles.
    let mut starts = Vec::with_capacity(kv.len() + 1);
    starts.push(0usize);
    for v in kv {
        let last = starts.last().copied().unwrap_or(0);
        starts.push(last + v.len().div_ceil(TILE));
    }
    let total = starts.last().copied().unwrap_or(0);
    let mut parts = PARTS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    parts.resize(total * pl, 0.0);
    let task = |i: usize, part: &mut [f32]| {
        let r = starts.partition_point(|&s| s <= i) - 1;
        let t0 = (i - starts[r]) * TILE;
        WORK.with(|w| {
            let Work {
                buf,
                scores,
                qs,
                koff,
                ..
            } = &mut *w.borrow_mut();
            qs.resize(qd, 0.0);
            scale_query(&q[r * qd..(r + 1) * qd], shape, qs);
            head_offsets(shape, koff);
            let mut segs = Vec::new();
            tile_segs(&kv[r], t0, t0 + TILE, buf, &mut segs);
            let n = seg_len(&segs);
            let kv = TileKv {
                koff,
                segs: &segs,
                n,
                shape,
            };
            attention::tile(isa, qs, &kv, part, scores);
        });
    };
    let row = |r: usize, o: &mut [f32], parts: &[f32]| {
        WORK.with(|w| {
            let state = &mut w.borrow_mut().state;
            state.resize(pl, 0.0);
            for (k, part) in parts[starts[r] * pl..starts[r + 1] * pl]
                .chunks_exact(pl)
                .enumerate()
            {
                merge(state, part, shape, k == 0);
            }
            finish(state, shape, o);
        });
    };
    match pool {
        Some(pool) => pool.install(|| {
            parts
                .par_chunks_mut(pl)
                .enumerate()
                .for_each(|(i, p)| task(i, p));
            out.par_chunks_mut(qd)
                .enumerate()
                .for_each(|(r, o)| row(r, o, &parts));
        }),
        None => {
            parts
                .chunks_mut(pl)
                .enumerate()
                .for_each(|(i, p)| task(i, p));
            out.chunks_mut(qd)
                .enumerate()
                .for_each(|(r, o)| row(r, o, &parts));
        }
    }
    PARTS.with(|p| *p.borrow_mut() = parts);
}

/// Causal attention of each span's query rows (row `first_row + i` at
/// position `first_pos + i`, attending to positions `0..=` its own) over
/// its view, blocks of rows over `pool`'s threads when given.
pub(crate) fn prefill(
    isa: Isa,
    pool: Option<&rayon::ThreadPool>,
    q: &[f32],
    kv: &[LayerView<'_>],
    spans: &[SeqSpan],
    shape: AttnShape,
    out: &mut [f32],
) {
    let qd = shape.q_dim();
    // (span, first row of the span's block, rows) and the block's output.
    let mut blocks = Vec::new();
    let mut rest = out;
    for (s, sp) in spans.iter().enumerate() {
        let mut i = 0;
        while i < sp.rows {
            let n = (sp.rows - i).min(BLOCK);
            let (o, r) = rest.split_at_mut(n * qd);
            blocks.push(((s, i, n), o));
            rest = r;
            i += n;
        }
    }
    let run = |((s, i, n), o): ((usize, usize, usize), &mut [f32])| {
        let sp = spans[s];
        let r0 = sp.first_row + i;
        prefill_block(
            isa,
            &q[r0 * qd..(r0 + n) * qd],
            &kv[s],
            sp.first_pos + i,
            shape,
            o,
        );
    };
    match pool {
        Some(pool) => pool.install(|| blocks.into_par_iter().for_each(run)),
        None => blocks.into_iter().for_each(run),
    }
}

/// Query rows `q` (`rows × q_dim`) at positions `first_pos ..`, each
/// attending to the view's positions up to its own: the tiles in order,
/// each read once for all the rows.
fn prefill_block(
    isa: Isa,
    q: &[f32],
    kv: &LayerView<'_>,
    first_pos: usize,
    shape: AttnShape,
    out: &mut [f32],
) {
    let qd = shape.q_dim();
    let pl = partial_len(shape);
    let rows = q.len() / qd;
    if rows == 0 {
        return;
    }
    let end = first_pos + rows;
    with_work(q, shape, ROWS, rows, |w| {
        let Work {
            buf,
            scores,
            qs,
            koff,
            part,
            state,
        } = w;
        for (k, t0) in (0..end).step_by(TILE).enumerate() {
            let t1 = (t0 + TILE).min(end);
            let mut segs = Vec::new();
            tile_segs(kv, t0, t1, buf, &mut segs);
            let have = seg_len(&segs);
            // Rows that see the whole tile, ROWS at a time (each K and V
            // row loaded once for all of them); the rest one by one.
            let full = t1 - t0;
            let first_full = (t1 - 1).saturating_sub(first_pos).min(rows);
            let mut grouped = first_full;
            if full == have && shape.head_dim.is_multiple_of(8) {
                while grouped + ROWS <= rows {
                    let i = grouped;
                    let q: [&[f32]; ROWS] =
                        std::array::from_fn(|j| &qs[(i + j) * qd..(i + j + 1) * qd]);
                    let mut it = part.chunks_exact_mut(pl);
                    let parts: [&mut [f32]; ROWS] =
                        std::array::from_fn(|_| it.next().unwrap_or_default());
                    let kv = TileKv {
                        koff,
                        segs: &segs,
                        n: full,
                        shape,
                    };
                    attention::tile_rows(isa, q, &kv, parts, scores);
                    for (j, p) in part.chunks_exact(pl).enumerate() {
                        let st = &mut state[(i + j) * pl..(i + j + 1) * pl];
                        merge(st, p, shape, k == 0);
                    }
                    grouped += ROWS;
                }
            }
            for i in (0..first_full).chain(grouped..rows) {
                let pos = first_pos + i;
                if pos < t0 {
                    continue;
                }
                // Positions t0..=pos of this tile (none missing: the
                // backend checked the view holds them).
                let n = (pos + 1).min(t1) - t0;
                let kv = TileKv {
                    koff,
                    segs: &segs,
                    n: n.min(have),
                    shape,
                };
                attention::tile(isa, &qs[i * qd..(i + 1) * qd], &kv, &mut part[..pl], scores);
                merge(&mut state[i * pl..(i + 1) * pl], &part[..pl], shape, k == 0);
            }
        }
        for i in 0..rows {
            finish(
                &state[i * pl..(i + 1) * pl],
                shape,
                &mut out[i * qd..(i + 1) * qd],
            );
        }
    });
}
