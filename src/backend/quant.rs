//! ggml's block formats, dequantized as ggml's reference
//! `dequantize_row_*` functions define them: each value rounded to f32 once
//! per operation in the same order, except that `q * d + m` (Q4_1, Q5_1)
//! is one fused multiply-add, rounded once (as ggml's C compiles on FMA
//! hardware). This module is the definition: a quantized matrix kept
//! quantized by a backend and one dequantized up front hold the same f32
//! values.

use crate::backend::GgmlType;
use crate::format::gguf::GgufError;

/// Why bytes are not a quantized matrix handoff computes with. The GGUF
/// loader reports each as the matching [`GgufError`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantError {
    #[error("tensor {tensor} is stored as {ty}, which handoff cannot compute with")]
    UnsupportedType { tensor: String, ty: GgmlType },
    #[error("tensor {tensor} has dims {dims:?}, not whole blocks of its type")]
    BadDims { tensor: String, dims: Vec<u64> },
    #[error("{what}: needs {needed} bytes, {available} given")]
    Truncated {
        what: String,
        needed: u64,
        available: u64,
    },
}

impl From<QuantError> for GgufError {
    fn from(e: QuantError) -> Self {
        match e {
            QuantError::UnsupportedType { tensor, ty } => GgufError::UnsupportedType { tensor, ty },
            QuantError::BadDims { tensor, dims } => GgufError::BadDims { tensor, dims },
            QuantError::Truncated {
                what,
                needed,
                available,
            } => GgufError::Truncated {
                what,
                needed,
                available,
            },
        }
    }
}

/// A matrix `[rows, cols]` kept in a ggml storage type: each row is
/// `cols / block_elems` blocks. Built only through [`QuantMatrix::new`],
/// which checks that the bytes are exactly that long and the type is one
/// handoff computes with.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl QuantMatrix {
    /// A matrix of `rows` rows of `cols` elements stored as `ty` in `data`;
    /// `tensor` names it in errors.
    pub fn new(
        tensor: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, QuantError> {
        if !ty.computable() {
            return Err(QuantError::UnsupportedType {
                tensor: tensor.to_string(),
                ty,
            });
        }
        let block = ty.block_elems() as usize;
        let shape_err = || QuantError::BadDims {
            tensor: tensor.to_string(),
            dims: vec![cols as u64, rows as u64],
        };
        if cols == 0 || rows == 0 || !cols.is_multiple_of(block) {
            return Err(shape_err());
        }
        let row_bytes = (cols / block)
            .checked_mul(ty.block_bytes() as usize)
            .ok_or_else(shape_err)?;
        let want = row_bytes.checked_mul(rows).ok_or_else(shape_err)?;
        if data.len() != want {
            return Err(QuantError::Truncated {
                what: format!("tensor {tensor}"),
                needed: want as u64,
                available: data.len() as u64,
            });
        }
        Ok(QuantMatrix {
            ty,
            rows,
            cols,
            data,
        })
    }

    pub fn ggml_type(&self) -> GgmlType {
        self.ty
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The stored bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
    /// The stored bytes, taken.
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.data
    }
    /// Stored bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows
    }
    /// The stored bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Row `r` as f32 into `out` (`cols` long).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize(self.ty, self.row(r), out);
    }

    /// The row-major index of the first element that dequantizes to an
    /// infinity or NaN, if any. A block's values are all finite exactly
    /// when its f16 scale fields are (the largest finite scales times the
    /// largest quants stay far inside f32's range; a test checks every
    /// type at its extremes), so only blocks with a non-finite scale are
    /// dequantized to find it.
    pub fn first_non_finite(&self) -> Option<usize> {
        let bb = self.ty.block_bytes() as usize;
        let be = self.ty.block_elems() as usize;
        let fields = scale_fields(self.ty);
        let mut y = [0f32; 256];
        for (i, b) in self.data.chunks_exact(bb).enumerate() {
            let suspect = fields.is_none_or(|f| f.iter().any(|&at| !f16(b, at).is_finite()));
            if suspect {
                let y = &mut y[..be];
                block(self.ty, b, y);
                if let Some(j) = y.iter().position(|v| !v.is_finite()) {
                    return Some(i * be + j);
                }
            }
        }
        None
    }

    /// Every element as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        dequantize(self.ty, &self.data, &mut out);
        out
    }
}

