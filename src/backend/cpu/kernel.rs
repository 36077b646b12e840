//! What every CPU kernel shares, whatever its instruction set: the lane
//! count and reduction tree that fix each dot product's order, the weight
//! element formats, the [`Kernel`] trait, and the tiling of a matmul over
//! it. The instruction-set modules (`x86`) implement [`Kernel`] and import
//! only from here (and other leaves), so none of them depends on the
//! dispatching modules (`matmul`, `attention`) that call into them.

/// Lane accumulators per dot product. Fixed: it defines the summation order.
pub(crate) const LANES: usize = 8;

#[inline(always)]
pub(crate) fn reduce(acc: &[f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// A split Q8_0 (`q8`) or Q4_1 block (`quant::SplitQuant`): its quant
/// bytes (32 signed bytes, or 16 bytes of two nibbles) and its f16 scales
/// (`d`, or `d, m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SplitBlock {
    pub(crate) quant_bytes: usize,
    pub(crate) scales: usize,
}

impl SplitBlock {
    pub(crate) const fn of(q8: bool) -> Self {
        if q8 {
            SplitBlock {
                quant_bytes: 32,
                scales: 1,
            }
        } else {
            SplitBlock {
                quant_bytes: 16,
                scales: 2,
            }
        }
    }
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

/// Weight panels: columns (output features) in groups of [`LANES`], each
/// group stored `[k][LANES]` (zero-padded past `n`), so a kernel reads one
/// register of eight outputs' weights per step of the shared dimension.
pub(crate) const PANEL: usize = LANES;
