//! Page-aligned host memory that a NIXL agent registers: the prefill end's
//! send buffer (for batches that cannot be read in place) and the decode
//! end's landing buffer (for destination pages in device memory). Neither
//! end registers memory a peer may write: the decode end READs, and its
//! metadata never leaves it.

use std::ptr::NonNull;

use nixl_sys::{MemType, MemoryRegion, NixlDescriptor};

use crate::transfer::error::LinkError;

/// Zeroed, page-aligned host memory (an anonymous mapping).
#[derive(Debug)]
pub(super) struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the region owns its mapping outright; the pointer is never
// shared except with NIXL, which only reads or writes its bytes, and every
// access from this process goes through `&self`/`&mut self` below.
unsafe impl Send for Region {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Region {}

impl Region {
    pub(super) fn new(len: usize) -> Result<Self, LinkError> {
        let len = len.max(1);
        // SAFETY: a fresh anonymous private mapping; no existing memory is
        // touched. The kernel zeroes it and backs it lazily.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(LinkError::DataPlane {
                what: "mapping a NIXL buffer",
                detail: format!("{len} bytes: {}", std::io::Error::last_os_error()),
            });
        }
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(LinkError::DataPlane {
            what: "mapping a NIXL buffer",
            detail: "the kernel returned a null mapping".into(),
        })?;
        Ok(Region { ptr, len })
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The address the peer's descriptors name.
    pub(super) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Bytes `[at, at + len)`, if inside the region. A READ into the
    /// region has ended before the caller reads it, and the next starts
    /// only after the slice is gone (`&self` of the one owner).
    pub(super) fn get(&self, at: usize, len: usize) -> Option<&[u8]> {
        let end = at.checked_add(len)?;
        (end <= self.len).then(|| {
            // SAFETY: in bounds of the live mapping (checked above);
            // nothing in this process writes it while `&self` is held.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(at), len) }
        })
    }

    /// Bytes `[at, at + len)` to fill, if inside the region.
    pub(super) fn range_mut(&mut self, at: usize, len: usize) -> Option<&mut [u8]> {
        let end = at.checked_add(len)?;
        (end <= self.len).then(|| {
            // SAFETY: in bounds (checked above), and `&mut self` is the
            // only access from this process; a peer READs these bytes only
            // after the caller announces them, which it does after filling.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(at), len) }
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`, once; its
        // registration and any transfer reading or writing it ended first
        // (the owners drop those before the region).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast::<libc::c_void>(), self.len);
        }
    }
}

/// Host memory as NIXL registers it: a region of ours, or a span we do not
/// own (a pool's page arena, kept alive by whoever registers it).
#[derive(Debug)]
pub(super) struct Span {
    pub(super) addr: usize,
    pub(super) len: usize,
}

impl From<&Region> for Span {
    fn from(r: &Region) -> Self {
        Span {
            addr: r.addr(),
            len: r.len(),
        }
    }
}

impl MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}
