//! Host storage for KV pages: one contiguous arena, addressed by page index.
//!
//! Page layout, in elements: `[layer][k|v][slot][kv_dim]`, so the K rows of
//! one layer within one page are contiguous (what attention streams over).

use half::{bf16, f16};

use crate::config::{KvDtype, KvGeometry};

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

/// A borrowed run of stored elements, typed by the pool's dtype.
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl KvSlice<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
            KvSlice::BF16(s) => s.len(),
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
        }
    }
    /// Converts to f32 into `out` (same length).
    pub fn to_f32_into(&self, out: &mut [f32]) {
        fn conv<T: KvElem>(s: &[T], out: &mut [f32]) {
            for (o, x) in out.iter_mut().zip(s) {
                *o = x.to_f32();
            }
        }
        match self {
            KvSlice::F32(s) => out.copy_from_slice(s),
            KvSlice::F16(s) => conv(s, out),
            KvSlice::BF16(s) => conv(s, out),
        }
    }
}

#[derive(Debug)]
pub(crate) enum Data {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// The arena plus, with the `audit` feature, who wrote each slot.
#[derive(Debug)]
pub(crate) struct Storage {
    pub(crate) data: Data,
    geometry: KvGeometry,
    page_size: usize,
    /// The audit trail, when on: per (page, layer, slot), 0 = never written
    /// since the page was handed out, otherwise `RequestId + 1` of the writer.
    pub(crate) writers: Option<Vec<u64>>,
}

impl Storage {
    pub(crate) fn new(geometry: KvGeometry, page_size: usize, pages: usize, audit: bool) -> Self {
        let n = pages * page_stride(&geometry, page_size);
        // vec![0; n] is calloc'd: untouched pages cost no resident memory.
        let data = match geometry.dtype {
            KvDtype::F32 => Data::F32(vec![0.0; n]),
            KvDtype::F16 => Data::F16(vec![f16::ZERO; n]),
            KvDtype::BF16 => Data::BF16(vec![bf16::ZERO; n]),
        };
        Storage {
            data,
            geometry,
            page_size,
            writers: audit.then(|| vec![0; pages * geometry.n_layers * page_size]),
        }
    }

    pub(crate) fn page_stride(&self) -> usize {
        page_stride(&self.geometry, self.page_size)
    }

    /// Element offset of (page, layer, k=0|v=1, slot).
    #[inline]
    pub(crate) fn offset(&self, page: u32, layer: usize, kv: usize, slot: usize) -> usize {
        let kvd = self.geometry.kv_dim();
        page as usize * self.page_stride() + ((layer * 2 + kv) * self.page_size + slot) * kvd
    }

    /// Elements `[start, start + len)` as a typed slice.
    pub(crate) fn slice(&self, start: usize, len: usize) -> KvSlice<'_> {
        match &self.data {
            Data::F32(v) => KvSlice::F32(&v[start..start + len]),
            Data::F16(v) => KvSlice::F16(&v[start..start + len]),
            Data::BF16(v) => KvSlice::BF16(&v[start..start + len]),
        }
    }

    /// Stores f32 values at `start`, converting to the storage dtype.
    pub(crate) fn store_f32(&mut self, start: usize, src: &[f32]) {
        fn put<T: KvElem>(dst: &mut [T], src: &[f32]) {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = T::from_f32(*s);
            }
        }
        let end = start + src.len();
        match &mut self.data {
            Data::F32(v) => v[start..end].copy_from_slice(src),
            Data::F16(v) => put(&mut v[start..end], src),
            Data::BF16(v) => put(&mut v[start..end], src),
        }
    }

    /// Stores raw bytes of the storage dtype at element offset `start`.
    pub(crate) fn store_bytes(&mut self, start: usize, src: &[u8]) {
        let esz = self.geometry.dtype.size_bytes();
        let bytes: &mut [u8] = match &mut self.data {
            Data::F32(v) => bytemuck::cast_slice_mut(v.as_mut_slice()),
            Data::F16(v) => bytemuck::cast_slice_mut(v.as_mut_slice()),
            Data::BF16(v) => bytemuck::cast_slice_mut(v.as_mut_slice()),
        };
        bytes[start * esz..start * esz + src.len()].copy_from_slice(src);
    }

    /// Elements `[start, start + len)` as raw bytes, for writing.
    pub(crate) fn bytes_mut(&mut self, start: usize, len: usize) -> &mut [u8] {
        let esz = self.geometry.dtype.size_bytes();
        let bytes: &mut [u8] = match &mut self.data {
            Data::F32(v) => bytemuck::cast_slice_mut(v.as_mut_slice()),
            Data::F16(v) => bytemuck::cast_slice_mut(v.as_mut_slice()),
            Data::BF16(v) => bytemuck::cast_slice_mut(v.as_mut_slice()),
        };
        &mut bytes[start * esz..(start + len) * esz]
    }

    /// Overwrites a whole page with `fill` (zero or poison).
    pub(crate) fn fill_page(&mut self, page: u32, poison: bool) {
        let stride = self.page_stride();
        let r = page as usize * stride..(page as usize + 1) * stride;
        fn fill<T: KvElem>(s: &mut [T], poison: bool) {
            s.fill(if poison { T::POISON } else { T::ZERO });
        }
        match &mut self.data {
            Data::F32(v) => fill(&mut v[r], poison),
            Data::F16(v) => fill(&mut v[r], poison),
            Data::BF16(v) => fill(&mut v[r], poison),
        }
    }

    #[inline]
    pub(crate) fn writer_index(&self, page: u32, layer: usize, slot: usize) -> usize {
        (page as usize * self.geometry.n_layers + layer) * self.page_size + slot
    }

    pub(crate) fn clear_writers(&mut self, page: u32) {
        let n = self.geometry.n_layers * self.page_size;
        let s = page as usize * n;
        if let Some(w) = &mut self.writers {
            w[s..s + n].fill(0);
        }
    }

    /// Records `writer` for `n` consecutive slots of one page and layer.
    pub(crate) fn record_writers(
        &mut self,
        page: u32,
        layer: usize,
        slot: usize,
        n: usize,
        writer: u64,
    ) {
        let i = self.writer_index(page, layer, slot);
        if let Some(w) = &mut self.writers {
            w[i..i + n].fill(writer + 1);
        }
    }

    /// The recorded writer of a slot: `None` when the audit trail is off,
    /// `Some(0)` for never written, else `RequestId + 1`.
    pub(crate) fn writer(&self, page: u32, layer: usize, slot: usize) -> Option<u64> {
        let i = self.writer_index(page, layer, slot);
        self.writers.as_ref().map(|w| w[i])
    }
}

pub(crate) fn page_stride(g: &KvGeometry, page_size: usize) -> usize {
    g.n_layers * 2 * page_size * g.kv_dim()
}
