//! Activation buffers and weight tensors in device memory.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use crate::backend::cuda::{CudaDevice, HalfWeights, QuantWeights};
use crate::backend::{BackendError, cpu, shape_err};

use super::dev_err;

/// An activation buffer in device memory (grow-only).
#[derive(Default)]
pub struct CudaBuf {
    pub(super) data: Option<CudaSlice<f32>>,
    pub(super) len: usize,
}

impl std::fmt::Debug for CudaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuf").field("len", &self.len).finish()
    }
}

impl CudaBuf {
    /// Sets the length to `len`, reallocating (contents lost) when it grows
    /// past the capacity.
    pub(super) fn ensure(&mut self, dev: &CudaDevice, len: usize) -> Result<(), BackendError> {
        if self.data.as_ref().is_none_or(|d| d.len() < len.max(1))
            && let Some(old) = self.data.replace(dev.zeros(len.max(1)).map_err(dev_err)?)
        {
            // A recorded launch may still use it (see graph.rs).
            dev.retire(old);
        }
        self.len = len;
        Ok(())
    }
    pub(super) fn view(&self) -> Result<CudaView<'_, f32>, BackendError> {
        self.data
            .as_ref()
            .map(|d| d.slice(0..self.len))
            .ok_or_else(|| shape_err("buffer", "an initialised buffer", 1, 0))
    }
    pub(super) fn view_mut(&mut self) -> Result<CudaViewMut<'_, f32>, BackendError> {
        let len = self.len;
        self.data
            .as_mut()
            .map(|d| d.slice_mut(0..len))
            .ok_or_else(|| shape_err("buffer", "an initialised buffer", 1, 0))
    }
}

/// A weight tensor in device memory.
pub struct CudaMat {
    pub(super) data: MatData,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

/// A weight tensor's elements: f32, or 16 bits (raw bits of bf16 or f16)
/// for a matrix whose every element is exactly such a value (a bf16 or f16
/// checkpoint's), which then runs on tensor cores at half the bytes.
///
/// Or ggml blocks (raw bytes) for a GGUF checkpoint's quantized matrices
/// (every ggml type this crate computes with), read as stored and widened
/// as they load.
pub(super) enum MatData {
    F32(CudaSlice<f32>),
    Half(HalfWeights, CudaSlice<u16>),
    Quant(QuantWeights, CudaSlice<u8>),
}

impl CudaMat {
    /// The f32 elements of a vector (norm weights, biases: never bf16).
    pub(super) fn f32s(&self, op: &'static str) -> Result<&CudaSlice<f32>, BackendError> {
        match &self.data {
            MatData::F32(d) => Ok(d),
            MatData::Half(h, _) => Err(BackendError::Unsupported {
                what: op,
                detail: format!("a {h:?} weight where f32 is required"),
            }),
            MatData::Quant(q, _) => Err(BackendError::Unsupported {
                what: op,
                detail: format!("a {q:?} weight where f32 is required"),
            }),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.rows * self.cols
    }
}

impl std::fmt::Debug for CudaMat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMat")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// `data` as 16-bit values when that loses nothing, by the CPU backend's
/// rule ([`cpu::exact_in`]): bf16 when every value is one (a bf16
/// checkpoint's; looked for first, so a matrix exact in both stays bf16 as
/// before), else f16 when every value is one (an f16 checkpoint's, or an
/// unquantized GGUF's f16 tensor), else `None`: f32.
pub(super) fn exact_half(data: &[f32]) -> Option<(HalfWeights, Vec<u16>)> {
    // The wrappers are one u16 each: the collects reuse their allocation.
    if let Some(h) = cpu::exact_in::<cpu::Bf16>(data) {
        return Some((HalfWeights::Bf16, h.into_iter().map(|b| b.0).collect()));
    }
    cpu::exact_in::<cpu::F16>(data)
        .map(|h| (HalfWeights::F16, h.into_iter().map(|b| b.0).collect()))
}

/// The 16-bit elements of each of `ws` when all are 16-bit of one type and
/// one depth (the weights one tensor-core launch can take together).
pub(super) fn half_of_one_depth<'a, const N: usize>(
    ws: &[&'a CudaMat; N],
) -> Option<(HalfWeights, [&'a CudaSlice<u16>; N])> {
    let MatData::Half(h0, _) = ws.first()?.data else {
        return None;
    };
    let half = |w: &&'a CudaMat| match &w.data {
        MatData::Half(h, d) if *h == h0 && w.cols == ws[0].cols => Some(d),
        _ => None,
    };
    // Asked twice a layer: no allocation.
    let mut out = [half(ws.first()?)?; N];
    for (o, w) in out.iter_mut().zip(ws) {
        *o = half(w)?;
    }
    Some((h0, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every quantized type the crate computes with is one the device reads
    /// in its blocks (none is widened when placed), with ggml's own block
    /// sizes; the float types are not.
    #[test]
    fn every_computable_quantized_type_stays_in_its_blocks_on_the_device() {
        use crate::backend::GgmlType;
        for ty in GgmlType::every() {
            let quantized = ty.computable() && ty.block_elems() > 1;
            let q = QuantWeights::of(ty);
            assert_eq!(q.is_some(), quantized, "{ty:?}");
            if let Some(q) = q {
                assert_eq!(q.ggml(), ty);
                assert_eq!(q.block_bytes() as u64, ty.block_bytes());
            }
        }
    }

    /// A matrix stays 16-bit only when no value changes: bf16 first (a
    /// bf16 checkpoint's), then f16 (an f16 checkpoint's), else f32; the
    /// bits kept are the values' own.
    #[test]
    fn weights_stay_16_bit_only_when_every_value_is_exact_and_bf16_comes_first() {
        // Exact in both (small integers, zero, a power of two): bf16.
        let both = [0.0f32, -0.0, 1.0, -3.0, 0.5, 1024.0];
        let (h, bits) = exact_half(&both).unwrap();
        assert_eq!(h, HalfWeights::Bf16);
        let back: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            both.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // f16 values that bf16 cannot hold (11 significant bits),
        // subnormal f16 values and f16's largest: f16, bit for bit.
        let f16s: Vec<f32> = [1.0 + 2f32.powi(-10), -1.0 / 3.0, 6.0e-8, 65504.0, -0.0]
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect();
        assert!(f16s.iter().any(|x| x.to_bits() & 0xffff != 0));
        let (h, bits) = exact_half(&f16s).unwrap();
        assert_eq!(h, HalfWeights::F16);
        for (b, x) in bits.iter().zip(&f16s) {
            assert_eq!(half::f16::from_bits(*b).to_f32().to_bits(), x.to_bits());
        }
        // One value that neither holds (an f32 checkpoint's, a quantized
        // GGUF's widened values, f16's range passed): f32.
        for odd in [0.1f32, 1.0 + f32::EPSILON, 70000.0, 1e-10] {
            let mut v = f16s.clone();
            v.push(odd);
            assert!(exact_half(&v).is_none(), "{odd}");
        }
    }
}
