//! The attention algorithm over any [`Kernel`], one position tile at a
//! time: a query row's scores against the tile's keys, the tile's max,
//! `exp(score - max)` and its sum, and the weighted sum of the tile's
//! values, all over positions in order. A leaf: the instruction-set modules
//! run it with their kernel, and `attention` dispatches to them; `flash`
//! merges the tiles' partial results.

use crate::backend::AttnShape;
use crate::backend::cpu::fastmath;
use crate::backend::cpu::kernel::Kernel;
use crate::kv::{KvSlice, LayerView};

/// Positions per tile. Fixed and counted from position 0, so that which
/// tile a position falls in (and so every sum's order) depends neither on
/// the page size, nor on the batch, nor on how the tiles are shared out
/// over threads.
pub(crate) const TILE: usize = 64;

/// K and V rows of consecutive positions of one tile, contiguous f32:
/// `keys`/`vals` hold `n` rows of `kv_dim` each.
#[derive(Clone, Copy)]
pub(crate) struct Seg<'a> {
    pub(crate) keys: &'a [f32],
    pub(crate) vals: &'a [f32],
    pub(crate) n: usize,
}

/// Rows `[a, b)` of one page's K or V rows (`kvd` elements each).
fn rows_of(s: KvSlice<'_>, a: usize, b: usize, kvd: usize) -> KvSlice<'_> {
    let r = a * kvd..b * kvd;
    match s {
        KvSlice::F32(v) => KvSlice::F32(v.get(r).unwrap_or(&[])),
        KvSlice::F16(v) => KvSlice::F16(v.get(r).unwrap_or(&[])),
        KvSlice::BF16(v) => KvSlice::BF16(v.get(r).unwrap_or(&[])),
        KvSlice::F8E4M3(v) => KvSlice::F8E4M3(v.get(r).unwrap_or(&[])),
    }
}

/// Buffers for one tile's K/V rows widened to f32.
#[derive(Default)]
pub(crate) struct TileBuf {
    keys: Vec<f32>,
    vals: Vec<f32>,
}

/// The segments of positions `[t0, t1)` of `kv`: f32 pages borrowed in
/// place (one segment per page the tile touches), narrower pages widened
/// once into `buf` (one segment), so that every query row that reads the
/// tile afterwards reads f32. Empty when a page lends fewer rows than the
/// view says it holds (not reachable from the backend, which checks the
/// views).
pub(crate) fn tile_segs<'a>(
    kv: &LayerView<'a>,
    t0: usize,
    t1: usize,
    buf: &'a mut TileBuf,
    segs: &mut Vec<Seg<'a>>,
) {
    segs.clear();
    let kvd = kv.kv_dim();
    let ps = kv.page_size().max(1);
    let t1 = t1.min(kv.len());
    if t0 >= t1 {
        return;
    }
    let narrow = !matches!(kv.keys(0), KvSlice::F32(_));
    if narrow {
        let n = t1 - t0;
        buf.keys.resize(n * kvd, 0.0);
        buf.vals.resize(n * kvd, 0.0);
    }
    let mut t = t0;
    let mut done = 0;
    while t < t1 {
        let p = t / ps;
        let a = t - p * ps;
        let b = (t1 - p * ps).min(ps);
        let (k, v) = (
            rows_of(kv.keys(p), a, b, kvd),
            rows_of(kv.values(p), a, b, kvd),
        );
        let n = b - a;
        if k.len() != n * kvd || v.len() != n * kvd {
            segs.clear();
            return;
        }
        match (k, v) {
            (KvSlice::F32(keys), KvSlice::F32(vals)) if !narrow => {
                segs.push(Seg { keys, vals, n });
            }
            (k, v) => {
                k.to_f32_into(&mut buf.keys[done * kvd..(done + n) * kvd]);
                v.to_f32_into(&mut buf.vals[done * kvd..(done + n) * kvd]);
            }
        }
        done += n;
        t += n;
    }
    if narrow {
        segs.push(Seg {
            keys: &buf.keys,
            vals: &buf.vals,
            n: t1 - t0,
        });
    }
}

/// What one attention tile reads for its query rows: the first `n`
/// positions of the segments `segs`, each query head's offset in a KV row
/// (`koff`), in `shape`.
#[derive(Clone, Copy)]
pub(crate) struct TileKv<'a> {
    pub koff: &'a [usize],
    pub segs: &'a [Seg<'a>],
    pub n: usize,
    pub shape: AttnShape,
}

