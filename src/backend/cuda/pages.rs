//! [`CudaPages`]: a device-resident pool's page bytes in GPU memory
//! ([`crate::kv::DevicePages`]). The pool keeps every page's metadata on
//! the host and reaches these bytes only as staged copies of rows it owns
//! (appends, transfer landings: a batch's runs in one pass through
//! page-locked memory), fills (scrubs) and hash passes (the
//! checksums of landed KV, computed on the device), each queued
//! on the device's one stream, so a kernel launched after a scrub reads
//! the scrubbed page, and each call waits for its copy to finish.

use cudarc::driver::PinnedHostSlice;

use parking_lot::MappedMutexGuard;

use super::{CudaDevice, CudaError, DeviceKvArena};
use crate::kv::{DeviceError, DevicePages, PoolConfig};

/// How many bytes of a fill pattern are uploaded at a time.
const FILL_CHUNK: usize = 1 << 20;

/// The most page-locked host memory a storage keeps for staged passes
/// ([`DevicePages::write_runs`], [`DevicePages::read_runs`]); a larger pass
/// goes through it in chunks, waiting for the device once per chunk.
const STAGING_MAX: usize = 32 << 20;

/// Page bytes in device memory, as a [`DeviceKvArena`] the backend's
/// kernels index through validated page tables.
pub struct CudaPages {
    dev: CudaDevice,
    /// The arena; the lock orders the pool's copies and the backend's
    /// launches on the host side (the stream orders them on the device).
    arena: parking_lot::Mutex<DeviceKvArena>,
    len: usize,
    /// Page-locked host memory for staged passes, grown to the largest
    /// pass (up to [`STAGING_MAX`]) and kept. Lock order: this before any
    /// arena's lock, and never two storages' staging at once.
    staging: parking_lot::Mutex<Option<PinnedHostSlice<u8>>>,
    /// Whether page-locked memory could not be had: passes then copy run
    /// by run from pageable memory.
    pageable: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for CudaPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPages")
            .field("device", &self.dev.name())
            .field("len", &self.len)
            .finish()
    }
}

impl CudaPages {
    /// Device memory for a pool of `cfg` (its geometry, page size and
    /// pages; see [`crate::kv::KvPool::with_device_pages`]). Out of device
    /// memory is an error, never a panic.
    pub fn for_pool(dev: &CudaDevice, cfg: &PoolConfig) -> Result<Self, CudaError> {
        let arena = DeviceKvArena::new(dev, cfg.geometry(), cfg.page_size(), cfg.pages())?;
        let len = arena.page_bytes() * arena.pages();
        Ok(CudaPages {
            dev: dev.clone(),
            arena: parking_lot::Mutex::new(arena),
            len,
            staging: parking_lot::Mutex::new(None),
            pageable: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The device the pages are on.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// The arena, for a launch (held for as long as the launch is
    /// enqueued).
    pub(super) fn arena(&self) -> parking_lot::MutexGuard<'_, DeviceKvArena> {
        self.arena.lock()
    }

    fn err(&self, what: String, e: impl std::fmt::Display) -> DeviceError {
        DeviceError {
            device: self.device_name(),
            what,
            reason: e.to_string(),
        }
    }

    /// The staging memory, at least `need` bytes (grown when smaller), or
    /// `None` when page-locked memory cannot be had (then never tried
    /// again for this storage).
    fn staging(&self, need: usize) -> Option<MappedMutexGuard<'_, PinnedHostSlice<u8>>> {
        use std::sync::atomic::Ordering;
        if self.pageable.load(Ordering::Relaxed) {
            return None;
        }
        let mut st = self.staging.lock();
        if st.as_ref().is_none_or(|b| b.len() < need) {
            // Dropped first: the old buffer's memory goes back before the
            // new one is taken.
            *st = None;
            match self
                .dev
                .pinned(need.next_power_of_two().min(STAGING_MAX).max(need))
            {
                Ok(b) => *st = Some(b),
                Err(_) => {
                    self.pageable.store(true, Ordering::Relaxed);
                    return None;
                }
            }
        }
        parking_lot::MutexGuard::try_map(st, Option::as_mut).ok()
    }

    /// The staging memory for a pass over `runs`, all checked in range
    /// first (an error names `access`): room for the whole pass up to
    /// [`STAGING_MAX`], and at least its longest run. `None` when there is
    /// nothing to copy or page-locked memory cannot be had: the caller then
    /// goes run by run, as the trait's default does.
    fn staging_for(
        &self,
        runs: &[(usize, usize)],
        access: &str,
    ) -> Result<Option<MappedMutexGuard<'_, PinnedHostSlice<u8>>>, DeviceError> {
        for &(at, n) in runs {
            self.range(at, n, access)?;
        }
        let total: usize = runs.iter().map(|r| r.1).sum();
        let longest = runs.iter().map(|r| r.1).max().unwrap_or(0);
        if total == 0 {
            return Ok(None);
        }
        Ok(self.staging(total.min(STAGING_MAX).max(longest)))
    }

