//! [`KvSeq`]: the owning handle of one sequence's pages, with its protocol
//! state in the type.
//!
//! | state        | written by          | readable | becomes                      |
//! |--------------|---------------------|----------|------------------------------|
//! | [`Filling`]  | this worker         | yes      | `Ready` via [`KvSeq::seal`]  |
//! | [`Received`] | a remote peer       | **no**   | `Ready` only via the verifier |
//! | [`Ready`]    | decode appends      | yes      | -                            |
//! | [`Held`]     | nobody (read-only)  | yes      | free on drop                 |
//!
//! A handle is not `Clone`; dropping it (or [`KvSeq::release`], which takes
//! it by value) scrubs its pages per the pool's policy and frees them.
//!
//! A sequence may start from a leased prefix of cached pages (see
//! [`crate::kv::PrefixCache`]): its page table then begins with pages it
//! shares read-only with other sequences of its tenant, counted as written
//! in every layer; its own writes land only in the private pages after them,
//! and dropping it scrubs and frees only those, returning the lease.

use std::marker::PhantomData;

use crate::ids::RequestId;
use crate::ids::TenantId;
use crate::kv::KvGeometry;
use crate::kv::page::PageState;
use crate::kv::pages_for;
use crate::kv::prefix::SharedPrefix;
use crate::kv::storage::{RowRun, prefetch};

mod draft;
mod received;

use crate::kv::{KvError, KvPool, PageId};
pub use draft::Settled;
pub(crate) use received::Tamper;

mod sealed {
    pub trait Sealed {}
}

/// A protocol state of a [`KvSeq`].
pub trait SeqState: sealed::Sealed + Send + Sync + 'static {
    #[doc(hidden)]
    const HELD: bool;
}
/// States whose KV may be read by attention.
pub trait Readable: SeqState {}
/// States whose KV may be appended to.
pub trait Writable: SeqState {}

/// Being written by this worker (prefill). Readable: causal attention over
/// the sequence's own positions during prefill.
#[derive(Debug)]
pub struct Filling;
/// Destination of a transfer: a peer writes it; nothing may read it until the
/// transfer verifier has checked the receipt.
#[derive(Debug)]
pub struct Received;
/// Complete, verified KV: decode reads it and appends new tokens.
#[derive(Debug)]
pub struct Ready;
/// Out of use but not free (deferred release): readable by a sender, never
/// written, freed on drop.
#[derive(Debug)]
pub struct Held;

impl sealed::Sealed for Filling {}
impl sealed::Sealed for Received {}
impl sealed::Sealed for Ready {}
impl sealed::Sealed for Held {}
impl SeqState for Filling {
    const HELD: bool = false;
}
impl SeqState for Received {
    const HELD: bool = false;
}
impl SeqState for Ready {
    const HELD: bool = false;
}
impl SeqState for Held {
    const HELD: bool = true;
}
impl Readable for Filling {}
impl Readable for Ready {}
impl Readable for Held {}
impl Writable for Filling {}
impl Writable for Received {}
impl Writable for Ready {}

/// The owning handle of one sequence's KV pages.
///
/// Misuse that the type system can express does not compile. Decode needs
/// complete KV, so an unsealed handle is refused:
///
/// ```compile_fail
/// use handoff::kv::{KvSeq, Filling, Ready};
/// fn decode(_: &KvSeq<Ready>) {}
/// fn misuse(seq: KvSeq<Filling>) { decode(&seq) }
/// ```
///
/// A released handle cannot be used again:
///
/// ```compile_fail
/// use handoff::kv::{KvSeq, Ready};
/// fn misuse(seq: KvSeq<Ready>) {
///     seq.release();
///     let _ = seq.owner();
/// }
/// ```
///
/// And KV written by a peer cannot be read before verification:
///
/// ```compile_fail
/// use handoff::kv::{KvSeq, Received};
/// fn misuse(pool: &handoff::KvPool, seq: &KvSeq<Received>) {
///     let reader = pool.reader();
///     let _ = reader.seq(seq);
/// }
/// ```
#[must_use = "dropping a KvSeq frees its pages"]
pub struct KvSeq<S: SeqState> {
    pool: KvPool,
    owner: RequestId,
    /// The page table: the leased prefix's pages (`prefix`), then this
    /// handle's private pages.
    pages: Vec<PageId>,
    /// The lease on the cached pages at the front of `pages` (empty for a
    /// sequence that did not start from the cache).
    prefix: SharedPrefix,
    /// Tokens written so far, per layer.
    written: Vec<usize>,
    _state: PhantomData<S>,
}

