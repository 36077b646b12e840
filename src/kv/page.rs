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
#[repr(u8)]
pub(crate) enum PageState {
    Free = 0,
    InUse = 1,
    /// Out of use but not free: a write may still land in it.
    Held = 2,
    /// In the prefix cache: complete, shared, read-only, reference-counted
    /// (see `kv::prefix`). Freed only by eviction, and only with no reader.
    Cached = 3,
}

/// A page's bookkeeping in one word: its generation and its state. Every
/// pass checks every page it reads, and a page's two facts in two arrays
/// cost two cache misses a page where one word costs one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageEntry(u64);

impl PageEntry {
    const STATE_BITS: u32 = 2;
    const STATE_MASK: u64 = (1 << Self::STATE_BITS) - 1;

    /// The generation of the page's current (or last) owner; 0 before the
    /// page was first handed out.
    pub(crate) fn generation(self) -> u64 {
        self.0 >> Self::STATE_BITS
    }
    pub(crate) fn state(self) -> PageState {
        match self.0 & Self::STATE_MASK {
            0 => PageState::Free,
            1 => PageState::InUse,
            2 => PageState::Held,
            _ => PageState::Cached,
        }
    }
    /// True when the page is at `generation` in `state` (one comparison).
    pub(crate) fn is(self, generation: u64, state: PageState) -> bool {
        generation <= u64::MAX >> Self::STATE_BITS
            && self.0 == (generation << Self::STATE_BITS) | state as u64
    }
    pub(crate) fn set_state(&mut self, state: PageState) {
        self.0 = (self.0 & !Self::STATE_MASK) | state as u64;
    }
    /// Hands the page out to a new owner: the next generation, in use.
    /// Returns that generation. (2^62 hand-outs of one page would wrap it:
    /// at a billion a second, that is 146 years.)
    pub(crate) fn hand_out(&mut self) -> u64 {
        let generation = self.generation().wrapping_add(1) & (u64::MAX >> Self::STATE_BITS);
        self.0 = (generation << Self::STATE_BITS) | PageState::InUse as u64;
        generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_keeps_its_generation_and_state_apart() {
        let mut e = PageEntry::default();
        assert_eq!((e.generation(), e.state()), (0, PageState::Free));
        assert_eq!(e.hand_out(), 1);
        assert!(e.is(1, PageState::InUse));
        assert!(!e.is(1, PageState::Held));
        assert!(!e.is(2, PageState::InUse));
        for s in [PageState::Held, PageState::Cached, PageState::Free] {
            e.set_state(s);
            assert_eq!((e.generation(), e.state()), (1, s));
        }
        assert_eq!(e.hand_out(), 2);
        assert_eq!((e.generation(), e.state()), (2, PageState::InUse));
        // A generation too large for the word never matches.
        assert!(!e.is(u64::MAX, PageState::InUse));
    }
}
