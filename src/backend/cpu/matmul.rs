//! `out = x · Wᵀ` on the CPU.
//!
//! Every output element is one dot product computed in a fixed order (eight
//! lane accumulators over the shared dimension, a fixed reduction tree, then
//! the tail), whatever tile it falls in and whichever thread computes it. So
//! a sequence's numbers are bit-identical alone or inside any batch, which is
//! what makes greedy output independent of batching.
//!
//! Tiles reuse each loaded weight chunk for several activation rows: one
//! pass over the weights serves every sequence of a step.

/// Lane accumulators per dot product. Fixed: it defines the summation order.
pub(crate) const LANES: usize = 8;

#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// The dot product every matmul element and attention score uses.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let out = tile::<1, 1>([a], [b]);
    out[0][0]
}

/// Dot products of `M` activation rows with `N` weight rows (all of equal
/// length), `[M][N]`.
#[inline(always)]
fn tile<const M: usize, const N: usize>(x: [&[f32]; M], w: [&[f32]; N]) -> [[f32; N]; M] {
    let k = x[0].len();
    let chunks = k / LANES;
    let xc: [&[[f32; LANES]]; M] = x.map(|r| &r.as_chunks::<LANES>().0[..chunks]);
    let wc: [&[[f32; LANES]]; N] = w.map(|r| &r.as_chunks::<LANES>().0[..chunks]);
    let mut acc = [[[0f32; LANES]; N]; M];
    for c in 0..chunks {
        let wv: [[f32; LANES]; N] = std::array::from_fn(|j| wc[j][c]);
        for i in 0..M {
            let xv = xc[i][c];
            for j in 0..N {
                for l in 0..LANES {
                    acc[i][j][l] += xv[l] * wv[j][l];
                }
            }
        }
    }
    let mut out = [[0f32; N]; M];
    for i in 0..M {
        for j in 0..N {
            let mut s = reduce(&acc[i][j]);
            for t in chunks * LANES..k {
                s += x[i][t] * w[j][t];
            }
            out[i][j] = s;
        }
    }
    out
}

/// Computes output columns `cols` (weight rows) for all `m` rows of `x`.
/// Element `(i, j)` is stored at `out[i * row_stride + (j - cols.start) *
/// col_stride]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    const NW: usize = 4;
    let xr = |i: usize| &x[i * k..(i + 1) * k];
    let wr = |j: usize| &w[j * k..(j + 1) * k];
    let mut j = cols.start;
    let mut store = |i: usize, jj: usize, v: f32| {
        out[i * row_stride + (jj - cols.start) * col_stride] = v;
    };
    while j < cols.end {
        if j + NW <= cols.end {
            let ws: [&[f32]; NW] = std::array::from_fn(|t| wr(j + t));
            let mut i = 0;
            while i + 2 <= m {
                let r = tile::<2, NW>([xr(i), xr(i + 1)], ws);
                for (a, row) in r.iter().enumerate() {
                    for (b, &v) in row.iter().enumerate() {
                        store(i + a, j + b, v);
                    }
                }
                i += 2;
            }
            if i < m {
                let r = tile::<1, NW>([xr(i)], ws);
                for (b, &v) in r[0].iter().enumerate() {
                    store(i, j + b, v);
                }
            }
            j += NW;
        } else {
            for i in 0..m {
                store(i, j, tile::<1, 1>([xr(i)], [wr(j)])[0][0]);
            }
            j += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for t in 0..k {
                    s += x[i * k + t] as f64 * w[j * k + t] as f64;
                }
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_naive_for_odd_shapes_and_is_batch_invariant() {
        for (m, k, n) in [(1, 1, 1), (3, 7, 5), (5, 17, 9), (2, 64, 8), (7, 33, 13)] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let mut out = vec![0f32; m * n];
            matmul_cols(&x, m, k, &w, 0..n, &mut out, n, 1);
            let want = naive(&x, m, k, &w, n);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "{m}x{k}x{n}: {a} vs {b}");
            }
            // Each row alone gives bit-identical numbers.
            for i in 0..m {
                let mut one = vec![0f32; n];
                matmul_cols(&x[i * k..(i + 1) * k], 1, k, &w, 0..n, &mut one, n, 1);
                assert_eq!(one, out[i * n..(i + 1) * n]);
            }
        }
    }
}
