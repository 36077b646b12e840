//! The tensor-core matmuls of 16-bit weights (cuda/linear_mma.cuh): one
//! product, up to three products of one input, and a SwiGLU pair, with
//! the stages they carry (RMSNorm of x, SwiGLU), on the tile the rows pick
//! (`plan::Bf16Tile`).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::Write;
use crate::backend::cuda::params::{LinearMmaGroupParams, LinearMmaParams};
use crate::backend::cuda::plan::{Bf16Tile, dims, grid, matmul_shape, shape, to_u32};
use crate::backend::cuda::table::LMMA_GROUPS;
use crate::backend::cuda::{CudaDevice, CudaError, HalfWeights};

/// Ok when there is no RMSNorm to carry, or `tile` carries it (the decode
/// tile) and its weight has the matmul's depth `k`.
fn check_norm<N: DevicePtr<f32>>(
    norm: Option<(&N, f32)>,
    tile: Bf16Tile,
    k: usize,
) -> Result<(), CudaError> {
    let Some((w, _)) = norm else {
        return Ok(());
    };
    Bf16Tile::carries("RMSNorm", tile, Bf16Tile::Decode)?;
    shape("RMSNorm weight (the matmul depth)", k, w.len())
}

impl CudaDevice {
    /// `out = x · wᵀ` (or `+=`, as `write` says) with 16-bit weights `w`
    /// `[n, k]` (raw bits of `h`) on tensor cores (cuda/linear_mma.cuh):
    /// about 16 bits of each activation meet the weights (all of an f16
    /// weight's bits, split in registers), summed in f32 in k order
    /// (batch-invariant). From 32 rows of x on, the wide tile (32 x 32)
    /// runs, and from 128 the prefill tile (128 x 64, operands staged in
    /// shared memory by a cp.async pipeline): the same sums in the same
    /// order, so the same bits, with less traffic per product.
    pub fn linear_half(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
        write: Write,
    ) -> Result<(), CudaError> {
        let (norm, up) = (None::<(&CudaSlice<f32>, f32)>, None::<&CudaSlice<u16>>);
        self.linear_half_tile(h, x, w, n, out, write, norm, up)
    }

    /// The one launch of a single 16-bit product, on the tile its rows pick,
    /// with the stages it carries: RMSNorm of x (`norm`: weight and
    /// epsilon; the decode tile) and SwiGLU with `w_up` (decode and wide
    /// tiles).
    #[allow(clippy::too_many_arguments)]
    fn linear_half_tile<N: DevicePtr<f32>, U: DevicePtr<u16>>(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
        write: Write,
        norm: Option<(&N, f32)>,
        w_up: Option<&U>,
    ) -> Result<(), CudaError> {
        let Some((m, k)) = matmul_shape(x.len(), w.len(), n, out.len())? else {
            return Ok(());
        };
        let tile = Bf16Tile::for_rows(m);
        check_norm(norm, tile, k)?;
        if let Some(up) = w_up {
            Bf16Tile::carries("SwiGLU", tile, Bf16Tile::Wide)?;
            shape("SwiGLU up weight (the gate's size)", w.len(), up.len())?;
        }
        // A SwiGLU pair's column block holds half the tile's columns of
        // each product.
        let (bm, bn) = (
            tile.rows(),
            tile.cols() / if w_up.is_some() { 2 } else { 1 },
        );
        let kernel = tile.single(h)?;
        let Some(grid) = grid(
            "tensor-core matmul blocks (columns, rows)",
            n.div_ceil(bn),
            m.div_ceil(bm),
            1,
        )?
        else {
            return Ok(());
        };
        let (m, n, k) = dims(m, n, k)?;
        // Launch contract: x holds m*k f32, w (and w_up) n*k bf16, out m*n
        // f32, norm_w k f32 (checked); stages are carried only by the
        // tiles that have them (checked: the prefill tile none); the grid
        // covers n columns in blocks of bn and m rows in tiles of bm, the
        // tile of the kernel chosen, and the kernel bounds every access by
        // m, n, k.
        self.launch_bound(kernel, grid, move |a| {
            let mut p = LinearMmaParams {
                x: a.read(x),
                w: a.read(w),
                out: a.write(out),
                m,
                n,
                k,
                accumulate: write.accumulate(),
                ..Default::default()
            };
            if let Some(up) = w_up {
                p.w_up = a.read(up);
            }
            if let Some((nw, eps)) = norm {
                (p.norm_w, p.norm_eps) = (a.read(nw), eps);
            }
            p
        })
    }

    /// `outs[i] = x · ws[i]ᵀ`, `ws[i]` 16-bit (all of `h`) `[ns[i], k]`,
    /// for up to three (`LMMA_GROUPS`) products of one input (q, k and v;
    /// gate and up) in one launch: each block computes a tile of one
    /// product with the code of [`CudaDevice::linear_half`] on the tile its
    /// row count picks, so each product has the bits of its own launch.
    pub fn linear_half_many<W: DevicePtr<u16>, O: DevicePtrMut<f32>>(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        ws: &[&W],
        ns: &[usize],
        outs: &mut [O],
    ) -> Result<(), CudaError> {
        self.linear_half_group(h, x, None::<(&CudaSlice<f32>, f32)>, ws, ns, outs)
    }

