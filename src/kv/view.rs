//! Read access to KV for attention: validated once per sequence per step.

use crate::kv::pages_for;
use crate::kv::seq::{KvSeq, Readable};
use crate::kv::storage::{KvSlice, PagesRead};
use crate::kv::{KvError, KvPool, PageId, Residence};

/// Reads of one pool's KV for a batched read phase. It holds no lock: a
/// view borrows the sequence it reads, so that sequence cannot be appended
/// to (or released) while the view lives, and no other sequence can reach
/// its pages (see the storage module).
pub struct KvReader<'p> {
    pool: &'p KvPool,
}

impl<'p> KvReader<'p> {
    pub(crate) fn new(pool: &'p KvPool) -> Self {
        KvReader { pool }
    }

    /// Validates that every page of `seq` holding written positions belongs
    /// to this pool, is the sequence's at its current generation, and
    /// returns a view of those positions (a view reads no other page).
    pub fn seq<'a, S: Readable>(&'a self, seq: &'a KvSeq<S>) -> Result<SeqView<'a>, KvError> {
        let mut views = self.seqs(std::iter::once(seq)).map_err(|(_, e)| e)?;
        // One sequence in, one view out.
        views.pop().ok_or_else(|| seq.foreign_pool())
    }

    /// [`KvReader::seq`] for every sequence of a batch, validated under one
    /// lock of the pool's bookkeeping; the error names the failing
    /// sequence's place in the batch.
    pub fn seqs<'a, S: Readable>(
        &'a self,
        seqs: impl IntoIterator<Item = &'a KvSeq<S>>,
    ) -> Result<Vec<SeqView<'a>>, (usize, KvError)> {
        let seqs: Vec<&'a KvSeq<S>> = seqs.into_iter().collect();
        self.all_mine(&seqs)?;
        // Only the pages a view can read (see `KvSeq::readable_pages`).
        self.pool
            .check_many_seqs(&seqs, |s| (s.readable_pages(), s.shared_pages()), S::HELD)?;
        Ok(seqs.into_iter().map(|seq| self.view(seq)).collect())
    }

    /// Refuses the first sequence of `seqs` from another pool, at its place.
    fn all_mine<S: Readable>(&self, seqs: &[&KvSeq<S>]) -> Result<(), (usize, KvError)> {
        match seqs
            .iter()
            .enumerate()
            .find(|(_, s)| !s.pool().same_pool(self.pool))
        {
            Some((i, seq)) => Err((i, seq.foreign_pool())),
            None => Ok(()),
        }
    }

    /// The view of a checked sequence.
    fn view<'a, S: Readable>(&'a self, seq: &'a KvSeq<S>) -> SeqView<'a> {
        SeqView {
            reader: self,
            read: seq.pages_read(),
            pages: seq.pages(),
            shared: seq.shared_pages(),
            tenant: seq.tenant(),
            written: seq.written_per_layer(),
            owner: seq.owner(),
        }
    }
}

/// Proof that a batch's page tables were checked once for a whole forward
/// pass ([`KvReader::check_pass`]): each sequence's pages that hold written
/// positions, or will once the pass has appended its rows. The pass holds
/// every sequence mutably from the check to its last read, so no page table
/// can change meanwhile; [`KvReader::pass_views`] still compares each table
/// with the one checked and checks again, under the lock, any that differs.
pub(crate) struct PassCheck {
    /// Per sequence: its page table's address and length when checked, and
    /// how many of its leading pages were checked.
    tables: Vec<(usize, usize, usize)>,
}

impl PassCheck {
    /// True when `seqs` are the sequences checked, of `pool`, each with the
    /// page table checked and reading no page past those checked.
    pub(crate) fn covers<S: Readable>(&self, seqs: &[&KvSeq<S>], pool: &KvPool) -> bool {
        seqs.len() == self.tables.len()
            && seqs.iter().zip(&self.tables).all(|(s, &(addr, len, n))| {
                s.pages().as_ptr() as usize == addr
                    && s.pages().len() == len
                    && s.readable_pages().len() <= n
                    && s.pool().same_pool(pool)
            })
    }
}

