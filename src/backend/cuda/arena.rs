//! Device KV memory and the validated page tables that index it.
//!
//! [`DeviceKvArena`] mirrors the host arena byte for byte:
//! `[page][layer][k|v][slot][kv_dim]` in the pool's dtype. Kernels index it
//! through [`PageTables`] and [`SlotMap`], which can only be built by
//! validating every page index against the arena and every length against
//! the pages given: a kernel cannot be pointed outside the arena, nor at
//! positions a sequence was not given.

use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::CudaSlice;

use super::{CudaDevice, CudaError};
use crate::kv::KvGeometry;

fn fresh_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// KV pages in device memory, laid out as the host arena.
pub struct DeviceKvArena {
    pub(super) id: u64,
    pub(super) data: CudaSlice<u8>,
    geometry: KvGeometry,
    page_size: usize,
    pages: usize,
}

impl std::fmt::Debug for DeviceKvArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKvArena")
            .field("geometry", &self.geometry)
            .field("page_size", &self.page_size)
            .field("pages", &self.pages)
            .finish()
    }
}

impl DeviceKvArena {
    /// A zeroed arena of `pages` pages of `page_size` slots.
    pub fn new(
        dev: &CudaDevice,
        geometry: KvGeometry,
        page_size: usize,
        pages: usize,
    ) -> Result<Self, CudaError> {
        geometry.validate().map_err(|e| CudaError::Unsupported {
            what: "KV geometry",
            detail: e.to_string(),
        })?;
        if page_size == 0 || !page_size.is_power_of_two() || page_size > 1 << 16 {
            return Err(CudaError::Unsupported {
                what: "page size",
                detail: format!("{page_size} (a power of two up to 65536)"),
            });
        }
        if pages == 0 || u32::try_from(pages).is_err() {
            return Err(CudaError::Unsupported {
                what: "page count",
                detail: format!("{pages} (1 to u32::MAX)"),
            });
        }
        let row_bytes = geometry.kv_dim() * geometry.dtype.size_bytes();
        if !row_bytes.is_multiple_of(16) {
            return Err(CudaError::Unsupported {
                what: "KV row size",
                detail: format!(
                    "n_kv_heads * head_dim * dtype size = {row_bytes} bytes (a multiple of 16)"
                ),
            });
        }
        let bytes = geometry
            .bytes_per_token()
            .checked_mul(page_size)
            .and_then(|b| b.checked_mul(pages))
            .ok_or(CudaError::Unsupported {
                what: "arena size",
                detail: "overflows usize".into(),
            })?;
        Ok(DeviceKvArena {
            id: fresh_id(),
            data: dev.zeros::<u8>(bytes)?,
            geometry,
            page_size,
            pages,
        })
    }

    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// Pages in the arena.
    pub fn pages(&self) -> usize {
        self.pages
    }
    /// Bytes of one page (all layers, K and V).
    pub fn page_bytes(&self) -> usize {
        self.geometry.bytes_per_token() * self.page_size
    }
    /// Elements of one page.
    pub fn page_elems(&self) -> usize {
        self.page_bytes() / self.geometry.dtype.size_bytes()
    }

    fn check_page(&self, page: u32) -> Result<std::ops::Range<usize>, CudaError> {
        if page as usize >= self.pages {
            return Err(CudaError::PageOutOfRange {
                page,
                pages: self.pages,
            });
        }
        let pb = self.page_bytes();
        Ok(page as usize * pb..(page as usize + 1) * pb)
    }

    /// Copies one whole page (raw bytes of the dtype, host layout) to the device.
    pub fn write_page(
        &mut self,
        dev: &CudaDevice,
        page: u32,
        bytes: &[u8],
    ) -> Result<(), CudaError> {
        let range = self.check_page(page)?;
        if bytes.len() != range.len() {
            return Err(CudaError::Shape {
                what: "page bytes",
                expected: range.len(),
                got: bytes.len(),
            });
        }
        let mut dst = self.data.slice_mut(range);
        // A recorded launch may read these bytes: it goes first.
        dev.flush()?;
        dev.inner
            .stream
            .memcpy_htod(bytes, &mut dst)
            .map_err(CudaError::driver("copying a page to the device"))
    }