impl<S: SeqState> std::fmt::Debug for KvSeq<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSeq")
            .field("state", &std::any::type_name::<S>())
            .field("owner", &self.owner)
            .field("pages", &self.pages.len())
            .field("shared_pages", &self.prefix.len())
            .field("written", &self.written)
            .finish()
    }
}

impl<S: SeqState> KvSeq<S> {
    pub(crate) fn new(pool: KvPool, owner: RequestId, pages: Vec<PageId>) -> Self {
        let prefix = SharedPrefix::none(pool.clone());
        Self::with_prefix(prefix, owner, pages)
    }

    /// A sequence reading the leased `prefix` (counted as written in every
    /// layer), then writing its `private` pages.
    pub(crate) fn with_prefix(
        prefix: SharedPrefix,
        owner: RequestId,
        private: Vec<PageId>,
    ) -> Self {
        let pool = prefix.pool().clone();
        let n_layers = pool.config().geometry().n_layers;
        let mut pages = Vec::with_capacity(prefix.len() + private.len());
        pages.extend_from_slice(prefix.pages());
        pages.extend(private);
        let reused = prefix.len() * pool.page_size();
        KvSeq {
            pool,
            owner,
            pages,
            prefix,
            written: vec![reused; n_layers],
            _state: PhantomData,
        }
    }

    /// Pages at the front of [`KvSeq::pages`] that are leased from the
    /// prefix cache: shared, read-only, not this handle's to free.
    pub fn shared_pages(&self) -> usize {
        self.prefix.len()
    }
    /// Tokens this sequence reuses from the prefix cache (positions it did
    /// not compute).
    pub fn reused_tokens(&self) -> usize {
        self.prefix.len() * self.pool.page_size()
    }
    /// Pages this handle owns privately (freed when it is dropped).
    pub fn private_pages(&self) -> usize {
        self.pages.len() - self.prefix.len()
    }
    /// The tenant whose cached pages this sequence reads or published
    /// (`None` for a sequence that never used the cache).
    pub fn tenant(&self) -> Option<TenantId> {
        self.prefix.tenant()
    }
    /// The lease, for the cache's publishing (same module family).
    pub(crate) fn prefix_mut(&mut self) -> &mut SharedPrefix {
        &mut self.prefix
    }

    /// The request that owns these pages.
    pub fn owner(&self) -> RequestId {
        self.owner
    }
    /// The pages, in position order, at the generation this handle owns.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }
    /// The pages holding written positions of some layer: all that a view
    /// of this sequence can read. A sequence reserved for its whole window
    /// has most of its pages still empty; checking those too on every read
    /// cost a decode worker with long windows a third of each step.
    pub(crate) fn readable_pages(&self) -> &[PageId] {
        self.readable_pages_after(0)
    }
    /// Asks the CPU for this sequence's written counts ahead of a batch
    /// loop's use of them (a hint: reads nothing).
    #[inline(always)]
    pub(crate) fn prefetch_counts(&self) {
        crate::kv::storage::prefetch(self.written.as_ptr());
    }
    /// The pages [`KvSeq::readable_pages`] will be once `adds` more tokens
    /// are written (at most every page it has).
    pub(crate) fn readable_pages_after(&self, adds: usize) -> &[PageId] {
        let written = self.written.iter().copied().max().unwrap_or(0);
        let tokens = written.saturating_add(adds);
        let n = pages_for(tokens, self.pool.page_size()).min(self.pages.len());
        &self.pages[..n]
    }
    /// The pool the pages belong to.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }
    /// The error for handing this sequence to an operation on another pool.
    pub(crate) fn foreign_pool(&self) -> KvError {
        match self.pages.first() {
            Some(&page) => KvError::ForeignPage { page },
            None => KvError::Shape {
                what: "sequence from another pool",
                expected: 0,
                got: 0,
            },
        }
    }
    /// Tokens this handle may hold without growing.
    pub fn reserved_tokens(&self) -> usize {
        self.pages.len() * self.pool.page_size()
    }
    /// Tokens written to `layer` (0 for an out-of-range layer).
    pub fn written(&self, layer: usize) -> usize {
        self.written.get(layer).copied().unwrap_or(0)
    }
    /// Tokens written, per layer.
    pub fn written_per_layer(&self) -> &[usize] {
        &self.written
    }
    /// The sequence length when every layer holds the same number of tokens.
    pub fn complete_len(&self) -> Option<usize> {
        let first = *self.written.first()?;
        self.written.iter().all(|&w| w == first).then_some(first)
    }

