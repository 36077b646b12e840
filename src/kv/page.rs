use std::sync::atomic::{AtomicU32, Ordering};

/// Pages of `page_size` slots that `tokens` tokens occupy (whole pages,
/// rounded up). The one place this count is made.
pub const fn pages_for(tokens: usize, page_size: usize) -> usize {
    tokens.div_ceil(page_size)
}

/// Identifies one pool instance, so a page id from another pool is caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolId(u32);

impl PoolId {
    pub(crate) fn fresh() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        PoolId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A page at one generation. The generation changes every time the page is
/// handed out, so an id kept from an earlier owner is detected as stale.
/// Only the pool creates page ids; the fields are private.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageId {
    pub(crate) pool: PoolId,
    pub(crate) index: u32,
    pub(crate) generation: u64,
}

impl PageId {
    /// Index of the page in its pool (stable across generations).
    pub fn index(&self) -> u32 {
        self.index
    }
    /// The generation this id was issued at.
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

/// Where a page is in its life cycle.
/// `free + in_use + held + cached == capacity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PageState {
    Free,
    InUse,
    /// Out of use but not free: a write may still land in it.
    Held,
    /// In the prefix cache: complete, shared, read-only, reference-counted
    /// (see `kv::prefix`). Freed only by eviction, and only with no reader.
    Cached,
}