    /// Splits `runs` into chunks of consecutive runs that fit `cap` bytes
    /// together (a run longer than `cap` alone: callers size `cap` to the
    /// longest run), as `(first, end, offsets)` with each run's offset in
    /// the staging memory.
    fn chunks(runs: &[(usize, usize)], cap: usize) -> Vec<(usize, usize, Vec<usize>)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < runs.len() {
            let (mut j, mut used, mut offs) = (i, 0usize, Vec::new());
            while j < runs.len() && (j == i || used + runs[j].1 <= cap) {
                offs.push(used);
                used += runs[j].1;
                j += 1;
            }
            out.push((i, j, offs));
            i = j;
        }
        out
    }

    /// `[at, at + n)`, or an error naming the access.
    fn range(
        &self,
        at: usize,
        n: usize,
        what: &str,
    ) -> Result<std::ops::Range<usize>, DeviceError> {
        at.checked_add(n)
            .filter(|&end| end <= self.len)
            .map(|end| at..end)
            .ok_or_else(|| self.err(format!("{what} of {n} bytes at {at}"), "out of range"))
    }
}

impl DevicePages for CudaPages {
    fn len(&self) -> usize {
        self.len
    }

    fn write(&self, at: usize, src: &[u8]) -> Result<(), DeviceError> {
        let r = self.range(at, src.len(), "write")?;
        if r.is_empty() {
            return Ok(());
        }
        let what = || format!("write of {} bytes at {at}", src.len());
        let mut arena = self.arena.lock();
        let mut dst = arena.data.slice_mut(r);
        self.dev
            .stream()
            .memcpy_htod(src, &mut dst)
            .map_err(|e| self.err(what(), e))?;
        // `src` is the caller's: the copy must have read it on return.
        self.dev.synchronize().map_err(|e| self.err(what(), e))
    }

    fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        let r = self.range(at, dst.len(), "read")?;
        if r.is_empty() {
            return Ok(());
        }
        let what = format!("read of {} bytes at {at}", dst.len());
        let arena = self.arena.lock();
        let src = arena.data.slice(r);
        self.dev
            .stream()
            .memcpy_dtoh(&src, dst)
            .map_err(|e| self.err(what.clone(), e))?;
        self.dev.synchronize().map_err(|e| self.err(what, e))
    }

    fn fill(&self, at: usize, len: usize, element: &[u8]) -> Result<(), DeviceError> {
        let r = self.range(at, len, "fill")?;
        let what = || format!("fill of {len} bytes at {at}");
        if element.is_empty() || !len.is_multiple_of(element.len()) {
            return Err(self.err(what(), "the length is not a whole number of elements"));
        }
        if r.is_empty() {
            return Ok(());
        }
        let mut arena = self.arena.lock();
        let stream = self.dev.stream();
        if element.iter().all(|&b| b == 0) {
            let mut dst = arena.data.slice_mut(r);
            stream
                .memset_zeros(&mut dst)
                .map_err(|e| self.err(what(), e))?;
        } else {
            // The pattern, a whole number of elements, uploaded a chunk at
            // a time.
            let chunk = (FILL_CHUNK / element.len()).max(1) * element.len();
            let pattern: Vec<u8> = element
                .iter()
                .copied()
                .cycle()
                .take(chunk.min(len))
                .collect();
            let mut off = r.start;
            while off < r.end {
                let n = pattern.len().min(r.end - off);
                let mut dst = arena.data.slice_mut(off..off + n);
                stream
                    .memcpy_htod(&pattern[..n], &mut dst)
                    .map_err(|e| self.err(what(), e))?;
                off += n;
            }
        }
        self.dev.synchronize().map_err(|e| self.err(what(), e))
    }

    fn write_runs(
        &self,
        runs: &[(usize, usize)],
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<(), DeviceError> {
        let what = || format!("write pass of {} runs", runs.len());
        let Some(mut staging) = self.staging_for(runs, "write")? else {
            return crate::kv::device::write_run_by_run(self, runs, fill);
        };
        let host = staging.as_mut_slice().map_err(|e| self.err(what(), e))?;
        for (first, end, offs) in Self::chunks(runs, host.len()) {
            // Filled without the arena's lock (a fill may read another
            // storage), then queued and waited for once.
            for (k, &o) in (first..end).zip(&offs) {
                fill(k, &mut host[o..o + runs[k].1]);
            }
            let mut arena = self.arena.lock();
            let stream = self.dev.stream();
            for (&(at, n), &o) in runs[first..end].iter().zip(&offs) {
                if n == 0 {
                    continue;
                }
                let mut dst = arena.data.slice_mut(at..at + n);
                stream
                    .memcpy_htod(&host[o..o + n], &mut dst)
                    .map_err(|e| self.err(what(), e))?;
            }
            // The staging memory is refilled next: the copies must have
            // read it.
            self.dev.synchronize().map_err(|e| self.err(what(), e))?;
        }
        Ok(())
    }

    fn read_runs(
        &self,
        runs: &[(usize, usize)],
        take: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), DeviceError> {
        let what = || format!("read pass of {} runs", runs.len());
        let Some(mut staging) = self.staging_for(runs, "read")? else {
            return crate::kv::device::read_run_by_run(self, runs, take);
        };
        let host = staging.as_mut_slice().map_err(|e| self.err(what(), e))?;
        for (first, end, offs) in Self::chunks(runs, host.len()) {
            {
                let arena = self.arena.lock();
                let stream = self.dev.stream();
                for (&(at, n), &o) in runs[first..end].iter().zip(&offs) {
                    if n == 0 {
                        continue;
                    }
                    let src = arena.data.slice(at..at + n);
                    stream
                        .memcpy_dtoh(&src, &mut host[o..o + n])
                        .map_err(|e| self.err(what(), e))?;
                }
                self.dev.synchronize().map_err(|e| self.err(what(), e))?;
            }
            for (k, &o) in (first..end).zip(&offs) {
                take(k, &host[o..o + runs[k].1]);
            }
        }
        Ok(())
    }

    fn xxh3_ranges(&self, ranges: &[(usize, usize)]) -> Option<Result<Vec<u64>, DeviceError>> {
        // One warp per range over the arena itself (the kernel proven equal
        // to the host's xxh3 in tests/cuda/xxh3_host.rs); the ranges are
        // checked against the arena before the launch.
        let what = || format!("hash of {} ranges", ranges.len());
        let arena = self.arena.lock();
        Some(
            self.dev
                .xxh3_64_ranges(&arena.data, ranges)
                .map_err(|e| self.err(what(), e)),
        )
    }

    fn copy_from(
        &self,
        src: &dyn DevicePages,
        runs: &[(usize, usize, usize)],
    ) -> Option<Result<(), DeviceError>> {
        // Another pool's CUDA pages: a copy on this device's stream (a peer
        // copy between two devices); anything else is staged by the pool.
        let from = src.as_any().downcast_ref::<CudaPages>()?;
        let what = || format!("device copy of {} runs", runs.len());
        let copy = || -> Result<(), DeviceError> {
            for &(s, d, n) in runs {
                from.range(s, n, "device copy from")?;
                self.range(d, n, "device copy to")?;
            }
            let stream = self.dev.stream();
            if std::ptr::eq(self, from) {
                // One arena: the pool never copies a sequence into itself
                // (the landing zone refuses it), but stay correct.
                let mut arena = self.arena.lock();
                for &(s, d, n) in runs {
                    if n == 0 {
                        continue;
                    }
                    let tmp = stream
                        .clone_dtod(&arena.data.slice(s..s + n))
                        .map_err(|e| self.err(what(), e))?;
                    let mut dst = arena.data.slice_mut(d..d + n);
                    stream
                        .memcpy_dtod(&tmp, &mut dst)
                        .map_err(|e| self.err(what(), e))?;
                }
                return self.dev.synchronize().map_err(|e| self.err(what(), e));
            }
            // Two arenas' locks, always taken in address order.
            let (mut to, at);
            if (self as *const Self) < (from as *const Self) {
                to = self.arena.lock();
                at = from.arena.lock();
            } else {
                at = from.arena.lock();
                to = self.arena.lock();
            }
            for &(s, d, n) in runs {
                if n == 0 {
                    continue;
                }
                let mut dst = to.data.slice_mut(d..d + n);
                stream
                    .memcpy_dtod(&at.data.slice(s..s + n), &mut dst)
                    .map_err(|e| self.err(what(), e))?;
            }
            self.dev.synchronize().map_err(|e| self.err(what(), e))?;
            if !from.dev.same(&self.dev) {
                from.dev.synchronize().map_err(|e| from.err(what(), e))?;
            }
            Ok(())
        };
        Some(copy())
    }

    fn device_name(&self) -> String {
        self.dev.name().to_string()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::CudaPages;

    #[test]
    fn a_pass_is_cut_into_chunks_of_whole_runs_that_fit_the_staging() {
        let runs = [(0, 4), (100, 4), (200, 2), (300, 9), (400, 0), (500, 1)];
        let chunks = CudaPages::chunks(&runs, 8);
        let got: Vec<_> = chunks.iter().map(|(a, b, o)| (*a, *b, o.clone())).collect();
        // 4 + 4 fill 8; 2 alone (9 would overflow); 9 is longer than the
        // staging and goes alone; the empty run and the last share a chunk.
        assert_eq!(
            got,
            vec![
                (0, 2, vec![0, 4]),
                (2, 3, vec![0]),
                (3, 4, vec![0]),
                (4, 6, vec![0, 0]),
            ]
        );
        assert!(CudaPages::chunks(&[], 8).is_empty());
        // Every run once, in order.
        let covered: Vec<usize> = chunks.iter().flat_map(|(a, b, _)| *a..*b).collect();
        assert_eq!(covered, (0..runs.len()).collect::<Vec<_>>());
    }
}