    /// Frees the pages (scrubbed per the pool's policy). Same as dropping.
    pub fn release(self) {
        drop(self)
    }

    /// Moves the pages to the held state: counted as held, readable, never
    /// written, freed when the returned handle is dropped.
    /// A leased prefix stays cached (and leased) until the handle drops.
    pub fn hold(self) -> KvSeq<Held> {
        if !S::HELD {
            self.pool.set_held(&self.pages[self.prefix.len()..], true);
        }
        self.into_state()
    }

    fn into_state<T: SeqState>(mut self) -> KvSeq<T> {
        // Move the pages and the lease out; the emptied husk's drop frees
        // nothing and returns no lease.
        let none = SharedPrefix::none(self.pool.clone());
        let next = KvSeq {
            pool: self.pool.clone(),
            owner: self.owner,
            pages: std::mem::take(&mut self.pages),
            prefix: std::mem::replace(&mut self.prefix, none),
            written: std::mem::take(&mut self.written),
            _state: PhantomData,
        };
        drop(self);
        next
    }

    fn geometry(&self) -> KvGeometry {
        self.pool.config().geometry()
    }
}

impl<S: Writable> KvSeq<S> {
    /// Reserves room for `tokens` more tokens (all layers).
    pub fn grow(&mut self, tokens: usize) -> Result<(), KvError> {
        let max_written = self.written.iter().copied().max().unwrap_or(0);
        let total = max_written
            .max(self.reserved_tokens())
            .checked_add(tokens)
            .ok_or(KvError::NeverFits {
                tokens: usize::MAX,
                capacity_tokens: self.pool.capacity() * self.pool.page_size(),
            })?;
        let needed = self.pool.pages_for(total);
        let extra = needed.saturating_sub(self.pages.len());
        if extra > 0 {
            let more = self.pool.alloc_pages(extra)?;
            self.pages.extend(more);
        }
        Ok(())
    }

    /// Makes sure the sequence can hold `total` tokens, growing if needed.
    pub fn ensure_capacity(&mut self, total: usize) -> Result<(), KvError> {
        let have = self.reserved_tokens();
        if total > have {
            let extra = self.pool.pages_for(total) - self.pages.len();
            let more = self.pool.alloc_pages(extra)?;
            self.pages.extend(more);
        }
        Ok(())
    }

