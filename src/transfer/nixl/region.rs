//! Page-aligned host memory that a NIXL agent registers: the decode end's
//! staging ring and the prefill end's send buffer. At the decode end the
//! ring is the only registered memory, so a peer's NIXL writes can reach
//! its bytes and no others (the pool's pages are filled from it, under the
//! landing zone's fence). The prefill end also registers its pool's page
//! arena, to send held rows in place, but never exports its own metadata:
//! no peer holds a key to read or write it.
//!
//! A ring a peer may write into is never given back to the allocator: a
//! late WRITE (the link ended while the peer's transfer was in flight; over
//! shared memory UCX writes with `process_vm_writev`, which deregistration
//! does not stop) must not land in memory reused for anything else, least
//! of all another link's pages. On drop its mapping is replaced by an
//! inaccessible one: the physical memory goes back to the system, the
//! address range stays reserved, and a late write faults in the writer
//! (EFAULT) instead of landing.

use std::ptr::NonNull;

use nixl_sys::{MemType, MemoryRegion, NixlDescriptor};

use crate::transfer::error::LinkError;

/// Whether a peer may write into the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Exposure {
    /// Only this process's agent reads it (the prefill end's send buffer).
    Private,
    /// A peer's NIXL writes land in it (the decode end's ring).
    PeerWritable,
}

/// Zeroed, page-aligned host memory (an anonymous mapping).
#[derive(Debug)]
pub(super) struct Region {
    ptr: NonNull<u8>,
    len: usize,
    exposure: Exposure,
}

// SAFETY: the region owns its mapping outright; the pointer is never
// shared except with NIXL, which only reads or writes its bytes, and every
// access from this process goes through `&self`/`&mut self` below.
unsafe impl Send for Region {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Region {}

impl Region {
    pub(super) fn new(len: usize, exposure: Exposure) -> Result<Self, LinkError> {
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
                what: "mapping a staging region",
                detail: format!("{len} bytes: {}", std::io::Error::last_os_error()),
            });
        }
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(LinkError::DataPlane {
            what: "mapping a staging region",
            detail: "the kernel returned a null mapping".into(),
        })?;
        Ok(Region { ptr, len, exposure })
    }

    pub(super) fn len(&self) -> usize {
        self.len
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
        (end <= self.len).then(|| {
            // SAFETY: in bounds of the live mapping (checked above);
            // nothing in this process writes it while `&self` is held.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(at), len) }
        })
    }

    /// Bytes `[0, len)` to fill, if the region holds that many.
    pub(super) fn head_mut(&mut self, len: usize) -> Option<&mut [u8]> {
        (len <= self.len).then(|| {
            // SAFETY: in bounds (checked above), and `&mut self` is the
            // only access from this process; NIXL reads these bytes only
            // during a transfer the caller starts after filling them.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len) }
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let addr = self.ptr.as_ptr().cast::<libc::c_void>();
        match self.exposure {
            // SAFETY: unmaps exactly the mapping made in `new`, once.
            Exposure::Private => unsafe {
                libc::munmap(addr, self.len);
            },
            // SAFETY: replaces exactly the mapping made in `new` (MAP_FIXED
            // over our own range) with an inaccessible one; nothing in this
            // process refers to its bytes any more.
            // If that fails the old mapping simply stays: the memory is kept
            // rather than reused (a leak, never a stray write).
            Exposure::PeerWritable => unsafe {
                libc::mmap(
                    addr,
                    self.len,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    -1,
                    0,
                );
            },
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring a peer may write into, once dropped, refuses a late write
    /// (as `process_vm_writev` would find it) and is never handed out
    /// again; a private buffer is simply unmapped.
    #[test]
    fn a_dropped_peer_writable_ring_faults_a_late_write_and_is_never_reused() {
        let ring = Region::new(1 << 20, Exposure::PeerWritable).unwrap();
        let addr = ring.addr();
        drop(ring);
        let src = [7u8; 64];
        let local = libc::iovec {
            iov_base: src.as_ptr() as *mut libc::c_void,
            iov_len: src.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: src.len(),
        };
        // SAFETY: writes into this process's own address range, which is
        // mapped PROT_NONE: the kernel refuses it without touching memory.
        let n = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
        assert_eq!(n, -1, "a late write into a dropped ring must fault");
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EFAULT)
        );
        // New regions never land on the fenced range.
        let again: Vec<_> = (0..8)
            .map(|_| Region::new(1 << 20, Exposure::PeerWritable).unwrap())
            .collect();
        assert!(again.iter().all(|r| r.addr() != addr));
    }
}
