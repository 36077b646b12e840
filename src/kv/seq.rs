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

use std::marker::PhantomData;

use crate::config::KvGeometry;
use crate::ids::RequestId;
use crate::kv::page::PageState;
use crate::kv::storage::Storage;
use crate::kv::{KvError, KvPool, PageId};

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
    pages: Vec<PageId>,
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
            .field("written", &self.written)
            .finish()
    }
}

impl<S: SeqState> KvSeq<S> {
    pub(crate) fn new(pool: KvPool, owner: RequestId, pages: Vec<PageId>) -> Self {
        let n_layers = pool.config().geometry().n_layers;
        KvSeq {
            pool,
            owner,
            pages,
            written: vec![0; n_layers],
            _state: PhantomData,
        }
    }

    /// The request that owns these pages.
    pub fn owner(&self) -> RequestId {
        self.owner
    }
    /// The pages, in position order, at the generation this handle owns.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
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
    pub fn hold(self) -> KvSeq<Held> {
        if !S::HELD {
            self.pool.set_held(&self.pages, true);
        }
        self.into_state()
    }

    fn into_state<T: SeqState>(mut self) -> KvSeq<T> {
        // Move the pages out; the emptied husk's drop frees nothing.
        let next = KvSeq {
            pool: self.pool.clone(),
            owner: self.owner,
            pages: std::mem::take(&mut self.pages),
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
        let needed = self
            .pool
            .pages_for(max_written.max(self.reserved_tokens()) + tokens);
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
        let mut st = self.pool.shared.storage.write();
        self.store_rows(&mut st, layer, n, k, v);
        drop(st);
        self.written[layer] += n;
        Ok(())
    }

    /// [`KvSeq::append`] for several sequences of one pool at once: item
    /// `i` appends its K and V rows to `layer` of its sequence, all under
    /// one storage lock (one acquisition instead of one per sequence, which
    /// matters when several threads append to one pool). Every item is
    /// checked (same pool as the first, within its reservation) before
    /// anything is written, so on an error nothing is appended; the error
    /// names the item.
    pub fn append_each(
        layer: usize,
        items: &mut [(&mut KvSeq<S>, &[f32], &[f32])],
    ) -> Result<(), (usize, KvError)> {
        let Some(pool) = items.first().map(|(seq, ..)| seq.pool.clone()) else {
            return Ok(());
        };
        let mut ns = Vec::with_capacity(items.len());
        for (i, (seq, k, v)) in items.iter().enumerate() {
            if !seq.pool.same_pool(&pool) {
                return Err((i, seq.foreign_pool()));
            }
            ns.push(
                seq.check_append(layer, k.len(), v.len())
                    .map_err(|e| (i, e))?,
            );
        }
        // Another thread's pass may be reading (attention) for a few
        // microseconds: wait for it actively rather than park.
        let mut st = crate::sync::write_soon(&pool.shared.storage, APPEND_SPIN);
        for ((seq, k, v), &n) in items.iter().zip(&ns) {
            seq.store_rows(&mut st, layer, n, k, v);
        }
        drop(st);
        for ((seq, ..), &n) in items.iter_mut().zip(&ns) {
            seq.written[layer] += n;
        }
        Ok(())
    }

    /// Writes `n` checked rows of K and V at the next positions of `layer`
    /// (the caller then counts them written).
    fn store_rows(&self, st: &mut Storage, layer: usize, n: usize, k: &[f32], v: &[f32]) {
        let kvd = self.geometry().kv_dim();
        let writer = self.owner.0;
        self.for_each_run(layer, n, |page, slot, done, run| {
            let ko = st.offset(page, layer, 0, slot);
            st.store_f32(ko, &k[done * kvd..(done + run) * kvd]);
            let vo = st.offset(page, layer, 1, slot);
            st.store_f32(vo, &v[done * kvd..(done + run) * kvd]);
            st.record_writers(page, layer, slot, run, writer);
        });
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
        let mut st = self.pool.shared.storage.write();
        let writer = self.owner.0;
        self.for_each_run(layer, n, |page, slot, done, run| {
            let ko = st.offset(page, layer, 0, slot);
            st.store_bytes(ko, &k[done * row..(done + run) * row]);
            let vo = st.offset(page, layer, 1, slot);
            st.store_bytes(vo, &v[done * row..(done + run) * row]);
            st.record_writers(page, layer, slot, run, writer);
        });
        drop(st);
        self.written[layer] += n;
        Ok(())
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

    /// Calls `f(page_index, first_slot, tokens_done, run_len)` for each run
    /// of consecutive slots in one page covered by appending `n` tokens.
    fn for_each_run(&self, layer: usize, n: usize, mut f: impl FnMut(u32, usize, usize, usize)) {
        let ps = self.pool.page_size();
        let mut pos = self.written[layer];
        let mut done = 0;
        while done < n {
            let slot = pos % ps;
            let run = (ps - slot).min(n - done);
            f(self.pages[pos / ps].index, slot, done, run);
            pos += run;
            done += run;
        }
    }
}

/// How long a batched append spins for the storage lock before parking.
const APPEND_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Why sealing failed, with the handle given back.
#[derive(Debug)]
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

impl KvSeq<Received> {
    /// Only the transfer verifier calls this, after checking the receipt
    /// against the plan and the bytes that landed. With the audit trail on,
    /// the verified slots are recorded as written by this sequence's owner
    /// (the verifier has checked the receipt's writer ids say so); until
    /// then, peer-written slots have no trusted writer.
    pub(crate) fn into_verified(self) -> KvSeq<Ready> {
        if self.pool.config().audit_enabled() {
            let mut st = self.pool.shared.storage.write();
            let ps = self.pool.page_size();
            for (layer, &n) in self.written.iter().enumerate() {
                let mut pos = 0;
                while pos < n {
                    let slot = pos % ps;
                    let run = (ps - slot).min(n - pos);
                    st.record_writers(self.pages[pos / ps].index, layer, slot, run, self.owner.0);
                    pos += run;
                }
            }
        }
        self.into_state()
    }

    /// Appends `n` tokens to `layer` on behalf of a peer: `fill(kv, done,
    /// dst)` writes the raw storage-dtype bytes of K (`kv == 0`) or V
    /// (`kv == 1`) rows `[done, done + dst_rows)` of the batch into `dst`,
    /// one run of consecutive slots of one page at a time. Right after each
    /// run is written, `landed(page, kv, rows)` is called with the bytes of
    /// that page's rows `[0, end)` of `layer` as they now are in the pool
    /// (`page` is the position in [`KvSeq::pages`], `end` the slot after the
    /// run), still under the storage lock that wrote them: the transfer
    /// verifier hashes them there, cache-hot. The slots get no writer in
    /// the audit trail until [`KvSeq::into_verified`].
    pub(crate) fn receive_rows(
        &mut self,
        layer: usize,
        n: usize,
        fill: impl FnMut(usize, usize, &mut [u8]),
        landed: impl FnMut(usize, usize, &[u8]),
    ) -> Result<(), KvError> {
        let kvd = self.geometry().kv_dim();
        self.check_append(layer, n * kvd, n * kvd)?;
        let pool = self.pool.clone();
        let mut st = pool.shared.storage.write();
        self.receive_rows_locked(&mut st, layer, n, fill, landed);
        Ok(())
    }

    /// [`KvSeq::receive_rows`] with the rows copied straight from rows
    /// `[src_start, src_start + n)` of `layer` of `src`, a held sequence of
    /// another pool (one copy, no staging buffer). Both pool-wide storage
    /// locks are held for the copy, taken in pool order (see
    /// [`lock_pair`]), so landers copying between the same two pools in
    /// opposite directions cannot deadlock. `after(kv, done, dst)` sees each
    /// run right after it is copied (fault injection tampers there). A
    /// source page that is no longer held leaves its rows unwritten (zero
    /// or stale), which the receipt's checksums then refuse.
    pub(crate) fn receive_rows_from(
        &mut self,
        layer: usize,
        n: usize,
        src: &KvSeq<Held>,
        src_start: usize,
        mut after: impl FnMut(usize, usize, &mut [u8]),
        landed: impl FnMut(usize, usize, &[u8]),
    ) -> Result<(), KvError> {
        let g = self.geometry();
        let kvd = g.kv_dim();
        self.check_append(layer, n * kvd, n * kvd)?;
        if src.geometry() != g {
            return Err(KvError::Shape {
                what: "source geometry (must equal the destination's)",
                expected: g.bytes_per_token(),
                got: src.geometry().bytes_per_token(),
            });
        }
        src.check_rows(layer, src_start, n)?;
        let row = kvd * g.dtype.size_bytes();
        let dst_pool = self.pool.clone();
        lock_pair(&src.pool, &dst_pool, |src_st, dst_st| {
            self.receive_rows_locked(
                dst_st,
                layer,
                n,
                |kv, done, dst| {
                    let rows = dst.len() / row.max(1);
                    let _ = src.read_rows_locked(
                        src_st,
                        layer,
                        kv,
                        src_start + done,
                        rows,
                        |at, bytes| {
                            if let Some(d) = dst.get_mut(at * row..at * row + bytes.len()) {
                                d.copy_from_slice(bytes);
                            }
                        },
                    );
                    after(kv, done, dst);
                },
                landed,
            )
        })
    }

    /// The body of [`KvSeq::receive_rows`], under the destination's storage
    /// write lock; the append has been checked.
    fn receive_rows_locked(
        &mut self,
        st: &mut Storage,
        layer: usize,
        n: usize,
        mut fill: impl FnMut(usize, usize, &mut [u8]),
        mut landed: impl FnMut(usize, usize, &[u8]),
    ) {
        let kvd = self.geometry().kv_dim();
        let ps = self.pool.page_size();
        let first = self.written[layer] / ps;
        let mut at = 0;
        self.for_each_run(layer, n, |page, slot, done, run| {
            for kv in 0..2 {
                let off = st.offset(page, layer, kv, slot);
                fill(kv, done, st.bytes_mut(off, run * kvd));
                let start = st.offset(page, layer, kv, 0);
                landed(
                    first + at,
                    kv,
                    st.slice(start, (slot + run) * kvd).as_bytes(),
                );
            }
            at += 1;
        });
        self.written[layer] += n;
    }

    /// Hashes, with `hash`, the written K and V rows of every layer of each
    /// of the first `n_pages` pages, in parallel over pages; returns them
    /// as `[page][layer][K, V]`. For the transfer verifier, which recomputes
    /// checksums over what actually landed.
    pub(crate) fn received_region_hashes(
        &self,
        n_pages: usize,
        hash: impl Fn(&[u8]) -> u64 + Sync,
    ) -> Vec<u64> {
        use rayon::prelude::*;
        let st = self.pool.shared.storage.read();
        let st: &crate::kv::storage::Storage = &st;
        let ps = self.pool.page_size();
        let kvd = self.geometry().kv_dim();
        let written = &self.written;
        let pages = &self.pages[..n_pages.min(self.pages.len())];
        let per_page = |(i, page): (usize, &PageId)| -> Vec<u64> {
            let mut out = Vec::with_capacity(2 * written.len());
            for (layer, &w) in written.iter().enumerate() {
                let t = w.saturating_sub(i * ps).min(ps);
                for kv in 0..2 {
                    let s = st.slice(st.offset(page.index, layer, kv, 0), t * kvd);
                    out.push(hash(s.as_bytes()));
                }
            }
            out
        };
        pages
            .par_iter()
            .enumerate()
            .with_min_len(4)
            .flat_map_iter(per_page)
            .collect()
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
        f: impl FnMut(usize, &[u8]),
    ) -> Result<(), KvError> {
        self.check_rows(layer, start, n)?;
        let st = self.pool.shared.storage.read();
        self.read_rows_locked(&st, layer, kv, start, n, f)
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

    /// The body of [`KvSeq::read_rows`], under this pool's storage read
    /// lock; the rows have been checked.
    fn read_rows_locked(
        &self,
        st: &Storage,
        layer: usize,
        kv: usize,
        start: usize,
        n: usize,
        mut f: impl FnMut(usize, &[u8]),
    ) -> Result<(), KvError> {
        let ps = self.pool.page_size();
        let kvd = self.geometry().kv_dim();
        let (mut pos, mut done) = (start, 0);
        while done < n {
            let page = self.pages[pos / ps];
            self.pool.check_page(page, true)?;
            let run = (ps - pos % ps).min(n - done);
            let s = st.slice(st.offset(page.index, layer, kv, pos % ps), run * kvd);
            f(done, s.as_bytes());
            pos += run;
            done += run;
        }
        Ok(())
    }
}

/// Runs `f` with `src`'s storage read-locked and `dst`'s write-locked,
/// taking the two pool-wide locks in one global order (by pool identity):
/// two threads copying between the same two pools in opposite directions
/// then never hold one lock each while waiting for the other's. `src` and
/// `dst` must be different pools.
fn lock_pair<R>(
    src: &KvPool,
    dst: &KvPool,
    f: impl FnOnce(&Storage, &mut Storage) -> R,
) -> Result<R, KvError> {
    let (s, d) = (&src.shared, &dst.shared);
    if s.id == d.id {
        return Err(KvError::Shape {
            what: "source pool (must differ from the destination pool)",
            expected: 0,
            got: 0,
        });
    }
    Ok(if s.id.rank() < d.id.rank() {
        let src_st = s.storage.read();
        let mut dst_st = d.storage.write();
        f(&src_st, &mut dst_st)
    } else {
        let mut dst_st = d.storage.write();
        let src_st = s.storage.read();
        f(&src_st, &mut dst_st)
    })
}

impl<S: SeqState> Drop for KvSeq<S> {
    fn drop(&mut self) {
        let from = if S::HELD {
            PageState::Held
        } else {
            PageState::InUse
        };
        self.pool.free_pages(&self.pages, from);
    }
}
