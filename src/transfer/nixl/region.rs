//! Page-aligned host memory that a NIXL agent registers: the decode end's
//! staging ring and the prefill end's send buffer. At the decode end the
//! ring is the only registered memory, so a peer's NIXL writes can reach
//! its bytes and no others (the pool's pages are filled from it, under the
//! landing zone's fence). The prefill end also registers its pool's page
//! arena, to send held rows in place, but never exports its own metadata:
//! no peer holds a key to read or write it.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use nixl_sys::{MemType, MemoryRegion, NixlDescriptor};

use crate::transfer::error::LinkError;

const ALIGN: usize = 4096;

/// Zeroed, page-aligned host memory, freed on drop.
#[derive(Debug)]
pub(super) struct Region {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the region owns its allocation outright; the pointer is never
// shared except with NIXL, which only reads or writes its bytes, and every
// access from this process goes through `&self`/`&mut self` below.
unsafe impl Send for Region {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Region {}

impl Region {
    pub(super) fn new(len: usize) -> Result<Self, LinkError> {
        let layout = Layout::from_size_align(len.max(1), ALIGN).map_err(|_| LinkError::Config {
            what: "a NIXL staging region larger than the address space",
        })?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(LinkError::DataPlane {
            what: "allocating a staging region",
            detail: format!("{} bytes", layout.size()),
        })?;
        Ok(Region { ptr, layout })
    }

    pub(super) fn len(&self) -> usize {
        self.layout.size()
    }

    /// The address the peer's descriptors name.
    pub(super) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Bytes `[at, at + len)`, if inside the region. The peer writes a
    /// range only before announcing it and not again before it is credited
    /// back, which happens after the caller is done with the slice.
    pub(super) fn get(&self, at: usize, len: usize) -> Option<&[u8]> {
        let end = at.checked_add(len)?;
        (end <= self.len()).then(|| {
            // SAFETY: in bounds of the live allocation (checked above);
            // nothing in this process writes it while `&self` is held.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(at), len) }
        })
    }

    /// Bytes `[0, len)` to fill, if the region holds that many.
    pub(super) fn head_mut(&mut self, len: usize) -> Option<&mut [u8]> {
        (len <= self.len()).then(|| {
            // SAFETY: in bounds (checked above), and `&mut self` is the
            // only access from this process; NIXL reads these bytes only
            // during a transfer the caller starts after filling them.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len) }
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    fn size(&self) -> usize {
        self.len()
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}