#[inline(always)]
fn f16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Byte offsets of the f16 scale fields in a block of `ty`; `None` for the
/// plain float types, whose elements are their own values.
pub(crate) fn scale_fields(ty: GgmlType) -> Option<&'static [usize]> {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => Some(&[0]),
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => Some(&[0, 2]),
        GgmlType::Q6K => Some(&[208]),
        _ => None,
    }
}

/// `src` (whole blocks of `ty`) as f32 into `out`, one element per slot of
/// `out` up to the blocks' elements. `ty` must be computable (checked when
/// a [`QuantMatrix`] is built); others leave `out` as it is.
pub(crate) fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    let be = ty.block_elems() as usize;
    let bb = ty.block_bytes() as usize;
    for (b, y) in src.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        block(ty, b, y);
    }
}

/// One block of `ty` into `y` (`block_elems` long).
#[inline(always)]
pub(crate) fn block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (v, c) in y.iter_mut().zip(b.chunks_exact(4)) {
                *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => y[0] = f16(b, 0),
        GgmlType::Bf16 => y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
        GgmlType::Q8_0 => q8_0_values(f16(b, 0), &b[2..34], y),
        GgmlType::Q4_0 => {
            let d = f16(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = (i32::from(qs[j] & 0xf) - 8) as f32 * d;
                y[j + 16] = (i32::from(qs[j] >> 4) - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => q4_1_values(f16(b, 0), f16(b, 2), &b[4..20], y),
        GgmlType::Q5_0 => {
            let d = f16(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                y[j] = ((u32::from(qs[j] & 0xf) | h0) as i32 - 16) as f32 * d;
                y[j + 16] = ((u32::from(qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
            }
        }
        GgmlType::Q5_1 => {
            let (d, m) = (f16(b, 0), f16(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..24];
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                y[j] = ((u32::from(qs[j] & 0xf) | h0) as f32).mul_add(d, m);
                y[j + 16] = ((u32::from(qs[j] >> 4) | h1) as f32).mul_add(d, m);
            }
        }
        GgmlType::Q4K => {
            let (d, dmin) = (f16(b, 0), f16(b, 2));
            let scales = &b[4..16];
            let qs = &b[16..144];
            for (g, q) in qs.chunks_exact(32).enumerate() {
                let (sc1, m1) = scale_min_k4(2 * g, scales);
                let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(m1));
                let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(m2));
                let y = &mut y[64 * g..64 * g + 64];
                for l in 0..32 {
                    y[l] = d1 * f32::from(q[l] & 0xf) - m1;
                    y[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
                }
            }
        }
        GgmlType::Q5K => {
            let (d, dmin) = (f16(b, 0), f16(b, 2));
            let scales = &b[4..16];
            let qh = &b[16..48];
            let qs = &b[48..176];
            for (g, ql) in qs.chunks_exact(32).enumerate() {
                let (sc1, m1) = scale_min_k4(2 * g, scales);
                let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(m1));
                let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(m2));
                let (u1, u2) = (1u8 << (2 * g), 2u8 << (2 * g));
                let y = &mut y[64 * g..64 * g + 64];
                for l in 0..32 {
                    let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                    let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                    y[l] = d1 * f32::from((ql[l] & 0xf) + h1) - m1;
                    y[l + 32] = d2 * f32::from((ql[l] >> 4) + h2) - m2;
                }
            }
        }
        GgmlType::Q6K => {
            let ql = &b[0..128];
            let qh = &b[128..192];
            let sc = &b[192..208];
            let d = f16(b, 208);
            for n in 0..2 {
                let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                let y = &mut y[128 * n..128 * n + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = i32::from((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32;
                    let q2 = i32::from((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    let s = |i: usize| f32::from(sc[i] as i8);
                    y[l] = d * s(is) * q1 as f32;
                    y[l + 32] = d * s(is + 2) * q2 as f32;
                    y[l + 64] = d * s(is + 4) * q3 as f32;
                    y[l + 96] = d * s(is + 6) * q4 as f32;
                }
            }
        }
        _ => {}
    }
}

/// The 32 values of a Q8_0 block: scale `d` (widened from f16) and its 32
/// signed bytes `qs`, each `q * d`.
#[inline(always)]
pub(crate) fn q8_0_values(d: f32, qs: &[u8], y: &mut [f32]) {
    for (v, &q) in y.iter_mut().zip(&qs[..32]) {
        *v = f32::from(q as i8) * d;
    }
}

/// The 32 values of a Q4_1 block: scale `d`, minimum `m` (both widened from
/// f16) and its 16 bytes `qs`, value `j` in the low nibble of byte `j` and
/// value `j + 16` in its high nibble, each `q * d + m` fused.
#[inline(always)]
pub(crate) fn q4_1_values(d: f32, m: f32, qs: &[u8], y: &mut [f32]) {
    for j in 0..16 {
        y[j] = f32::from(qs[j] & 0xf).mul_add(d, m);
        y[j + 16] = f32::from(qs[j] >> 4).mul_add(d, m);
    }
}

/// An f16 bit pattern widened to f32 (exact).
#[inline(always)]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Scale and min of sub-block `j` of a Q4_K/Q5_K block (6 bits each,
/// packed in 12 bytes), as ggml's `get_scale_min_k4`.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn h(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn q4_1_and_q8_0_blocks_decode_as_ggml_defines_them() {
        // Q4_1: d = 0.5, m = -1; nibbles j and j+16 in byte j.
        let mut b = Vec::new();
        b.extend(h(0.5));
        b.extend(h(-1.0));
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let q = QuantMatrix::new("t", GgmlType::Q4_1, 1, 32, b).unwrap();
        let y = q.dequantize();
        assert_eq!(y[0], -1.0);
        assert_eq!(y[3], 0.5);
        assert_eq!(y[16], 6.5);
        // Q8_0: d = 0.25, q = -128..
        let mut b = Vec::new();
        b.extend(h(0.25));
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = QuantMatrix::new("t", GgmlType::Q8_0, 1, 32, b)
            .unwrap()
            .dequantize();
        assert_eq!(y[0], -4.0);
        assert_eq!(y[31], 3.75);
    }

    #[test]
    fn finite_scales_give_finite_values_and_a_nan_scale_is_found_where_it_is() {
        // Every block type handoff computes with, so that a type added
        // later is held to this too.
        let types = GgmlType::every().filter(|t| t.computable() && t.block_elems() > 1);
        for ty in types {
            let (bb, be) = (ty.block_bytes() as usize, ty.block_elems() as usize);
            let fields = scale_fields(ty).unwrap();
            // Every quant, scale and min byte at its extremes, the f16
            // fields at the largest finite magnitude, both signs.
            for (fill, scale) in [(0xffu8, f16::MAX), (0x80, f16::MIN), (0x00, f16::MAX)] {
                let mut b = vec![fill; 3 * bb];
                for blk in b.chunks_exact_mut(bb) {
                    for &at in fields {
                        blk[at..at + 2].copy_from_slice(&scale.to_bits().to_le_bytes());
                    }
                }
                let q = QuantMatrix::new("t", ty, 1, 3 * be, b.clone()).unwrap();
                assert!(
                    q.dequantize().iter().all(|v| v.is_finite()),
                    "{ty} {fill:#x}"
                );
                assert_eq!(q.first_non_finite(), None, "{ty}");
                // A NaN scale in the second block: found in that block.
                let at = bb + fields[0];
                b[at..at + 2].copy_from_slice(&f16::NAN.to_bits().to_le_bytes());
                let q = QuantMatrix::new("t", ty, 1, 3 * be, b).unwrap();
                let i = q.dequantize().iter().position(|v| !v.is_finite());
                assert_eq!(q.first_non_finite(), i, "{ty}");
                assert!(i.is_some_and(|i| (be..2 * be).contains(&i)), "{ty}");
            }
        }
    }

    #[test]
    fn wrong_sizes_and_uncomputable_types_are_refused_naming_the_tensor() {
        let e = QuantMatrix::new("w", GgmlType::Q4_1, 2, 32, vec![0; 20]).unwrap_err();
        assert!(e.to_string().contains("tensor w"), "{e}");
        let e = QuantMatrix::new("w", GgmlType::Q4_1, 1, 33, vec![0; 20]).unwrap_err();
        assert!(matches!(e, QuantError::BadDims { .. }), "{e}");
        let e = QuantMatrix::new("w", GgmlType::Q2K, 1, 256, vec![0; 84]).unwrap_err();
        assert!(
            e.to_string().contains("Q2_K") && e.to_string().contains('w'),
            "{e}"
        );
    }
}