/// Floats in one tile's partial result: per head its max, its sum of
/// weights, and its `head_dim` weighted values.
pub(crate) fn partial_len(shape: AttnShape) -> usize {
    shape.n_heads * (shape.head_dim + 2)
}

/// One query row's partial result over the first `n` positions of a
/// tile's segments, into `part` (`[max; nh] [sum; nh] [acc; nh * hd]`):
/// scores, per head the max over the tile, `w = exp(score - max)` and the
/// sum of `w`, and `acc = sum of w * v`, over positions in order.
#[inline(always)]
pub(crate) fn tile_with<K: Kernel>(
    qs: &[f32],
    kv: &TileKv<'_>,
    part: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let TileKv {
        koff,
        segs,
        n,
        shape,
    } = *kv;
    let nh = shape.n_heads;
    let hd = shape.head_dim;
    let kvd = shape.kv_dim();
    let (m, rest) = part.split_at_mut(nh);
    let (l, acc) = rest.split_at_mut(nh);
    scores.clear();
    scores.resize(n * nh, 0.0);
    let mut t0 = 0;
    for s in segs {
        let tn = s.n.min(n - t0);
        if tn == 0 {
            break;
        }
        K::scores(
            qs,
            s.keys,
            tn,
            kvd,
            koff,
            hd,
            &mut scores[t0 * nh..(t0 + tn) * nh],
        );
        t0 += tn;
    }
    softmax_columns(&mut scores[..t0 * nh], nh, m, l);
    acc.fill(0.0);
    let mut t0 = 0;
    for s in segs {
        let tn = s.n.min(n - t0);
        if tn == 0 {
            break;
        }
        let w = &scores[t0 * nh..(t0 + tn) * nh];
        K::weighted_add(acc, w, s.vals, tn, nh, kvd, koff, hd);
        t0 += tn;
    }
}

/// Per head (column of `scores: [n][nh]`): the max into `max[h]`, then
/// `exp(x - max)` in place and its sum into `sum[h]`. Sums run over
/// positions in order. Heads go eight at a time in fixed-size blocks the
/// compiler keeps in registers; a remainder of fewer than eight heads goes
/// one by one.
#[inline(always)]
fn softmax_columns(scores: &mut [f32], nh: usize, max: &mut [f32], sum: &mut [f32]) {
    const B: usize = 8;
    let n = scores.len() / nh;
    let blocks = nh / B;
    for hb in 0..blocks {
        let col = |t: usize| t * nh + hb * B;
        let mut m = [f32::NEG_INFINITY; B];
        for t in 0..n {
            let x = &scores[col(t)..col(t) + B];
            for l in 0..B {
                m[l] = if x[l] > m[l] { x[l] } else { m[l] };
            }
        }
        let mut s = [0f32; B];
        for t in 0..n {
            let x = &mut scores[col(t)..col(t) + B];
            for l in 0..B {
                x[l] = fastmath::exp(x[l] - m[l]);
                s[l] += x[l];
            }
        }
        max[hb * B..hb * B + B].copy_from_slice(&m);
        sum[hb * B..hb * B + B].copy_from_slice(&s);
    }
    for h in blocks * B..nh {
        let mut m = f32::NEG_INFINITY;
        for t in 0..n {
            m = m.max(scores[t * nh + h]);
        }
        let mut s = 0f32;
        for t in 0..n {
            let x = &mut scores[t * nh + h];
            *x = fastmath::exp(*x - m);
            s += *x;
        }
        max[h] = m;
        sum[h] = s;
    }
}

/// Query rows that [`tile_rows_with`] takes at once.
pub(crate) const ROWS: usize = 4;