    /// Copies rows `[n, kv_dim]` (raw dtype bytes) into slots `slot..slot + n`
    /// of `layer`, K (`kv == 0`) or V, of `page`.
    pub fn write_rows(
        &mut self,
        dev: &CudaDevice,
        page: u32,
        layer: usize,
        kv: usize,
        slot: usize,
        bytes: &[u8],
    ) -> Result<(), CudaError> {
        let page_range = self.check_page(page)?;
        let row = self.geometry.kv_dim() * self.geometry.dtype.size_bytes();
        let n = bytes.len() / row;
        if layer >= self.geometry.n_layers
            || kv > 1
            || !bytes.len().is_multiple_of(row)
            || slot + n > self.page_size
        {
            return Err(CudaError::Shape {
                what: "rows inside one page's layer (slot + rows <= page_size)",
                expected: self.page_size,
                got: slot + n,
            });
        }
        let start = page_range.start + ((layer * 2 + kv) * self.page_size + slot) * row;
        let mut dst = self.data.slice_mut(start..start + bytes.len());
        // A recorded launch may read these bytes: it goes first.
        dev.flush()?;
        dev.inner
            .stream
            .memcpy_htod(bytes, &mut dst)
            .map_err(CudaError::driver("copying KV rows to the device"))
    }

    /// Copies one whole page back to the host.
    pub fn read_page(&self, dev: &CudaDevice, page: u32) -> Result<Vec<u8>, CudaError> {
        let range = self.check_page(page)?;
        let src = self.data.slice(range);
        dev.flush()?;
        dev.count_sync();
        dev.inner
            .stream
            .clone_dtoh(&src)
            .map_err(CudaError::driver("copying a page from the device"))
    }
}

/// One sequence of a batch, as the host's page accounting describes it.
#[derive(Clone, Copy, Debug)]
pub struct SeqPages<'a> {
    /// Arena pages holding the sequence, in position order.
    pub pages: &'a [u32],
    /// Positions written and attended (the new ones included).
    pub kv_len: usize,
    /// New positions this step (1 for decode; the chunk for prefill), the
    /// last `q_len` of the `kv_len`.
    pub q_len: usize,
}

/// u32 arrays uploaded as one buffer: one allocation and one copy a step
/// instead of one of each per array.
pub(super) struct Packed<const N: usize> {
    pub(super) data: CudaSlice<u32>,
    /// Where each array starts in `data`, in elements (see [`pack`]).
    pub(super) at: [usize; N],
}

impl<const N: usize> Packed<N> {
    /// `parts` on the device: written into `reuse`'s memory when it holds
    /// them (the caller's guarantee: no launch still to be queued reads
    /// it), else into a new buffer with room to grow (twice what they
    /// need, rounded to a power of two), so that a batch's tables keep
    /// their address while they grow by a page now and then.
    fn fill(dev: &CudaDevice, parts: [&[u32]; N], reuse: Option<Self>) -> Result<Self, CudaError> {
        let (host, at) = pack(parts);
        let mut data = match reuse {
            Some(p) if p.data.len() >= host.len() => p.data,
            _ => dev.zeros((2 * host.len()).next_power_of_two())?,
        };
        dev.overwrite(&host, &mut data)?;
        Ok(Packed { data, at })
    }
}

/// `parts` back to back, each starting on a multiple of 4 elements (16
/// bytes; zeros between), and where each starts.
fn pack<const N: usize>(parts: [&[u32]; N]) -> (Vec<u32>, [usize; N]) {
    let mut host = Vec::with_capacity(parts.iter().map(|p| p.len() + 3).sum());
    let mut at = [0; N];
    for (start, part) in at.iter_mut().zip(parts) {
        *start = host.len();
        host.extend_from_slice(part);
        host.resize(host.len().next_multiple_of(4), 0);
    }
    (host, at)
}