    /// Appends `n` tokens' K and V (f32, converted to the storage dtype) to
    /// `layer`. `k` and `v` are `[n, n_kv_heads * head_dim]`.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        let n = self.check_append(layer, k.len(), v.len())?;
        self.store_rows(layer, n, k, v)
    }

    /// [`KvSeq::append`] for several sequences of one pool at once:
    /// sequence `i` appends the K and V rows `rows(i)` to `layer`. Every
    /// sequence is checked (same pool as the first, within its reservation)
    /// before anything is written, so on an error nothing is appended; the
    /// error names the sequence's place in `seqs`. Allocates nothing: a
    /// decode pass calls it once a layer for the whole batch. A device
    /// failure ([`KvError::Device`]) stops the batch at the sequence it
    /// hit; those before it have their rows.
    pub fn append_each<'r>(
        layer: usize,
        seqs: &mut [&mut KvSeq<S>],
        rows: impl Fn(usize) -> (&'r [f32], &'r [f32]),
    ) -> Result<(), (usize, KvError)> {
        let Some(first) = seqs.first() else {
            return Ok(());
        };
        let kvd = first.geometry().kv_dim();
        let ps = first.pool.page_size();
        // Sequences a few places ahead are fetched while this one is
        // handled: their counters, then the page-table entry and KV rows
        // they write next.
        const AHEAD: usize = 8;
        for (i, seq) in seqs.iter().enumerate() {
            if let Some(next) = seqs.get(i + AHEAD) {
                prefetch(next.written.as_ptr().wrapping_add(layer));
            }
            if !seq.pool.same_pool(&first.pool) {
                return Err((i, seq.foreign_pool()));
            }
            let (k, v) = rows(i);
            seq.check_append(layer, k.len(), v.len())
                .map_err(|e| (i, e))?;
            prefetch(seq.pages.as_ptr().wrapping_add(seq.written[layer] / ps));
        }
        for i in 0..seqs.len() {
            if let Some(next) = seqs.get(i + AHEAD) {
                let at = next.written[layer];
                next.pages_read().prefetch_kv(at / ps, layer, at % ps);
            }
            let (k, v) = rows(i);
            seqs[i]
                .store_rows(layer, k.len() / kvd, k, v)
                .map_err(|e| (i, e))?;
        }
        Ok(())
    }

    /// Writes `n` checked rows of K and V at the next positions of `layer`
    /// and counts them written (not on a device failure).
    fn store_rows(&mut self, layer: usize, n: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        let kvd = self.geometry().kv_dim();
        let (ps, start, writer) = (self.pool.page_size(), self.written[layer], self.owner.0);
        let mut w = self.pages_write();
        for (i, slot, done, run) in runs(start, n, ps) {
            let rows = done * kvd..(done + run) * kvd;
            w.store_kv_f32(i, layer, slot, &k[rows.clone()], &v[rows], writer)?;
        }
        self.written[layer] += n;
        Ok(())
    }

    /// Appends `n` tokens given as raw bytes of the storage dtype (what a
    /// transfer carries). `k` and `v` are `[n, kv_dim]` elements each.
    pub fn append_bytes(&mut self, layer: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let esz = self.geometry().dtype.size_bytes();
        if !k.len().is_multiple_of(esz) || !v.len().is_multiple_of(esz) {
            return Err(KvError::Shape {
                what: "KV bytes (multiple of the element size)",
                expected: esz,
                got: k.len(),
            });
        }
        let n = self.check_append(layer, k.len() / esz, v.len() / esz)?;
        let row = self.geometry().kv_dim() * esz;
        let (ps, start, writer) = (self.pool.page_size(), self.written[layer], self.owner.0);
        let pr: Vec<_> = runs(start, n, ps).collect();
        let rr = row_runs(layer, &pr, &[0, 1], false);
        let mut w = self.pages_write();
        // One pass for the whole append (one wait for a device).
        let wrote = w.write_row_runs(&rr, |r, dst| {
            let (_, _, done, run) = pr[r / 2];
            let src = if r % 2 == 0 { k } else { v };
            dst.copy_from_slice(&src[done * row..(done + run) * row]);
        })?;
        if !wrote {
            return Err(unreachable_rows(n));
        }
        for &(i, slot, _, run) in &pr {
            w.record_writers(i, layer, slot, run, writer);
        }
        self.written[layer] += n;
        Ok(())
    }

    /// Starts an append of `n` rows to `layer` that a backend's kernel
    /// writes straight into this device-resident pool's pages: checks the
    /// layer and the reservation as [`KvSeq::append`] does and gives, for
    /// each new position, the pool page and slot the kernel may write.
    /// Nothing counts as written (or readable) until
    /// [`DeviceAppend::commit`], which the backend calls once the kernel is
    /// enqueued on the stream every later read of the pages is ordered
    /// after. Refused for a pool in host memory, whose bytes the pool
    /// writes itself.
    pub fn device_append(
        &mut self,
        layer: usize,
        n: usize,
    ) -> Result<DeviceAppend<'_, S>, KvError> {
        if self.pool.residence() != crate::kv::Residence::Device {
            return Err(KvError::NotDeviceResident);
        }
        let kvd = self.geometry().kv_dim();
        let elems = n.checked_mul(kvd).ok_or(KvError::BeyondReservation {
            layer,
            written: self.written.get(layer).copied().unwrap_or(0),
            adding: n,
            reserved: self.reserved_tokens(),
        })?;
        self.check_append(layer, elems, elems)?;
        let (ps, start) = (self.pool.page_size(), self.written[layer]);
        let slots = (start..start + n)
            .map(|pos| (self.pages[pos / ps].index, (pos % ps) as u32))
            .collect();
        Ok(DeviceAppend {
            seq: self,
            layer,
            n,
            slots,
        })
    }

    /// Validates an append of `k_elems`/`v_elems` elements; returns tokens.
    fn check_append(&self, layer: usize, k_elems: usize, v_elems: usize) -> Result<usize, KvError> {
        let g = self.geometry();
        if layer >= g.n_layers {
            return Err(KvError::LayerOutOfRange {
                layer,
                n_layers: g.n_layers,
            });
        }
        if k_elems != v_elems {
            return Err(KvError::Shape {
                what: "V elements (must equal K elements)",
                expected: k_elems,
                got: v_elems,
            });
        }
        if !k_elems.is_multiple_of(g.kv_dim()) {
            return Err(KvError::Shape {
                what: "K elements (multiple of n_kv_heads * head_dim)",
                expected: g.kv_dim(),
                got: k_elems,
            });
        }
        let n = k_elems / g.kv_dim();
        let written = self.written[layer];
        if written + n > self.reserved_tokens() {
            return Err(KvError::BeyondReservation {
                layer,
                written,
                adding: n,
                reserved: self.reserved_tokens(),
            });
        }
        Ok(n)
    }
}

