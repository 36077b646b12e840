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
//!
//! Two instruction sets, chosen once per backend ([`Isa`]): portable code
//! (SSE2 on x86-64), and AVX2 with fused multiply-add where the CPU has it.
//! The FMA variant rounds once per multiply-add, so its numbers differ from
//! the portable ones in the last bits; a backend never mixes the two.

use crate::backend::cpu::Isa;

/// Lane accumulators per dot product. Fixed: it defines the summation order.
pub(crate) const LANES: usize = 8;

#[inline(always)]
pub(crate) fn reduce(acc: &[f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// A stored weight element, widened exactly to f32 before any arithmetic:
/// f32 itself, or a 16-bit format ([`Bf16`], [`F16`]) for weights that are
/// all exactly such values (a bf16 or f16 checkpoint), which then take half
/// the memory and half the memory traffic and give the same numbers bit for
/// bit.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// The storage, for the AVX2 kernel's loads.
    const KIND: ElemKind;
    fn f32(self) -> f32;
}

/// How an [`Elem`] is laid out.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum ElemKind {
    F32,
    /// The upper 16 bits of an f32.
    Bf16,
    /// IEEE binary16.
    F16,
}

impl Elem for f32 {
    const KIND: ElemKind = ElemKind::F32;
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

/// A 16-bit weight format that holds some f32 values exactly.
pub(crate) trait Half: Elem {
    /// `v` in this format when that loses nothing (bit for bit, so a NaN
    /// payload or the sign of zero is never changed).
    fn exact(v: f32) -> Option<Self>;
}

/// The upper 16 bits of an f32 whose lower 16 bits are zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Bf16(pub(crate) u16);

impl Elem for Bf16 {
    const KIND: ElemKind = ElemKind::Bf16;
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

impl Half for Bf16 {
    #[inline]
    fn exact(v: f32) -> Option<Bf16> {
        let b = v.to_bits();
        (b & 0xffff == 0).then_some(Bf16((b >> 16) as u16))
    }
}

/// IEEE binary16 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct F16(pub(crate) u16);

impl Elem for F16 {
    const KIND: ElemKind = ElemKind::F16;
    #[inline(always)]
    fn f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }
}

impl Half for F16 {
    #[inline]
    fn exact(v: f32) -> Option<F16> {
        let h = half::f16::from_f32(v);
        (h.to_f32().to_bits() == v.to_bits()).then_some(F16(h.to_bits()))
    }
}

/// Row-major weights as stored: f32, or bf16 when every value is exact.
#[derive(Clone, Copy)]
pub(crate) enum WeightRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [Bf16]),
    F16(&'a [F16]),
}

/// The arithmetic of one instruction set. Every element of every op is
/// computed by `tile` (or `axpy`), so the order of operations is the same
/// whatever the tile shape.
pub(crate) trait Kernel {
    /// Whether multiply-adds are fused (rounded once).
    const FMA: bool;

    /// Dot products of `M` activation rows with `N` weight rows, each of at
    /// least `k` elements, over their first `k` elements: `[M][N]`.
    fn tile<const M: usize, const N: usize, W: Elem>(
        k: usize,
        x: [&[f32]; M],
        w: [&[W]; N],
    ) -> [[f32; N]; M];

    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        Self::tile::<1, 1, f32>(a.len().min(b.len()), [a], [b])[0][0]
    }

    /// Attention scores of `tn` key rows (`keys: [tn, kvd]`) against every
    /// query head: `out[t * nh + h] = q[h] · keys[t][koff[h] .. koff[h] +
    /// hd]`, `nh = koff.len()`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn scores(
        q: &[f32],
        keys: &[f32],
        tn: usize,
        kvd: usize,
        koff: &[usize],
        hd: usize,
        out: &mut [f32],
    ) {
        let nh = koff.len();
        for t in 0..tn {
            let row = &keys[t * kvd..(t + 1) * kvd];
            for (h, &ko) in koff.iter().enumerate() {
                out[t * nh + h] = Self::dot(&q[h * hd..(h + 1) * hd], &row[ko..ko + hd]);
            }
        }
    }

    /// For each of `tn` positions `t` in order, every head `h`:
    /// `out[h] += w[t][h] * vals[t][koff[h] .. koff[h] + hd]`, with `w`
    /// `[tn, nh]` and `vals` `[tn, kvd]`. One fused (or not) multiply-add
    /// per element and position, in position order.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn weighted_add(
        out: &mut [f32],
        w: &[f32],
        vals: &[f32],
        tn: usize,
        nh: usize,
        kvd: usize,
        koff: &[usize],
        hd: usize,
    ) {
        for t in 0..tn {
            let row = &vals[t * kvd..(t + 1) * kvd];
            for (h, &ko) in koff.iter().enumerate().take(nh) {
                Self::axpy(
                    &mut out[h * hd..(h + 1) * hd],
                    w[t * nh + h],
                    &row[ko..ko + hd],
                );
            }
        }
    }

    /// `o += w * v`.
    #[inline(always)]
    fn axpy(o: &mut [f32], w: f32, v: &[f32]) {
        for (o, &x) in o.iter_mut().zip(v) {
            *o = if Self::FMA {
                w.mul_add(x, *o)
            } else {
                *o + w * x
            };
        }
    }
}

