//! The stored KV element types and their conversions: to and from f32, and
//! the zero and poison patterns a scrub writes.

use half::{bf16, f16};

use crate::kv::{F8E4M3, KvDtype};

/// A stored KV element type.
pub trait KvElem: Copy + Send + Sync + bytemuck::Pod + 'static {
    const DTYPE: KvDtype;
    const ZERO: Self;
    const POISON: Self;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    const ZERO: Self = 0.0;
    const POISON: Self = f32::NAN;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl KvElem for f16 {
    const DTYPE: KvDtype = KvDtype::F16;
    const ZERO: Self = f16::ZERO;
    const POISON: Self = f16::NAN;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl KvElem for bf16 {
    const DTYPE: KvDtype = KvDtype::BF16;
    const ZERO: Self = bf16::ZERO;
    const POISON: Self = bf16::NAN;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl KvElem for F8E4M3 {
    const DTYPE: KvDtype = KvDtype::F8E4M3;
    const ZERO: Self = F8E4M3::ZERO;
    const POISON: Self = F8E4M3::NAN;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        F8E4M3::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        F8E4M3::from_f32(x)
    }
}

impl<'a> KvSlice<'a> {
    /// The raw bytes, for as long as the elements are borrowed.
    pub fn into_bytes(self) -> &'a [u8] {
        match self {
            KvSlice::F32(s) => bytemuck::cast_slice(s),
            KvSlice::F16(s) => bytemuck::cast_slice(s),
            KvSlice::BF16(s) => bytemuck::cast_slice(s),
            KvSlice::F8E4M3(s) => bytemuck::cast_slice(s),
        }
    }
}

/// A borrowed run of stored elements, typed by the pool's dtype.
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    F8E4M3(&'a [F8E4M3]),
}

impl KvSlice<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
            KvSlice::BF16(s) => s.len(),
            KvSlice::F8E4M3(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw bytes (little-endian on every supported target).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            KvSlice::F32(s) => bytemuck::cast_slice(s),
            KvSlice::F16(s) => bytemuck::cast_slice(s),
            KvSlice::BF16(s) => bytemuck::cast_slice(s),
            KvSlice::F8E4M3(s) => bytemuck::cast_slice(s),
        }
    }
    /// Converts to f32 into `out` (same length).
    pub fn to_f32_into(&self, out: &mut [f32]) {
        fn conv<T: KvElem>(s: &[T], out: &mut [f32]) {
            for (o, x) in out.iter_mut().zip(s) {
                *o = x.to_f32();
            }
        }
        use half::slice::HalfFloatSliceExt;
        match self {
            KvSlice::F32(s) => out.copy_from_slice(s),
            // 8 at a time with F16C where the CPU has it (detected at run
            // time), instead of a detection and one conversion per value.
            KvSlice::F16(s) => s.convert_to_f32_slice(out),
            KvSlice::BF16(s) => conv(s, out),
            KvSlice::F8E4M3(s) => conv(s, out),
        }
    }
}

/// One element of zeros or of the dtype's poison, as bytes.
pub(super) fn element_bytes(dtype: KvDtype, poison: bool) -> Vec<u8> {
    let mut out = vec![0u8; dtype.size_bytes()];
    if poison {
        fill_page(dtype, &mut out, true);
    }
    out
}

/// Converts stored elements' bytes to f32 (`out` has one per element).
pub(crate) fn bytes_to_f32(dtype: KvDtype, bytes: &[u8], out: &mut [f32]) {
    fn conv<T: KvElem>(bytes: &[u8], out: &mut [f32]) {
        let esz = std::mem::size_of::<T>();
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(esz)) {
            *o = bytemuck::pod_read_unaligned::<T>(b).to_f32();
        }
    }
    match dtype {
        KvDtype::F32 => conv::<f32>(bytes, out),
        KvDtype::F16 => conv::<f16>(bytes, out),
        KvDtype::BF16 => conv::<bf16>(bytes, out),
        KvDtype::F8E4M3 => conv::<F8E4M3>(bytes, out),
    }
}

/// Writes f32 values converted to the storage dtype into `dst` (one
/// element's bytes per value).
pub(super) fn store_f32(dtype: KvDtype, dst: &mut [u8], src: &[f32]) {
    fn put<T: KvElem>(dst: &mut [u8], src: &[f32]) {
        // The arena is aligned for every dtype, so the typed view exists
        // there; a staging buffer may not be, hence the byte loop.
        match bytemuck::try_cast_slice_mut::<u8, T>(dst) {
            Ok(d) => {
                for (d, s) in d.iter_mut().zip(src) {
                    *d = T::from_f32(*s);
                }
            }
            Err(_) => {
                for (d, s) in dst.chunks_exact_mut(std::mem::size_of::<T>()).zip(src) {
                    d.copy_from_slice(bytemuck::bytes_of(&T::from_f32(*s)));
                }
            }
        }
    }
    match dtype {
        KvDtype::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        KvDtype::F16 => put::<f16>(dst, src),
        KvDtype::BF16 => put::<bf16>(dst, src),
        KvDtype::F8E4M3 => put::<F8E4M3>(dst, src),
    }
}

/// Fills a page's bytes with zeros or the dtype's poison.
pub(super) fn fill_page(dtype: KvDtype, bytes: &mut [u8], poison: bool) {
    fn fill<T: KvElem>(bytes: &mut [u8], poison: bool) {
        if !poison {
            bytes.fill(0);
            return;
        }
        let v = T::POISON;
        for d in bytes.chunks_exact_mut(std::mem::size_of::<T>()) {
            d.copy_from_slice(bytemuck::bytes_of(&v));
        }
    }
    match dtype {
        KvDtype::F32 => fill::<f32>(bytes, poison),
        KvDtype::F16 => fill::<f16>(bytes, poison),
        KvDtype::BF16 => fill::<bf16>(bytes, poison),
        KvDtype::F8E4M3 => fill::<F8E4M3>(bytes, poison),
    }
}
