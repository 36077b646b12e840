//! Device indirection: the page bytes are the host arena or a backend's
//! [`DevicePages`], and every element-range access (fill, read, write, runs
//! of either) goes through here, in place on the host and staged on a
//! device. A device access that fails marks the storage failed.

use crate::kv::KvDtype;
use crate::kv::KvError;
use crate::kv::device::DevicePages;
use crate::kv::storage::elem::{element_bytes, fill_page};
use crate::kv::storage::{Arena, KvSlice, Storage};

/// Where the bytes are.
pub(super) enum Bytes {
    Host(Arena),
    Device(Box<dyn DevicePages>),
}

impl Storage {
    /// Fills elements `[start, start + len)` with zeros or the poison, in
    /// range (checked by the caller).
    ///
    /// # Safety
    /// No one else may read or write these elements meanwhile.
    pub(super) unsafe fn fill(
        &self,
        start: usize,
        len: usize,
        poison: bool,
    ) -> Result<(), KvError> {
        match &self.bytes {
            Bytes::Host(_) => {
                // SAFETY: in range and exclusive, per the contract.
                let bytes = unsafe { self.bytes_mut(start, len) };
                fill_page(self.geometry.dtype, bytes, poison);
                Ok(())
            }
            Bytes::Device(d) => {
                let esz = self.geometry.dtype.size_bytes();
                let element = element_bytes(self.geometry.dtype, poison);
                d.fill(start * esz, len * esz, &element)
                    .map_err(|e| self.device_failed(e))
            }
        }
    }

    /// Elements `[start, start + len)`, in range (checked by `offset`).
    ///
    /// # Safety
    /// No one may write these elements while the returned slice lives.
    /// `None` for device storage (no host address).
    pub(super) unsafe fn slice(&self, start: usize, len: usize) -> Option<KvSlice<'_>> {
        let Bytes::Host(arena) = &self.bytes else {
            return None;
        };
        let esz = self.geometry.dtype.size_bytes();
        // SAFETY: in range of the arena (the caller's offset was checked), and
        // aligned for the dtype (arena aligned to 16, offsets in elements).
        let p = unsafe { arena.ptr.as_ptr().add(start * esz) };
        // SAFETY: in range and aligned as above; no writer, per the contract.
        Some(unsafe {
            match self.geometry.dtype {
                KvDtype::F32 => KvSlice::F32(std::slice::from_raw_parts(p.cast(), len)),
                KvDtype::F16 => KvSlice::F16(std::slice::from_raw_parts(p.cast(), len)),
                KvDtype::BF16 => KvSlice::BF16(std::slice::from_raw_parts(p.cast(), len)),
                KvDtype::F8E4M3 => KvSlice::F8E4M3(std::slice::from_raw_parts(p.cast(), len)),
            }
        })
    }

    /// Elements `[start, start + len)` as bytes, in range (checked by
    /// `offset`), of host storage (empty for device storage, which callers
    /// have ruled out).
    ///
    /// # Safety
    /// No one else may read or write these elements while the returned slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn bytes_mut(&self, start: usize, len: usize) -> &mut [u8] {
        let Bytes::Host(arena) = &self.bytes else {
            return &mut [];
        };
        let esz = self.geometry.dtype.size_bytes();
        // SAFETY: in range of the arena; exclusive per the contract.
        unsafe { std::slice::from_raw_parts_mut(arena.ptr.as_ptr().add(start * esz), len * esz) }
    }

    /// Reads elements `[start, start + len)` into `dst` (`len` elements'
    /// bytes), in range (checked by `offset`).
    ///
    /// # Safety
    /// No one may write these elements meanwhile.
    pub(super) unsafe fn read_into(&self, start: usize, dst: &mut [u8]) -> Result<(), KvError> {
        let esz = self.geometry.dtype.size_bytes();
        match &self.bytes {
            Bytes::Host(_) => {
                // SAFETY: per the contract.
                if let Some(s) = unsafe { self.slice(start, dst.len() / esz) } {
                    dst.copy_from_slice(s.as_bytes());
                }
                Ok(())
            }
            Bytes::Device(d) => d.read(start * esz, dst).map_err(|e| self.device_failed(e)),
        }
    }

    /// Writes `src` over elements from `start`, in range (checked by
    /// `offset`).
    ///
    /// # Safety
    /// No one else may read or write these elements meanwhile.
    pub(super) unsafe fn write_from(&self, start: usize, src: &[u8]) -> Result<(), KvError> {
        let esz = self.geometry.dtype.size_bytes();
        match &self.bytes {
            Bytes::Host(_) => {
                // SAFETY: per the contract.
                unsafe { self.bytes_mut(start, src.len() / esz) }.copy_from_slice(src);
                Ok(())
            }
            Bytes::Device(d) => d.write(start * esz, src).map_err(|e| self.device_failed(e)),
        }
    }

    /// Writes runs of elements `(start, len)` (in range, checked by
    /// `offset`), each run's bytes given by `fill(run, dst)`: in place for
    /// host storage, as one staged pass for device storage.
    ///
    /// # Safety
    /// No one else may read or write these elements meanwhile.
    pub(super) unsafe fn write_runs(
        &self,
        runs: &[(usize, usize)],
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<(), KvError> {
        let esz = self.geometry.dtype.size_bytes();
        match &self.bytes {
            Bytes::Host(_) => {
                for (i, &(start, len)) in runs.iter().enumerate() {
                    // SAFETY: per the contract; one run's slice at a time.
                    fill(i, unsafe { self.bytes_mut(start, len) });
                }
                Ok(())
            }
            Bytes::Device(d) => {
                let bytes: Vec<_> = runs.iter().map(|&(s, n)| (s * esz, n * esz)).collect();
                d.write_runs(&bytes, fill)
                    .map_err(|e| self.device_failed(e))
            }
        }
    }

    /// Reads runs of elements `(start, len)` (in range, checked by
    /// `offset`) and hands each run's bytes to `take(run, bytes)`: in place
    /// for host storage, as one staged pass for device storage.
    ///
    /// # Safety
    /// No one may write these elements meanwhile.
    pub(super) unsafe fn read_runs(
        &self,
        runs: &[(usize, usize)],
        take: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), KvError> {
        let esz = self.geometry.dtype.size_bytes();
        match &self.bytes {
            Bytes::Host(_) => {
                for (i, &(start, len)) in runs.iter().enumerate() {
                    // SAFETY: per the contract.
                    if let Some(s) = unsafe { self.slice(start, len) } {
                        take(i, s.as_bytes());
                    }
                }
                Ok(())
            }
            Bytes::Device(d) => {
                let bytes: Vec<_> = runs.iter().map(|&(s, n)| (s * esz, n * esz)).collect();
                d.read_runs(&bytes, take).map_err(|e| self.device_failed(e))
            }
        }
    }
}