impl<'p> KvReader<'p> {
    /// Checks, under one lock, the pages each sequence of a pass may read:
    /// those holding written positions now and the next `adds(i)` tokens of
    /// sequence `i`.
    pub(crate) fn check_pass<S: Readable>(
        &self,
        seqs: &[&KvSeq<S>],
        adds: impl Fn(usize) -> usize,
    ) -> Result<PassCheck, (usize, KvError)> {
        self.all_mine(seqs)?;
        // Each sequence's written counts are a separate allocation: fetch
        // those of the sequence a few places on while this one is read.
        let items: Vec<(&[PageId], usize)> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                if let Some(next) = seqs.get(i + 8) {
                    next.prefetch_counts();
                }
                (s.readable_pages_after(adds(i)), s.shared_pages())
            })
            .collect();
        self.pool.check_many_seqs(&items, |&t| t, S::HELD)?;
        Ok(PassCheck {
            tables: seqs
                .iter()
                .zip(&items)
                .map(|(s, (checked, _))| {
                    (s.pages().as_ptr() as usize, s.pages().len(), checked.len())
                })
                .collect(),
        })
    }

    /// Views of a batch checked by [`KvReader::check_pass`], taking no lock
    /// while every page table is the one checked and reads no page past
    /// those checked; otherwise the batch is checked again as
    /// [`KvReader::seqs`] does.
    pub(crate) fn pass_views<'a, S: Readable>(
        &'a self,
        check: &PassCheck,
        seqs: impl IntoIterator<Item = &'a KvSeq<S>>,
    ) -> Result<Vec<SeqView<'a>>, (usize, KvError)> {
        let seqs: Vec<&'a KvSeq<S>> = seqs.into_iter().collect();
        if !check.covers(&seqs, self.pool) {
            return self.seqs(seqs);
        }
        Ok(seqs.into_iter().map(|seq| self.view(seq)).collect())
    }
}

/// A validated sequence inside a [`KvReader`].
pub struct SeqView<'a> {
    reader: &'a KvReader<'a>,
    read: PagesRead<'a>,
    pages: &'a [PageId],
    /// Leading pages leased from the prefix cache.
    shared: usize,
    tenant: Option<crate::TenantId>,
    written: &'a [usize],
    owner: crate::RequestId,
}

impl<'a> SeqView<'a> {
    /// The written positions of `layer`. With the `audit` feature, checks
    /// that every slot read was written by this sequence's owner or, in a
    /// page leased from the prefix cache, by the page's recorded publisher,
    /// who must be of this sequence's tenant; a mismatch is an
    /// [`KvError::IsolationViolation`], counted in the pool's stats.
    pub fn layer(&self, layer: usize) -> Result<LayerView<'a>, KvError> {
        let n_layers = self.written.len();
        let len = *self
            .written
            .get(layer)
            .ok_or(KvError::LayerOutOfRange { layer, n_layers })?;
        let st = self.read.storage();
        let ps = self.reader.pool.page_size();
        // Page by page: a page's writer slots for one layer are contiguous.
        // A trail that cannot answer for a slot fails the audit.
        let pages = if st.audited() { pages_for(len, ps) } else { 0 };
        for (i, p) in self.pages.iter().enumerate().take(pages) {
            let n = (len - i * ps).min(ps);
            let expected = if i < self.shared {
                self.cached_writer(p.index)
            } else {
                Some(self.owner.0 + 1)
            };
            let mismatch = match (expected, st.writers(p.index, layer, 0, n)) {
                (Some(e), Some(slots)) => slots.enumerate().find(|&(_, w)| w != e),
                (None, Some(mut slots)) => Some((0, slots.next().unwrap_or(0))),
                (_, None) => Some((0, 0)),
            };
            if let Some((slot, w)) = mismatch {
                self.reader.pool.record_violation();
                return Err(KvError::IsolationViolation {
                    reader: self.owner,
                    writer: w.checked_sub(1).map(crate::RequestId),
                    page: p.index,
                    layer,
                    slot,
                });
            }
        }
        Ok(LayerView {
            read: self.read,
            pages: self.pages,
            layer,
            len,
            page_size: ps,
            kv_dim: self.reader.pool.config().geometry().kv_dim(),
        })
    }

    /// The owner of the sequence.
    pub fn owner(&self) -> crate::RequestId {
        self.owner
    }

    /// The writer every slot of cached page `page` must have: its recorded
    /// publisher, when that publisher is of this sequence's tenant; `None`
    /// (every slot fails the audit) otherwise.
    fn cached_writer(&self, page: u32) -> Option<u64> {
        let (request, tenant) = self.read.storage().publisher(page)?;
        let mine = self.tenant.map(|t| u64::from(t.0) + 1)?;
        (request != 0 && tenant == mine).then_some(request)
    }
}

/// The written K/V rows of one layer of one sequence.
#[derive(Clone, Copy)]
pub struct LayerView<'a> {
    read: PagesRead<'a>,
    pages: &'a [PageId],
    layer: usize,
    len: usize,
    page_size: usize,
    kv_dim: usize,
}