/// Rows of one layer that a backend's kernel writes on the device
/// ([`KvSeq::device_append`]): they count as written once committed, and
/// not at all if this is dropped (a failed launch), so a view never reads
/// a slot the kernel may not have written.
#[must_use = "the rows count as written only once committed"]
pub struct DeviceAppend<'s, S: Writable> {
    seq: &'s mut KvSeq<S>,
    layer: usize,
    n: usize,
    slots: Vec<(u32, u32)>,
}

impl<S: Writable> DeviceAppend<'_, S> {
    /// `(pool page index, slot)` of each new position, in order: the only
    /// places the kernel may write (pages the sequence owns, slots past
    /// what it has written, within its reservation).
    pub fn slots(&self) -> &[(u32, u32)] {
        &self.slots
    }
    /// Counts the rows written (and, with the audit trail, records the
    /// sequence's owner as their writer).
    pub fn commit(self) {
        let seq = self.seq;
        let (ps, start, writer) = (seq.pool.page_size(), seq.written[self.layer], seq.owner.0);
        let w = seq.pages_write();
        for (i, slot, _, run) in runs(start, self.n, ps) {
            w.record_writers(i, self.layer, slot, run, writer);
        }
        seq.written[self.layer] += self.n;
    }
}

/// The runs of consecutive slots within one page that positions
/// `[start, start + n)` cover, as `(page position in the sequence, first
/// slot, positions done before this run, run length)`.
fn runs(start: usize, n: usize, ps: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    let mut done = 0;
    std::iter::from_fn(move || {
        (done < n).then(|| {
            let pos = start + done;
            let slot = pos % ps;
            let run = (ps - slot).min(n - done);
            let item = (pos / ps, slot, done, run);
            done += run;
            item
        })
    })
}

/// The row runs of `layer` that `runs` (as [`runs`] gives them) covers,
/// for `kvs` (K = 0, V = 1) in that order within each page run: run `r` of
/// the result is page run `r / kvs.len()`.
fn row_runs(
    layer: usize,
    runs: &[(usize, usize, usize, usize)],
    kvs: &[usize],
    from_slot_0: bool,
) -> Vec<RowRun> {
    runs.iter()
        .flat_map(|&(page, slot, _, run)| {
            kvs.iter().map(move |&kv| RowRun {
                page,
                layer,
                kv,
                slot: if from_slot_0 { 0 } else { slot },
                rows: if from_slot_0 { slot + run } else { run },
            })
        })
        .collect()
}

/// The error for rows a sequence's writer could not reach: a page not
/// private to it, or past its pages (which its reservation rules out).
fn unreachable_rows(n: usize) -> KvError {
    KvError::Shape {
        what: "destination rows (a page not private to the sequence)",
        expected: n,
        got: 0,
    }
}

/// Why sealing failed, with the handle given back.
#[derive(Debug, thiserror::Error)]
#[error("cannot seal the sequence: {error}")]
pub struct SealError {
    /// The unsealed handle, unchanged.
    pub seq: KvSeq<Filling>,
    /// What was incomplete.
    pub error: KvError,
}

impl KvSeq<Filling> {
    /// Declares the sequence complete at `len` tokens. Refused unless every
    /// layer holds exactly `len` tokens.
    pub fn seal(self, len: usize) -> Result<KvSeq<Ready>, Box<SealError>> {
        if let Some(layer) = self.written.iter().position(|&w| w != len) {
            let error = KvError::Incomplete {
                layer,
                written: self.written[layer],
                expected: len,
            };
            return Err(Box::new(SealError { seq: self, error }));
        }
        Ok(self.into_state())
    }
}

