//! The host allocation behind a pool's pages.

use std::alloc::Layout;
use std::ptr::NonNull;

/// The zeroed bytes of the arena. Allocated with `alloc_zeroed` at the
/// platform's minimum alignment, which is `calloc`: pages never handed out
/// cost no resident memory.
pub(super) struct Arena {
    pub(super) ptr: NonNull<u8>,
    pub(super) layout: Layout,
}

/// Alignment of the arena: enough for every KV dtype (at most 4 bytes) and
/// no more than what `calloc` gives, so allocation stays lazy.
const ARENA_ALIGN: usize = 16;

impl Arena {
    /// `bytes` zeroed bytes, or `None` when the allocator refuses them (the
    /// pool reports that as a typed error rather than aborting).
    pub(super) fn zeroed(bytes: usize) -> Option<Arena> {
        let layout = Layout::from_size_align(bytes.max(1), ARENA_ALIGN).ok()?;
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        NonNull::new(raw).map(|ptr| Arena { ptr, layout })
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: allocated in `Arena::zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the arena is plain bytes; who may touch which bytes is decided by
// page ownership (module docs), not by the thread that holds the pointer.
unsafe impl Send for Arena {}
// SAFETY: as above; shared access hands out bytes only through `PagesRead`
// and `PagesWrite`, whose constructors borrow the owning `KvSeq`.
unsafe impl Sync for Arena {}
