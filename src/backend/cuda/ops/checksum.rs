//! Checksums on the device: xxh3-64 of byte ranges, and the transfer
//! layer's per-page checksums of the KV arena.

use cudarc::driver::DevicePtr;

use crate::backend::cuda::kernels;
use crate::backend::cuda::params::{HashRangesParams, PageChecksumParams};
use crate::backend::cuda::plan::{shape, to_u32};
use crate::backend::cuda::table::CHECKSUM_WARPS;
use crate::backend::cuda::{CudaDevice, CudaError, DeviceKvArena};

/// Transfer checksums of KV pages computed on the device (see
/// [`CudaDevice::page_checksums`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct PageChecksums {
    /// Region hashes as `[page][layer][K, V]`, pages in the order given.
    pub regions: Vec<u64>,
    /// One checksum per page given, in that order.
    pub pages: Vec<u64>,
}

impl CudaDevice {
    /// xxh3-64 (seed 0) of each `(offset, len)` byte range of `data`, one
    /// warp per range; the same value as `twox_hash::XxHash3_64::oneshot`.
    pub fn xxh3_64_ranges(
        &self,
        data: &impl DevicePtr<u8>,
        ranges: &[(usize, usize)],
    ) -> Result<Vec<u64>, CudaError> {
        for &(off, len) in ranges {
            if off.checked_add(len).is_none_or(|end| end > data.len()) {
                return Err(CudaError::Shape {
                    what: "hashed range end (within the buffer)",
                    expected: data.len(),
                    got: off.saturating_add(len),
                });
            }
        }
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let n = to_u32("hashed ranges", ranges.len())?;
        let offsets: Vec<u64> = ranges.iter().map(|r| r.0 as u64).collect();
        let lens: Vec<u64> = ranges.iter().map(|r| r.1 as u64).collect();
        let offsets = self.upload(&offsets)?;
        let lens = self.upload(&lens)?;
        let mut out = self.zeros::<u64>(ranges.len())?;
        let blocks = (ranges.len().div_ceil(CHECKSUM_WARPS) as u32, 1, 1);
        // Launch contract: every range lies within data (checked above);
        // offsets, lens and out hold n u64 each; one warp per range over
        // ceil(n / 8) blocks of 8 warps, and the kernel returns for warps
        // past n.
        self.launch_bound(kernels::xxh3_ranges(), blocks, |a| HashRangesParams {
            data: a.read(data),
            offsets: a.read(&offsets),
            lens: a.read(&lens),
            out: a.write(&mut out),
            n,
            pad0: 0,
        })?;
        self.download(&out)
    }

    /// The transfer layer's per-page checksums (src/transfer/checksum.rs)
    /// over `pages` of the device arena, page `pages[i]` holding `tokens[i]`
    /// written rows (slots `0..tokens[i]` of every layer, K and V).
    pub fn page_checksums(
        &self,
        arena: &DeviceKvArena,
        pages: &[u32],
        tokens: &[usize],
    ) -> Result<PageChecksums, CudaError> {
        shape("tokens per checksummed page", pages.len(), tokens.len())?;
        for &p in pages {
            if p as usize >= arena.pages() {
                return Err(CudaError::PageOutOfRange {
                    page: p,
                    pages: arena.pages(),
                });
            }
        }
        if let Some(&t) = tokens.iter().find(|&&t| t > arena.page_size()) {
            return Err(CudaError::Shape {
                what: "rows in a checksummed page (at most page_size)",
                expected: arena.page_size(),
                got: t,
            });
        }
        let g = arena.geometry();
        if pages.is_empty() {
            return Ok(PageChecksums {
                regions: Vec::new(),
                pages: Vec::new(),
            });
        }
        let n_pages = to_u32("checksummed pages", pages.len())?;
        let tokens32: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
        let page_list = self.upload(pages)?;
        let token_list = self.upload(&tokens32)?;
        let mut regions = self.zeros::<u64>(pages.len() * g.n_layers * 2)?;
        let mut sums = self.zeros::<u64>(pages.len())?;
        let n_layers = to_u32("layers", g.n_layers)?;
        let page_size = to_u32("page size", arena.page_size())?;
        let row_bytes = to_u32("KV row bytes", g.kv_dim() * g.dtype.size_bytes())?;
        // Launch contract: every page is inside the arena and every token
        // count at most page_size (checked), so each region (at most
        // page_size rows of one layer's K or V) lies inside its page;
        // regions holds n_pages*n_layers*2 and sums n_pages u64; one block
        // per page.
        self.launch_bound(kernels::page_checksums(), (n_pages, 1, 1), |a| {
            PageChecksumParams {
                kv: a.read(&arena.data),
                pages: a.read(&page_list),
                tokens: a.read(&token_list),
                region_hashes: a.write(&mut regions),
                page_checksums: a.write(&mut sums),
                page_bytes: arena.page_bytes() as u64,
                n_pages,
                n_layers,
                page_size,
                row_bytes,
            }
        })?;
        Ok(PageChecksums {
            regions: self.download(&regions)?,
            pages: self.download(&sums)?,
        })
    }
}