    /// [`CudaDevice::rms_norm`] of `x` with `norm_w` and `eps`, then
    /// [`CudaDevice::linear_half_many`] of its output, in one launch: each
    /// block sums its rows' squares in rms_norm's order and normalises x as
    /// it loads it, so the outputs have the bits of the two launches.
    /// Decode-sized batches only (fewer than `LMMA_WIDE_BM` rows: the
    /// decode tile), where a block re-reading its rows costs less than a
    /// launch; more rows are a typed `Unsupported`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_half_many_normed<W: DevicePtr<u16>, O: DevicePtrMut<f32>>(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        norm_w: &impl DevicePtr<f32>,
        eps: f32,
        ws: &[&W],
        ns: &[usize],
        outs: &mut [O],
    ) -> Result<(), CudaError> {
        self.linear_half_group(h, x, Some((norm_w, eps)), ws, ns, outs)
    }

    fn linear_half_group<N: DevicePtr<f32>, W: DevicePtr<u16>, O: DevicePtrMut<f32>>(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        norm: Option<(&N, f32)>,
        ws: &[&W],
        ns: &[usize],
        outs: &mut [O],
    ) -> Result<(), CudaError> {
        let count = ws.len();
        if count == 0 || count > LMMA_GROUPS || ns.len() != count || outs.len() != count {
            return Err(CudaError::Unsupported {
                what: "products in one grouped matmul",
                detail: format!(
                    "{count} weights, {} widths, {} outputs (1 to {LMMA_GROUPS} of each, as many)",
                    ns.len(),
                    outs.len()
                ),
            });
        }
        let mut shape = None;
        for i in 0..count {
            let Some(mk) = matmul_shape(x.len(), ws[i].len(), ns[i], outs[i].len())? else {
                return Ok(()); // no rows
            };
            if shape.is_some_and(|s| s != mk) {
                return Err(CudaError::Shape {
                    what: "grouped matmul depth (every weight's columns)",
                    expected: shape.map_or(0, |(_, k)| k),
                    got: mk.1,
                });
            }
            shape = Some(mk);
        }
        let Some((m, k)) = shape else {
            return Ok(());
        };
        let tile = Bf16Tile::for_rows(m);
        check_norm(norm, tile, k)?;
        let (bm, bn) = (tile.rows(), tile.cols());
        let kernel = tile.group(h)?;
        // Column blocks of product i (0 past the last).
        let blocks = |i: usize| ns.get(i).map_or(0, |n| n.div_ceil(bn));
        let (m32, k32) = (to_u32("matmul rows", m)?, to_u32("matmul depth", k)?);
        let mut widths = [0; LMMA_GROUPS];
        for (to, &n) in widths.iter_mut().zip(ns) {
            *to = to_u32("matmul columns", n)?;
        }
        let blocks0 = to_u32("matmul column blocks", blocks(0))?;
        let blocks1 = to_u32("matmul column blocks", blocks(1))?;
        let Some(grid) = grid(
            "grouped tensor-core matmul blocks (columns, rows)",
            (0..count).map(blocks).sum(),
            m.div_ceil(bm),
            1,
        )?
        else {
            return Ok(());
        };
        // Launch contract: x holds m*k f32, each w n_i*k bf16 and each out
        // m*n_i f32 (checked, every product of the same depth k), norm_w
        // (when set, on the decode tile only: checked) k f32; grid.x is the
        // products' column blocks of the chosen tile back to back (blocks0
        // and blocks1 tell the kernel where products 1 and 2 start), grid.y
        // the row tiles, and the kernel bounds every access by m, its
        // product's n, and k.
        self.launch_bound(kernel, grid, move |a| {
            let mut p = LinearMmaGroupParams {
                x: a.read(x),
                m: m32,
                k: k32,
                n_groups: count as u32,
                blocks0,
                blocks1,
                ..Default::default()
            };
            if let Some((w, eps)) = norm {
                (p.norm_w, p.norm_eps) = (a.read(w), eps);
            }
            let products = ws.iter().zip(outs.iter_mut()).zip(widths);
            for (i, ((w, out), n)) in products.enumerate() {
                let (w, out) = (a.read(*w), a.write(out));
                match i {
                    0 => (p.w0, p.out0, p.n0) = (w, out, n),
                    1 => (p.w1, p.out1, p.n1) = (w, out, n),
                    _ => (p.w2, p.out2, p.n2) = (w, out, n),
                }
            }
            p
        })
    }

    /// `out = SwiGLU(x' · w_gateᵀ, x' · w_upᵀ)`, both weights 16-bit (of
    /// `h`) `[n, k]`, with `x' = RMSNorm(x)` (`norm`: its weight and
    /// epsilon) or `x`, in one launch: a block computes the same columns of both products (the
    /// code of [`CudaDevice::linear_half`], so the same sums) and stores
    /// SwiGLU of each pair as [`CudaDevice::swiglu`] computes it: the bits
    /// of rms_norm, the two matmuls and swiglu. Fewer than `LGEMM_BM` rows
    /// (the decode and wide tiles), and with `norm` fewer than
    /// `LMMA_WIDE_BM` (the decode tile); more are a typed `Unsupported`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_half_swiglu(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        norm: Option<(&impl DevicePtr<f32>, f32)>,
        w_gate: &impl DevicePtr<u16>,
        w_up: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_half_tile(h, x, w_gate, n, out, Write::Store, norm, Some(w_up))
    }
}