/// Validated page tables of a batch, uploaded to the device.
///
/// Built only by [`PageTables::new`], which checks that every page is inside
/// the arena and that each sequence's pages cover its `kv_len` positions.
pub struct PageTables {
    pub(super) arena_id: u64,
    pub(super) batch: usize,
    pub(super) max_kv_len: usize,
    pub(super) max_q_len: usize,
    pub(super) total_q: usize,
    /// In one buffer: the pages of every sequence back to back (`page_table`
    /// of the kernels' params), where each sequence's start (`page_indptr`,
    /// batch + 1), where each one's query rows start (`q_indptr`, batch +
    /// 1), and each one's KV length (`kv_len`, batch).
    pub(super) arrays: Packed<4>,
}

impl PageTables {
    /// Validates `seqs` against `arena` and uploads their tables.
    pub fn new(
        dev: &CudaDevice,
        arena: &DeviceKvArena,
        seqs: &[SeqPages<'_>],
    ) -> Result<Self, CudaError> {
        Self::refill(dev, arena, seqs, None)
    }

    /// [`PageTables::new`], written into `reuse`'s device memory where it
    /// has room (see `Packed::fill`: no launch still to be queued may read
    /// `reuse`, which the backend's memo guarantees).
    pub(super) fn refill(
        dev: &CudaDevice,
        arena: &DeviceKvArena,
        seqs: &[SeqPages<'_>],
        reuse: Option<Self>,
    ) -> Result<Self, CudaError> {
        if seqs.is_empty() || seqs.len() > 65_535 {
            return Err(CudaError::Unsupported {
                what: "batch size",
                detail: format!("{} sequences (1 to 65535)", seqs.len()),
            });
        }
        let mut table = Vec::new();
        let mut page_indptr = vec![0u32];
        let mut q_indptr = vec![0u32];
        let mut kv_lens = Vec::with_capacity(seqs.len());
        let (mut max_kv, mut max_q, mut total_q) = (0usize, 0usize, 0usize);
        for (i, s) in seqs.iter().enumerate() {
            let bad = |detail: String| CudaError::BadPageTable { seq: i, detail };
            if s.kv_len == 0 || s.q_len == 0 {
                return Err(bad(format!(
                    "kv_len {} and q_len {} must both be at least 1",
                    s.kv_len, s.q_len
                )));
            }
            if s.q_len > s.kv_len {
                return Err(bad(format!(
                    "q_len {} exceeds kv_len {}: new positions must be appended first",
                    s.q_len, s.kv_len
                )));
            }
            let covered = s.pages.len().saturating_mul(arena.page_size());
            if s.kv_len > covered {
                return Err(bad(format!(
                    "kv_len {} exceeds the {} slots of its {} pages",
                    s.kv_len,
                    covered,
                    s.pages.len()
                )));
            }
            // Only the pages holding positions are uploaded: the kernel
            // cannot wander into reserved-but-unwritten pages.
            let used = &s.pages[..s.kv_len.div_ceil(arena.page_size())];
            for &p in used {
                arena.check_page(p)?;
            }
            table.extend_from_slice(used);
            total_q += s.q_len;
            let too_big = |what: &'static str| CudaError::Unsupported {
                what,
                detail: "exceeds u32".into(),
            };
            page_indptr.push(u32::try_from(table.len()).map_err(|_| too_big("total pages"))?);
            q_indptr.push(u32::try_from(total_q).map_err(|_| too_big("total query rows"))?);
            kv_lens.push(u32::try_from(s.kv_len).map_err(|_| too_big("kv_len"))?);
            max_kv = max_kv.max(s.kv_len);
            max_q = max_q.max(s.q_len);
        }
        Ok(PageTables {
            arena_id: arena.id,
            batch: seqs.len(),
            max_kv_len: max_kv,
            max_q_len: max_q,
            total_q,
            arrays: Packed::fill(
                dev,
                [&table, &page_indptr, &q_indptr, &kv_lens],
                reuse.map(|r| r.arrays),
            )?,
        })
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Query rows in the batch (the sum of `q_len`).
    pub fn total_q(&self) -> usize {
        self.total_q
    }
    /// The longest `kv_len`.
    pub fn max_kv_len(&self) -> usize {
        self.max_kv_len
    }
}

/// Validated destination slots for KV appends, uploaded to the device.
pub struct SlotMap {
    pub(super) arena_id: u64,
    pub(super) n_tokens: usize,
    /// In one buffer: each row's page (`dst_page` of the kernels' params),
    /// then its slot in the page (`dst_slot`), n_tokens each.
    pub(super) arrays: Packed<2>,
}

impl SlotMap {
    /// Slots given as (page, slot) pairs, one per token row. Refuses pages
    /// outside the arena, slots outside a page and two rows aimed at one slot.
    pub fn new(
        dev: &CudaDevice,
        arena: &DeviceKvArena,
        slots: &[(u32, u32)],
    ) -> Result<Self, CudaError> {
        Self::refill(dev, arena, slots, None)
    }

    /// [`SlotMap::new`], written into `reuse`'s device memory where it has
    /// room (as [`PageTables::refill`]).
    pub(super) fn refill(
        dev: &CudaDevice,
        arena: &DeviceKvArena,
        slots: &[(u32, u32)],
        reuse: Option<Self>,
    ) -> Result<Self, CudaError> {
        if slots.is_empty() || u32::try_from(slots.len()).is_err() {
            return Err(CudaError::Unsupported {
                what: "append rows",
                detail: format!("{} (1 to u32::MAX)", slots.len()),
            });
        }
        let mut seen = std::collections::HashSet::with_capacity(slots.len());
        for (i, &(page, slot)) in slots.iter().enumerate() {
            arena.check_page(page)?;
            if slot as usize >= arena.page_size() {
                return Err(CudaError::BadPageTable {
                    seq: i,
                    detail: format!("slot {slot} outside a page of {}", arena.page_size()),
                });
            }
            if !seen.insert((page, slot)) {
                return Err(CudaError::BadPageTable {
                    seq: i,
                    detail: format!("page {page} slot {slot} is written twice in one append"),
                });
            }
        }
        let pages: Vec<u32> = slots.iter().map(|s| s.0).collect();
        let slot_ids: Vec<u32> = slots.iter().map(|s| s.1).collect();
        Ok(SlotMap {
            arena_id: arena.id,
            n_tokens: slots.len(),
            arrays: Packed::fill(dev, [&pages, &slot_ids], reuse.map(|r| r.arrays))?,
        })
    }

    /// The slots of each sequence's new positions `kv_len - q_len .. kv_len`,
    /// in batch order: the rows of a prefill or decode step's K/V.
    pub fn for_new_positions(
        dev: &CudaDevice,
        arena: &DeviceKvArena,
        seqs: &[SeqPages<'_>],
    ) -> Result<Self, CudaError> {
        let ps = arena.page_size();
        let mut slots = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if s.q_len > s.kv_len || s.kv_len > s.pages.len().saturating_mul(ps) {
                return Err(CudaError::BadPageTable {
                    seq: i,
                    detail: format!(
                        "positions {}..{} are not covered by {} pages",
                        s.kv_len.saturating_sub(s.q_len),
                        s.kv_len,
                        s.pages.len()
                    ),
                });
            }
            for pos in s.kv_len - s.q_len..s.kv_len {
                slots.push((s.pages[pos / ps], (pos % ps) as u32));
            }
        }
        Self::new(dev, arena, &slots)
    }

    /// Token rows this map writes.
    pub fn len(&self) -> usize {
        self.n_tokens
    }
    pub fn is_empty(&self) -> bool {
        self.n_tokens == 0
    }
}

#[cfg(test)]
mod tests {
    use super::pack;

    #[test]
    fn packed_arrays_each_start_on_16_bytes_and_hold_their_elements() {
        let parts: [&[u32]; 4] = [&[1, 2, 3], &[], &[4], &[5, 6, 7, 8, 9]];
        let (host, at) = pack(parts);
        assert_eq!(at, [0, 4, 4, 8]);
        for (start, part) in at.iter().zip(parts) {
            assert_eq!(start % 4, 0, "16-byte start");
            assert_eq!(&host[*start..*start + part.len()], part);
        }
        assert_eq!(host.len(), 16, "the last array padded too");
        assert_eq!(
            pack([&[7u32; 4][..], &[8; 4]]),
            (vec![7, 7, 7, 7, 8, 8, 8, 8], [0, 4])
        );
    }
}