/// [`tile_with`] for [`ROWS`] query rows that all see the same `n`
/// positions (a prefill block's rows past the tile): each row's partial
/// gets the bits `tile_with` gives it alone (every score is the same dot
/// product, the softmax the same function, every weighted sum the same
/// multiply-adds in position order), while each K and V row is loaded
/// once for all the rows. `head_dim` must be a multiple of 8.
#[inline(always)]
pub(crate) fn tile_rows_with<K: Kernel>(
    qs: [&[f32]; ROWS],
    kv: &TileKv<'_>,
    parts: [&mut [f32]; ROWS],
    scores: &mut Vec<f32>,
) {
    let TileKv {
        koff,
        segs,
        n,
        shape,
    } = *kv;
    const L: usize = crate::backend::cpu::kernel::LANES;
    let nh = shape.n_heads;
    let hd = shape.head_dim;
    let kvd = shape.kv_dim();
    let stride = n * nh;
    scores.clear();
    scores.resize(ROWS * stride, 0.0);
    // Scores: per head, two positions against all rows at a time.
    let mut t0 = 0;
    for s in segs {
        let tn = s.n.min(n - t0);
        if tn == 0 {
            break;
        }
        let key = |t: usize, h: usize| &s.keys[t * kvd + koff[h]..t * kvd + koff[h] + hd];
        for h in 0..nh {
            let q: [&[f32]; ROWS] = std::array::from_fn(|i| &qs[i][h * hd..(h + 1) * hd]);
            let mut t = 0;
            while t + 2 <= tn {
                let r = K::tile::<ROWS, 2, f32>(hd, q, [key(t, h), key(t + 1, h)]);
                for (i, row) in r.iter().enumerate() {
                    scores[i * stride + (t0 + t) * nh + h] = row[0];
                    scores[i * stride + (t0 + t + 1) * nh + h] = row[1];
                }
                t += 2;
            }
            if t < tn {
                let r = K::tile::<ROWS, 1, f32>(hd, q, [key(t, h)]);
                for (i, row) in r.iter().enumerate() {
                    scores[i * stride + (t0 + t) * nh + h] = row[0];
                }
            }
        }
        t0 += tn;
    }
    let mut parts = parts;
    for (i, part) in parts.iter_mut().enumerate() {
        let (m, rest) = part.split_at_mut(nh);
        let (l, _) = rest.split_at_mut(nh);
        softmax_columns(&mut scores[i * stride..i * stride + t0 * nh], nh, m, l);
    }
    // Weighted sums: per head and 16 (or 8) of its dims, one accumulator
    // per row and 8 dims across the tile's positions in order.
    let chunks = hd / L;
    for (h, &ko) in koff.iter().enumerate().take(nh) {
        let mut c = 0;
        while c + 2 <= chunks {
            weigh::<K, 2>(
                &scores[..],
                segs,
                n,
                nh,
                kvd,
                ko + c * L,
                h,
                &mut parts,
                2 * nh + h * hd + c * L,
            );
            c += 2;
        }
        if c < chunks {
            weigh::<K, 1>(
                &scores[..],
                segs,
                n,
                nh,
                kvd,
                ko + c * L,
                h,
                &mut parts,
                2 * nh + h * hd + c * L,
            );
        }
    }
}

/// `C * 8` weighted sums of head `h` for each of the [`ROWS`] rows:
/// `sum over t of w[i][t][h] * v[t][col ..]`, multiply-adds in position
/// order, into `parts[i][at ..]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weigh<K: Kernel, const C: usize>(
    scores: &[f32],
    segs: &[Seg<'_>],
    n: usize,
    nh: usize,
    kvd: usize,
    col: usize,
    h: usize,
    parts: &mut [&mut [f32]; ROWS],
    at: usize,
) {
    const L: usize = crate::backend::cpu::kernel::LANES;
    let stride = n * nh;
    let mut acc = [[[0f32; L]; C]; ROWS];
    let mut t0 = 0;
    for s in segs {
        let tn = s.n.min(n - t0);
        if tn == 0 {
            break;
        }
        for t in 0..tn {
            let base = t * kvd + col;
            let v = &s.vals[base..base + C * L];
            for (i, a) in acc.iter_mut().enumerate() {
                let w = scores[i * stride + (t0 + t) * nh + h];
                for c in 0..C {
                    for l in 0..L {
                        let x = v[c * L + l];
                        a[c][l] = if K::FMA {
                            w.mul_add(x, a[c][l])
                        } else {
                            a[c][l] + w * x
                        };
                    }
                }
            }
        }
        t0 += tn;
    }
    for (i, part) in parts.iter_mut().enumerate() {
        for c in 0..C {
            part[at + c * L..at + (c + 1) * L].copy_from_slice(&acc[i][c]);
        }
    }
}