impl KvSeq<Held> {
    /// Calls `f(done, bytes)` with the raw bytes of K (`kv == 0`) or V rows
    /// `[start, start + n)` of `layer`, one run of consecutive slots of one
    /// page at a time. For the transfer sender, which audits the whole
    /// sequence once through [`crate::kv::KvReader`] before sending, so that
    /// each batch does not re-scan the audit trail.
    pub(crate) fn read_rows(
        &self,
        layer: usize,
        kv: usize,
        start: usize,
        n: usize,
        mut f: impl FnMut(usize, &[u8]),
    ) -> Result<(), KvError> {
        self.check_rows(layer, start, n)?;
        self.check_rows_held(start, n)?;
        // In place from host pages; from a device's, in one staged pass.
        let pr: Vec<_> = runs(start, n, self.pool.page_size()).collect();
        let rr = row_runs(layer, &pr, &[kv], false);
        if self
            .pages_read()
            .read_row_runs(&rr, |r, bytes| f(pr[r].2, bytes))?
        {
            Ok(())
        } else {
            // Past the sequence's pages, which `check_rows` rules out.
            Err(KvError::Shape {
                what: "source rows (past the sequence's pages)",
                expected: n,
                got: 0,
            })
        }
    }

    /// Whether [`KvSeq::device_dest_region_xxh3`] can hash for a
    /// destination of `dest_page_size`-token pages (it may still answer
    /// `None` for rows that are not all written and held).
    pub(crate) fn hashes_on_device_for(&self, dest_page_size: usize) -> bool {
        dest_page_size > 0
            && self.pool.page_size().is_multiple_of(dest_page_size)
            && self.pages_read().storage().hashes_in_place()
    }

    /// The transfer sender's region hashes for a destination of
    /// `dest_page_size`-token pages, over rows `[0, tokens)`: xxh3-64 of
    /// each destination page's K and V rows of every layer, as
    /// `[dest page][layer][K, V]`, hashed on the device in one pass.
    /// `Ok(None)` unless the pool's device hashes in place and every
    /// destination page's rows lie in one source page (its page size a
    /// divisor of this pool's), and the rows are all written and held.
    pub(crate) fn device_dest_region_xxh3(
        &self,
        tokens: usize,
        dest_page_size: usize,
    ) -> Result<Option<Vec<u64>>, KvError> {
        let ps = self.pool.page_size();
        let whole = (0..self.written.len()).all(|l| self.check_rows(l, 0, tokens).is_ok());
        if dest_page_size == 0
            || !ps.is_multiple_of(dest_page_size)
            || !whole
            || self.check_rows_held(0, tokens).is_err()
        {
            return Ok(None);
        }
        let mut runs = Vec::new();
        for start in (0..tokens).step_by(dest_page_size) {
            let rows = dest_page_size.min(tokens - start);
            for layer in 0..self.written.len() {
                for kv in 0..2 {
                    runs.push(RowRun {
                        page: start / ps,
                        layer,
                        kv,
                        slot: start % ps,
                        rows,
                    });
                }
            }
        }
        self.pages_read().rows_xxh3(&runs)
    }

    /// Checks that rows `[start, start + n)` of `layer` are written.
    fn check_rows(&self, layer: usize, start: usize, n: usize) -> Result<(), KvError> {
        let g = self.geometry();
        if layer >= g.n_layers {
            return Err(KvError::LayerOutOfRange {
                layer,
                n_layers: g.n_layers,
            });
        }
        let written = self.written[layer];
        if start.checked_add(n).is_none_or(|end| end > written) {
            return Err(KvError::Incomplete {
                layer,
                written,
                expected: start.saturating_add(n),
            });
        }
        Ok(())
    }

    /// Checks, under one lock of the pool's bookkeeping, that the pages
    /// holding positions `[start, start + n)` are still held at this
    /// handle's generation (defence in depth: the handle owns them).
    fn check_rows_held(&self, start: usize, n: usize) -> Result<(), KvError> {
        if n == 0 {
            return Ok(());
        }
        let ps = self.pool.page_size();
        let (first, end) = (start / ps, pages_for(start + n, ps));
        let pages = self.pages.get(first..end).unwrap_or(&[]);
        let shared = self.prefix.len().saturating_sub(first);
        self.pool.check_seq_pages(pages, shared, true)
    }
}

impl<S: SeqState> Drop for KvSeq<S> {
    fn drop(&mut self) {
        let private = self.pages.get(self.prefix.len()..).unwrap_or(&[]);
        if private.is_empty() {
            return; // the lease (a field) is returned after this
        }
        let from = if S::HELD {
            PageState::Held
        } else {
            PageState::InUse
        };
        // Scrub while this handle still owns the pages, then give them up.
        let fill = self.pool.scrub_fill();
        self.pages_write().scrub(fill);
        self.pool.free_pages(&self.pages[self.prefix.len()..], from);
    }
}