/// Baseline code: separate multiply and add.
pub(crate) struct Portable;

impl Kernel for Portable {
    const FMA: bool = false;

    #[inline(always)]
    fn tile<const M: usize, const N: usize, W: Elem>(
        k: usize,
        x: [&[f32]; M],
        w: [&[W]; N],
    ) -> [[f32; N]; M] {
        let chunks = k / LANES;
        let xc: [&[[f32; LANES]]; M] = x.map(|r| &r[..k].as_chunks::<LANES>().0[..chunks]);
        let wc: [&[[W; LANES]]; N] = w.map(|r| &r[..k].as_chunks::<LANES>().0[..chunks]);
        let mut acc = [[[0f32; LANES]; N]; M];
        for c in 0..chunks {
            for i in 0..M {
                for j in 0..N {
                    for l in 0..LANES {
                        acc[i][j][l] += xc[i][c][l] * wc[j][c][l].f32();
                    }
                }
            }
        }
        let mut out = [[0f32; N]; M];
        for i in 0..M {
            for j in 0..N {
                let mut s = reduce(&acc[i][j]);
                for t in chunks * LANES..k {
                    s += x[i][t] * w[j][t].f32();
                }
                out[i][j] = s;
            }
        }
        out
    }
}

/// The portable dot product (norms use it on every backend).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    Portable::dot(a, b)
}

/// Computes output columns `cols` (weight rows) for all `m` rows of `x`:
/// rows in blocks of `MR` with `MR x NR` tiles, the rows left over one at a
/// time with `1 x NR1` tiles (so a kernel can pick, for each, a tile whose
/// accumulators reduce together). Element `(i, j)` is stored at
/// `out[i * row_stride + (j - cols.start) * col_stride]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols_k<
    K: Kernel,
    W: Elem,
    const MR: usize,
    const NR: usize,
    const NR1: usize,
>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    let blocked = m - m % MR;
    let g = Grid {
        x,
        k,
        w,
        c0: cols.start,
        row_stride,
        col_stride,
    };
    g.pass::<K, MR, NR>(0..blocked, cols.clone(), out);
    g.pass::<K, 1, NR1>(blocked..m, cols, out);
}

/// The operands of one `matmul_cols_k` call.
struct Grid<'a, W> {
    x: &'a [f32],
    k: usize,
    w: &'a [W],
    c0: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<W: Elem> Grid<'_, W> {
    /// Rows `rows` (a multiple of `MR` long) by columns `cols`, in `MR x NR`
    /// tiles; columns left over by `NR` one by one.
    #[inline(always)]
    fn pass<K: Kernel, const MR: usize, const NR: usize>(
        &self,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        if rows.is_empty() {
            return;
        }
        let k = self.k;
        let xr = |i: usize| &self.x[i * k..(i + 1) * k];
        let wr = |j: usize| &self.w[j * k..(j + 1) * k];
        let at = |i: usize, j: usize| i * self.row_stride + (j - self.c0) * self.col_stride;
        let mut j = cols.start;
        while j + NR <= cols.end {
            let ws: [&[W]; NR] = std::array::from_fn(|t| wr(j + t));
            let mut i = rows.start;
            while i + MR <= rows.end {
                let r = K::tile::<MR, NR, W>(k, std::array::from_fn(|a| xr(i + a)), ws);
                for (a, row) in r.iter().enumerate() {
                    for (b, &v) in row.iter().enumerate() {
                        out[at(i + a, j + b)] = v;
                    }
                }
                i += MR;
            }
            j += NR;
        }
        for j in j..cols.end {
            for i in rows.clone() {
                out[at(i, j)] = K::tile::<1, 1, W>(k, [xr(i)], [wr(j)])[0][0];
            }
        }
    }
}

/// `matmul_cols_k` for the backend's instruction set and the weights'
/// storage.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_cols(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: WeightRows<'_>,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    match w {
        WeightRows::F32(w) => matmul_cols_of(isa, x, m, k, w, cols, out, row_stride, col_stride),
        WeightRows::Bf16(w) => matmul_cols_of(isa, x, m, k, w, cols, out, row_stride, col_stride),
        WeightRows::F16(w) => matmul_cols_of(isa, x, m, k, w, cols, out, row_stride, col_stride),
    }
}