impl<'a> LayerView<'a> {
    /// Written tokens.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Elements per row (n_kv_heads * head_dim).
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }
    /// Token slots per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// Pages holding written tokens.
    pub fn n_pages(&self) -> usize {
        pages_for(self.len, self.page_size)
    }
    /// Pool indices of the pages holding written tokens (a page table).
    pub fn page_table(&self) -> impl Iterator<Item = u32> + '_ {
        self.pages[..self.n_pages()].iter().map(|p| p.index)
    }
    /// The pages holding written tokens, with their generations: a backend
    /// that mirrors page bytes elsewhere (GPU) knows from these when a page
    /// changed hands and its mirror is stale.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn page_ids(&self) -> &'a [PageId] {
        &self.pages[..self.n_pages()]
    }
    /// The pool's device storage (`None` in host memory): a GPU backend's
    /// kernels read the pages there, through page tables built from this
    /// view.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn device_pages(&self) -> Option<&'a dyn crate::kv::DevicePages> {
        self.read.storage().device_pages()
    }
    /// The layer this view reads.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn layer_index(&self) -> usize {
        self.layer
    }
    /// Written tokens in page `i` of this sequence.
    pub fn tokens_in_page(&self, i: usize) -> usize {
        self.len
            .saturating_sub(i.saturating_mul(self.page_size))
            .min(self.page_size)
    }
    fn rows(&self, i: usize, kv: usize) -> KvSlice<'a> {
        let n = self.tokens_in_page(i);
        self.read
            .rows(i, self.layer, kv, 0, n)
            .unwrap_or(KvSlice::F32(&[]))
    }
    /// Where the pool's page bytes live. The row accessors below that
    /// borrow rows in place ([`LayerView::keys`], [`LayerView::values`],
    /// [`LayerView::key`], [`LayerView::value`]) give nothing for a
    /// [`Residence::Device`] pool: a backend that reads rows on the host
    /// refuses such a pool, and the copying accessors
    /// ([`LayerView::copy_key_f32`]) work on both.
    pub fn residence(&self) -> Residence {
        self.read.storage().residence()
    }
    /// K rows `[tokens_in_page(i), kv_dim]` of page `i` (empty past the
    /// sequence's pages, and for a device-resident pool).
    pub fn keys(&self, i: usize) -> KvSlice<'a> {
        self.rows(i, 0)
    }
    /// V rows `[tokens_in_page(i), kv_dim]` of page `i`.
    pub fn values(&self, i: usize) -> KvSlice<'a> {
        self.rows(i, 1)
    }
    /// K row of position `pos` (`pos < len`), or `None` (also for a
    /// device-resident pool).
    pub fn key(&self, pos: usize) -> Option<KvSlice<'a>> {
        self.row(pos, 0)
    }
    /// V row of position `pos` (`pos < len`), or `None`.
    pub fn value(&self, pos: usize) -> Option<KvSlice<'a>> {
        self.row(pos, 1)
    }
    fn row(&self, pos: usize, kv: usize) -> Option<KvSlice<'a>> {
        if pos >= self.len {
            return None;
        }
        let ps = self.page_size;
        self.read.rows(pos / ps, self.layer, kv, pos % ps, 1)
    }

    /// Copies the K row of position `pos` into `out` (`kv_dim` values) as
    /// f32, wherever the pages live: from host memory in place, from a
    /// device as a staged copy. Refused past the written positions.
    pub fn copy_key_f32(&self, pos: usize, out: &mut [f32]) -> Result<(), KvError> {
        self.copy_row_f32(pos, 0, out)
    }
    /// [`LayerView::copy_key_f32`] for the V row.
    pub fn copy_value_f32(&self, pos: usize, out: &mut [f32]) -> Result<(), KvError> {
        self.copy_row_f32(pos, 1, out)
    }
    fn copy_row_f32(&self, pos: usize, kv: usize, out: &mut [f32]) -> Result<(), KvError> {
        if pos >= self.len {
            return Err(KvError::Incomplete {
                layer: self.layer,
                written: self.len,
                expected: pos.saturating_add(1),
            });
        }
        if out.len() != self.kv_dim {
            return Err(KvError::Shape {
                what: "row buffer (n_kv_heads * head_dim values)",
                expected: self.kv_dim,
                got: out.len(),
            });
        }
        let ps = self.page_size;
        let dtype = self.read.storage().dtype();
        let mut scratch = Vec::new();
        let bytes = self
            .read
            .rows_bytes(pos / ps, self.layer, kv, pos % ps, 1, &mut scratch)?
            .ok_or(KvError::Incomplete {
                layer: self.layer,
                written: self.len,
                expected: pos + 1,
            })?;
        crate::kv::storage::bytes_to_f32(dtype, bytes, out);
        Ok(())
    }
}
