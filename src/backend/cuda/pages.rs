//! [`CudaPages`]: a device-resident pool's page bytes in GPU memory
//! ([`crate::kv::DevicePages`]). The pool keeps every page's metadata on
//! the host and reaches these bytes only as staged copies of rows it owns
//! (appends, transfer landings), fills (scrubs) and hash passes (the
//! checksums of landed KV, computed on the device), each queued
//! on the device's one stream, so a kernel launched after a scrub reads
//! the scrubbed page, and each call waits for its copy to finish.

use super::{CudaDevice, CudaError, DeviceKvArena};
use crate::kv::{DeviceError, DevicePages, PoolConfig};

/// How many bytes of a fill pattern are uploaded at a time.
const FILL_CHUNK: usize = 1 << 20;

/// Page bytes in device memory, as a [`DeviceKvArena`] the backend's
/// kernels index through validated page tables.
pub struct CudaPages {
    dev: CudaDevice,
    /// The arena; the lock orders the pool's copies and the backend's
    /// launches on the host side (the stream orders them on the device).
    arena: parking_lot::Mutex<DeviceKvArena>,
    len: usize,
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