#[allow(clippy::too_many_arguments)]
fn matmul_cols_of<W: Elem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    cols: std::ops::Range<usize>,
    out: &mut [f32],
    row_stride: usize,
    col_stride: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => {
            // SAFETY: a CpuBackend holds `Isa::Avx2Fma` only after the CPU
            // reported AVX2 and FMA (`CpuBackend::build` validates it).
            unsafe {
                crate::backend::cpu::x86::matmul_cols(x, m, k, w, cols, out, row_stride, col_stride)
            }
        }
        _ => matmul_cols_k::<Portable, W, 2, 2, 4>(x, m, k, w, cols, out, row_stride, col_stride),
    }
}

/// Weight panels: columns (output features) in groups of [`LANES`], each
/// group stored `[k][LANES]` (zero-padded past `n`), so a kernel reads one
/// register of eight outputs' weights per step of the shared dimension.
pub(crate) const PANEL: usize = LANES;

/// Dot products at most this long use packed panels (on AVX2): there the
/// row-major tiles' horizontal reductions weigh as much as the
/// multiply-adds. Longer ones (large models) keep the row-major tiles.
pub(crate) const PACK_MAX_K: usize = 256;

/// Whether a `[rows, cols]` weight is packed (AVX2 backends only).
pub(crate) fn packs(rows: usize, cols: usize) -> bool {
    rows > 1 && cols > 0 && cols < PACK_MAX_K
}

/// `w: [n, k]` row-major into panels (see [`PANEL`]).
pub(crate) fn pack(w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let panels = n.div_ceil(PANEL);
    let mut out = vec![0f32; panels * k * PANEL];
    for (j, row) in w.chunks_exact(k).take(n).enumerate() {
        let base = (j / PANEL) * k * PANEL + j % PANEL;
        for (t, &v) in row.iter().enumerate() {
            out[base + t * PANEL] = v;
        }
    }
    out
}

/// `out = x · Wᵀ` (`x: [m, k]`, `out: [m, n]`) from packed panels. Each
/// output element is one chain of fused multiply-adds over `t = 0..k` in
/// order, whichever tile computes it, so rows are bit-identical alone or
/// batched.
pub(crate) fn matmul_packed(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    packed: &[f32],
    n: usize,
    out: &mut [f32],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => {
            // SAFETY: a CpuBackend holds `Isa::Avx2Fma` only after the CPU
            // reported AVX2 and FMA (`CpuBackend::build` validates it).
            unsafe { crate::backend::cpu::x86::matmul_packed(x, m, k, packed, n, out) }
        }
        // Only AVX2 backends pack; stay correct regardless.
        _ => {
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0f32;
                    for t in 0..k {
                        s = x[i * k + t]
                            .mul_add(packed[(j / PANEL) * k * PANEL + t * PANEL + j % PANEL], s);
                    }
                    out[i * n + j] = s;
                }
            }
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
    fn matches_naive_for_odd_shapes_and_is_batch_invariant_on_every_isa() {
        for isa in Isa::available() {
            for (m, k, n) in [
                (1, 1, 1),
                (3, 7, 5),
                (5, 17, 9),
                (2, 64, 8),
                (7, 33, 13),
                (6, 300, 7),
            ] {
                let x = data(m * k, 1);
                let w = data(n * k, 2);
                let mut out = vec![0f32; m * n];
                matmul_cols(isa, &x, m, k, WeightRows::F32(&w), 0..n, &mut out, n, 1);
                let want = naive(&x, m, k, &w, n);
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-4, "{isa:?} {m}x{k}x{n}: {a} vs {b}");
                }
                // Each row alone gives bit-identical numbers.
                for i in 0..m {
                    let mut one = vec![0f32; n];
                    let xi = &x[i * k..(i + 1) * k];
                    matmul_cols(isa, xi, 1, k, WeightRows::F32(&w), 0..n, &mut one, n, 1);
                    assert_eq!(one, out[i * n..(i + 1) * n]);
                }
            }
        }
    }

    /// Values that are exactly bf16 (what a bf16 checkpoint loads as).
    fn bf16_data(n: usize, seed: u32) -> Vec<f32> {
        data(n, seed)
            .into_iter()
            .map(|v| f32::from_bits(v.to_bits() & 0xffff_0000))
            .collect()
    }

    /// Values that are exactly f16, subnormals and signed zeros included.
    fn f16_data(n: usize, seed: u32) -> Vec<f32> {
        let mut v: Vec<f32> = data(n, seed)
            .into_iter()
            .map(|v| half::f16::from_f32(v * 3.0).to_f32())
            .collect();
        for (i, x) in v.iter_mut().enumerate().step_by(5) {
            let special = [-0.0, 6.0e-8, -3.0e-5, 65504.0][i % 4];
            *x = half::f16::from_f32(special).to_f32();
        }
        v
    }

    /// `matmul_cols` with weights stored as `H` and as f32 agree bit for
    /// bit, over every tile shape of both kernels: k below and above 256,
    /// rows in blocks and left over, columns left over by the tile and
    /// ranges not starting at 0.
    fn check_storage<H: Half>(make: fn(usize, u32) -> Vec<f32>, view: fn(&[H]) -> WeightRows<'_>) {
        for isa in Isa::available() {
            for (m, k, n) in [
                (1, 8, 1),
                (3, 7, 5),
                (5, 17, 9),
                (9, 64, 13),
                (6, 300, 7),
                (4, 512, 12),
            ] {
                let x = data(m * k, 3);
                let w = make(n * k, 4);
                let halves: Vec<H> = w.iter().map(|&v| H::exact(v).unwrap()).collect();
                for cols in [0..n, 1..n.max(2) - 1] {
                    let width = cols.len();
                    let mut want = vec![f32::NAN; m * width];
                    let mut got = vec![f32::NAN; m * width];
                    let f32_rows = WeightRows::F32(&w);
                    matmul_cols(isa, &x, m, k, f32_rows, cols.clone(), &mut want, width, 1);
                    let rows = view(&halves);
                    matmul_cols(isa, &x, m, k, rows, cols.clone(), &mut got, width, 1);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{isa:?} {m}x{k}x{n} cols {cols:?}");
                }
            }
        }
    }

    #[test]
    fn bf16_weights_give_the_f32_kernels_numbers_bit_for_bit() {
        check_storage::<Bf16>(bf16_data, |h| WeightRows::Bf16(h));
    }

    #[test]
    fn f16_weights_give_the_f32_kernels_numbers_bit_for_bit() {
        check_storage::<F16>(f16_data, |h| WeightRows::F16(h));
    }

    #[test]
    fn only_exact_values_become_16_bit() {
        assert_eq!(Bf16::exact(1.0).map(|b| b.f32()), Some(1.0));
        assert_eq!(
            Bf16::exact(-0.0).map(|b| b.f32().to_bits()),
            Some((-0.0f32).to_bits())
        );
        assert!(Bf16::exact(f32::INFINITY).is_some());
        assert!(Bf16::exact(1.0 + f32::EPSILON).is_none());
        assert!(Bf16::exact(0.1).is_none());

        assert_eq!(F16::exact(0.5).map(|h| h.f32()), Some(0.5));
        assert_eq!(
            F16::exact(-0.0).map(|h| h.f32().to_bits()),
            Some((-0.0f32).to_bits())
        );
        // Past f16's range, below its smallest subnormal, or finer than
        // its mantissa: not exact.
        assert!(F16::exact(70000.0).is_none());
        assert!(F16::exact(1.0e-9).is_none());
        assert!(F16::exact(1.0 + 1.0 / 4096.0).is_none());
        // A NaN payload the format cannot carry is refused, not changed.
        let payload = f32::from_bits(0x7f80_0001);
        assert!(F16::exact(payload).is_none() && Bf16::exact(payload).is_none());
    }

    #[test]
    fn packed_panels_match_naive_and_every_row_is_the_same_alone_or_batched() {
        // Every tile shape: bands of 6, 5..2 rows, a single row; panel
        // counts odd and even, a last panel cut short (n not a multiple of
        // 8); k short and up to the packing limit.
        for isa in Isa::available() {
            for (k, n) in [
                (1, 1),
                (7, 5),
                (64, 32),
                (64, 172),
                (172, 64),
                (255, 9),
                (64, 512),
            ] {
                assert!(packs(n, k) || n == 1);
                let w = data(n * k, 5);
                let p = pack(&w, n, k);
                for m in [1, 2, 3, 4, 5, 6, 7, 13, 16] {
                    let x = data(m * k, 6 + m as u32);
                    let mut out = vec![f32::NAN; m * n];
                    matmul_packed(isa, &x, m, k, &p, n, &mut out);
                    let want = naive(&x, m, k, &w, n);
                    for (a, b) in out.iter().zip(&want) {
                        assert!(
                            (a - b).abs() < 1e-4 * (1.0 + b.abs()),
                            "{isa:?} {m}x{k}x{n}: {a} vs {b}"
                        );
                    }
                    for i in 0..m {
                        let mut one = vec![f32::NAN; n];
                        matmul_packed(isa, &x[i * k..(i + 1) * k], 1, k, &p, n, &mut one);
                        assert_eq!(one, out[i * n..(i + 1) * n], "{isa:?} row {i} of {m}");
                    }
                }
            }
        }
    }
}
