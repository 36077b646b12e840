//! Page bytes that live outside host memory: the pool keeps every page's
//! metadata (owner, generation, written counts, reservations, the audit
//! trail) on the host, and a backend that computes elsewhere (a GPU) keeps
//! the bytes where it computes, behind [`DevicePages`].
//!
//! The pool reaches device bytes only through the same handles as host
//! bytes (a [`crate::kv::KvSeq`] names the pages it owns), so the ownership
//! argument of the storage module carries over unchanged: two accesses the
//! pool issues concurrently never overlap unless both are reads. Each access
//! is a staged copy (or a fill) of one run of rows; a backend's kernels
//! read and write the pages directly, from page tables built only from
//! validated views.

use crate::http::HttpStatus;

/// Where a pool's page bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residence {
    /// Host memory: views hand out the rows in place.
    Host,
    /// Device memory behind [`DevicePages`]: views give page tables and
    /// lengths, and rows reach the host only as staged copies
    /// ([`crate::kv::LayerView::copy_key_f32`]).
    Device,
}

/// A device access that failed. After one, the pool hands out no more
/// pages (a page whose scrub may not have happened must never be reused):
/// rebuild the pool, or the device, and retry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{device}: {what} failed: {reason}")]
pub struct DeviceError {
    /// The device, as its backend names it ("cuda:0").
    pub device: String,
    /// The access ("write 4096 bytes at 81920").
    pub what: String,
    /// What the device said.
    pub reason: String,
}

impl HttpStatus for DeviceError {
    fn http_status(&self) -> u16 {
        500
    }
}

/// A pool's page bytes in device memory, `len()` bytes laid out as the host
/// arena is (`[page][layer][k|v][slot][kv_dim]` elements of the pool's
/// dtype). The pool calls these only for byte ranges of pages that the
/// calling handle owns (or, for a fill, pages no handle can reach), so
/// concurrent calls never touch overlapping bytes unless all of them read.
///
/// Every call completes its access before it returns, as seen by later
/// calls and by the backend's kernels on the device (for CUDA: the copy is
/// ordered on the stream the kernels use, and a read waits for it): a page
/// is never handed out before its scrub has landed.
pub trait DevicePages: Send + Sync + 'static {
    /// Bytes of device memory behind this pool.
    fn len(&self) -> usize;
    /// True when [`DevicePages::len`] is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `src` to bytes `[at, at + src.len())`.
    fn write(&self, at: usize, src: &[u8]) -> Result<(), DeviceError>;
    /// Copies bytes `[at, at + dst.len())` into `dst`.
    fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), DeviceError>;
    /// Fills bytes `[at, at + len)` with `element` repeated (`len` is a
    /// multiple of its length): the scrub (zeros) or the poison (NaN).
    fn fill(&self, at: usize, len: usize, element: &[u8]) -> Result<(), DeviceError>;
    /// Writes byte runs `(at, len)` as one pass: `fill(run, dst)` gives run
    /// `run`'s bytes (once per run, in order), written straight into the
    /// memory the copy reads, and the pass waits for the device once, not
    /// once per run. A transfer lands a batch of K and V rows this way: one
    /// run per page it touches. For CUDA the staging memory is page-locked,
    /// so the copies are DMA that queue without waiting. The default stages
    /// each run in a host buffer and writes it with [`DevicePages::write`].
    /// After an error any subset of the runs may have been written (the
    /// pool then fails closed, as for any device error).
    fn write_runs(
        &self,
        runs: &[(usize, usize)],
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<(), DeviceError> {
        write_run_by_run(self, runs, fill)
    }
    /// Reads byte runs `(at, len)` as one pass and hands each run's bytes
    /// to `take(run, bytes)`, in order, once the pass has landed on the host
    /// (a transfer's sender reads a batch of rows this way). The default
    /// reads run by run with [`DevicePages::read`].
    fn read_runs(
        &self,
        runs: &[(usize, usize)],
        take: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), DeviceError> {
        read_run_by_run(self, runs, take)
    }
    /// xxh3-64 (seed 0) of each `(at, len)` byte range, computed where the
    /// bytes are, in one pass: the transfer verifier's checksums over the
    /// KV that landed, without copying it back. `None` when this storage
    /// cannot hash (the default): the pool then reads each landed run of
    /// rows back and hashes it on the host.
    fn xxh3_ranges(&self, ranges: &[(usize, usize)]) -> Option<Result<Vec<u64>, DeviceError>> {
        let _ = ranges;
        None
    }
    /// Copies byte runs `(src_at, at, len)` of `src`'s bytes into this
    /// storage's, device to device, in one pass (an in-process transfer
    /// between two device-resident pools). `None` (the default) when this
    /// storage cannot reach `src`'s memory: the pool then stages the rows
    /// through the host. An error fails both pools closed, since either
    /// device may be the one that failed.
    fn copy_from(
        &self,
        src: &dyn DevicePages,
        runs: &[(usize, usize, usize)],
    ) -> Option<Result<(), DeviceError>> {
        let _ = (src, runs);
        None
    }
    /// The device's name in errors ("cuda:0").
    fn device_name(&self) -> String;
    /// The storage itself, so that the backend that made it can reach its
    /// device memory for kernels (by downcasting to its own type).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// [`DevicePages::write_runs`] as a storage without staging memory does it:
/// each run staged in a host buffer and written with [`DevicePages::write`].
pub(crate) fn write_run_by_run<D: DevicePages + ?Sized>(
    dev: &D,
    runs: &[(usize, usize)],
    fill: &mut dyn FnMut(usize, &mut [u8]),
) -> Result<(), DeviceError> {
    let mut scratch = Vec::new();
    for (i, &(at, len)) in runs.iter().enumerate() {
        scratch.clear();
        scratch.resize(len, 0);
        fill(i, &mut scratch);
        dev.write(at, &scratch)?;
    }
    Ok(())
}

/// [`DevicePages::read_runs`] run by run with [`DevicePages::read`].
pub(crate) fn read_run_by_run<D: DevicePages + ?Sized>(
    dev: &D,
    runs: &[(usize, usize)],
    take: &mut dyn FnMut(usize, &[u8]),
) -> Result<(), DeviceError> {
    let mut scratch = Vec::new();
    for (i, &(at, len)) in runs.iter().enumerate() {
        scratch.clear();
        scratch.resize(len, 0);
        dev.read(at, &mut scratch)?;
        take(i, &scratch);
    }
    Ok(())
}

/// [`DevicePages`] kept in host memory behind a lock, each access a copy:
/// a pool with this storage behaves as a device-resident pool does (no row
/// is ever borrowed in place), so every test of the pool's rules runs
/// against the staged path on a machine without a GPU. Not for serving.
pub struct StagedHostPages {
    bytes: parking_lot::Mutex<Box<[u8]>>,
    /// Accesses after which every further one fails (fault injection: a
    /// device that dies mid-run); `usize::MAX` for never.
    fail_after: std::sync::atomic::AtomicUsize,
    /// Whether [`DevicePages::xxh3_ranges`] hashes (as a GPU's kernel
    /// does) or answers `None` (a device that cannot hash).
    hashes: bool,
    /// Runs read and written (one per `read`/`write`, one per run of a
    /// pass), passes that read or wrote them (one per call), hash passes
    /// and device-to-device copy passes so far.
    reads: std::sync::atomic::AtomicUsize,
    writes: std::sync::atomic::AtomicUsize,
    read_passes: std::sync::atomic::AtomicUsize,
    write_passes: std::sync::atomic::AtomicUsize,
    hash_passes: std::sync::atomic::AtomicUsize,
    copy_passes: std::sync::atomic::AtomicUsize,
}

impl StagedHostPages {
    /// `len` bytes, filled with a non-zero pattern (fresh device memory is
    /// not zeroed: the pool must scrub it before it hands a page out).
    /// It hashes ranges where they are, as a GPU does (see
    /// [`StagedHostPages::without_hashing`]).
    pub fn new(len: usize) -> Self {
        StagedHostPages {
            bytes: parking_lot::Mutex::new(vec![0xA5; len].into_boxed_slice()),
            fail_after: std::sync::atomic::AtomicUsize::new(usize::MAX),
            hashes: true,
            reads: std::sync::atomic::AtomicUsize::new(0),
            writes: std::sync::atomic::AtomicUsize::new(0),
            read_passes: std::sync::atomic::AtomicUsize::new(0),
            write_passes: std::sync::atomic::AtomicUsize::new(0),
            hash_passes: std::sync::atomic::AtomicUsize::new(0),
            copy_passes: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// A device that cannot hash: [`DevicePages::xxh3_ranges`] answers
    /// `None`, so the pool reads landed rows back to hash them.
    #[must_use]
    pub fn without_hashing(mut self) -> Self {
        self.hashes = false;
        self
    }

    /// Runs of bytes read (copied back to the host) so far.
    pub fn reads(&self) -> usize {
        self.reads.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Times the host waited for reads so far: one per
    /// [`DevicePages::read`], one per [`DevicePages::read_runs`] pass.
    pub fn read_passes(&self) -> usize {
        self.read_passes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Times the host waited for writes so far: one per
    /// [`DevicePages::write`], one per [`DevicePages::write_runs`] pass.
    pub fn write_passes(&self) -> usize {
        self.write_passes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Passes of [`DevicePages::xxh3_ranges`] that hashed, so far.
    pub fn hash_passes(&self) -> usize {
        self.hash_passes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Runs of bytes written (copied from the host) so far.
    pub fn writes(&self) -> usize {
        self.writes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Passes of [`DevicePages::copy_from`] into this storage, so far.
    pub fn copy_passes(&self) -> usize {
        self.copy_passes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Makes every access after the next `n` fail, as a device that is
    /// lost would.
    pub fn fail_after(&self, n: usize) {
        self.fail_after
            .store(n, std::sync::atomic::Ordering::SeqCst);
    }

    fn access(&self, what: impl FnOnce() -> String) -> Result<(), DeviceError> {
        use std::sync::atomic::Ordering;
        let left = self
            .fail_after
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(if n == usize::MAX {
                    n
                } else {
                    n.saturating_sub(1)
                })
            })
            .unwrap_or(0);
        if left == 0 {
            return Err(DeviceError {
                device: self.device_name(),
                what: what(),
                reason: "device lost (injected)".into(),
            });
        }
        Ok(())
    }

    fn out_of_range(&self, what: String) -> DeviceError {
        DeviceError {
            device: self.device_name(),
            what,
            reason: "out of range".into(),
        }
    }
}

impl DevicePages for StagedHostPages {
    fn len(&self) -> usize {
        self.bytes.lock().len()
    }

    fn write(&self, at: usize, src: &[u8]) -> Result<(), DeviceError> {
        let what = || format!("write of {} bytes at {at}", src.len());
        self.access(what)?;
        self.writes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.write_passes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut b = self.bytes.lock();
        let dst = at
            .checked_add(src.len())
            .and_then(|end| b.get_mut(at..end))
            .ok_or_else(|| self.out_of_range(what()))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        let what = || format!("read of {} bytes at {at}", dst.len());
        self.access(what)?;
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.read_passes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let b = self.bytes.lock();
        let src = at
            .checked_add(dst.len())
            .and_then(|end| b.get(at..end))
            .ok_or_else(|| self.out_of_range(what()))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn fill(&self, at: usize, len: usize, element: &[u8]) -> Result<(), DeviceError> {
        let what = || format!("fill of {len} bytes at {at}");
        self.access(what)?;
        let mut b = self.bytes.lock();
        let dst = at
            .checked_add(len)
            .and_then(|end| b.get_mut(at..end))
            .filter(|_| !element.is_empty() && len.is_multiple_of(element.len()))
            .ok_or_else(|| self.out_of_range(what()))?;
        for d in dst.chunks_exact_mut(element.len()) {
            d.copy_from_slice(element);
        }
        Ok(())
    }

    fn write_runs(
        &self,
        runs: &[(usize, usize)],
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<(), DeviceError> {
        // One access for the pass (a device lost mid-pass fails it whole),
        // every run checked before any is written.
        // Each run staged first, as for a device, so that `fill` never runs
        // under the lock.
        let what = || format!("write pass of {} runs", runs.len());
        self.access(what)?;
        let size = self.len();
        for &(at, len) in runs {
            if at.checked_add(len).is_none_or(|end| end > size) {
                return Err(self.out_of_range(format!("write of {len} bytes at {at}")));
            }
        }
        let staged: Vec<Vec<u8>> = runs
            .iter()
            .enumerate()
            .map(|(i, &(_, len))| {
                let mut v = vec![0u8; len];
                fill(i, &mut v);
                v
            })
            .collect();
        use std::sync::atomic::Ordering;
        self.write_passes.fetch_add(1, Ordering::SeqCst);
        self.writes.fetch_add(runs.len(), Ordering::SeqCst);
        let mut b = self.bytes.lock();
        for (&(at, len), v) in runs.iter().zip(&staged) {
            b[at..at + len].copy_from_slice(v);
        }
        Ok(())
    }

    fn read_runs(
        &self,
        runs: &[(usize, usize)],
        take: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), DeviceError> {
        let what = || format!("read pass of {} runs", runs.len());
        self.access(what)?;
        // Copied out first, as from a device, so that `take` never runs
        // under the lock.
        let staged: Vec<Vec<u8>> = {
            let b = self.bytes.lock();
            runs.iter()
                .map(|&(at, len)| {
                    at.checked_add(len)
                        .and_then(|end| b.get(at..end))
                        .map(<[u8]>::to_vec)
                        .ok_or_else(|| self.out_of_range(format!("read of {len} bytes at {at}")))
                })
                .collect::<Result<_, _>>()?
        };
        use std::sync::atomic::Ordering;
        self.read_passes.fetch_add(1, Ordering::SeqCst);
        self.reads.fetch_add(runs.len(), Ordering::SeqCst);
        for (i, bytes) in staged.iter().enumerate() {
            take(i, bytes);
        }
        Ok(())
    }

    fn xxh3_ranges(&self, ranges: &[(usize, usize)]) -> Option<Result<Vec<u64>, DeviceError>> {
        if !self.hashes {
            return None;
        }
        if ranges.is_empty() {
            // The pool's probe of what this storage can do: no access.
            return Some(Ok(Vec::new()));
        }
        let what = || format!("hash of {} ranges", ranges.len());
        Some(self.access(what).and_then(|()| {
            self.hash_passes
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let b = self.bytes.lock();
            ranges
                .iter()
                .map(|&(at, len)| {
                    at.checked_add(len)
                        .and_then(|end| b.get(at..end))
                        .map(twox_hash::XxHash3_64::oneshot)
                        .ok_or_else(|| self.out_of_range(format!("hash of {len} bytes at {at}")))
                })
                .collect()
        }))
    }

    fn copy_from(
        &self,
        src: &dyn DevicePages,
        runs: &[(usize, usize, usize)],
    ) -> Option<Result<(), DeviceError>> {
        // Another staged storage is "the same device": its bytes are
        // reachable. Anything else is not.
        let from = src.as_any().downcast_ref::<StagedHostPages>()?;
        let what = || format!("device copy of {} runs", runs.len());
        let ok = self.access(what).and_then(|()| from.access(what));
        Some(ok.and_then(|()| {
            self.copy_passes
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let bad = |(s, d, n): (usize, usize, usize)| {
                self.out_of_range(format!("device copy of {n} bytes from {s} to {d}"))
            };
            if std::ptr::eq(self, from) {
                let mut b = self.bytes.lock();
                for &(s, d, n) in runs {
                    let fits = |at: usize| at.checked_add(n).is_some_and(|end| end <= b.len());
                    if !fits(s) || !fits(d) {
                        return Err(bad((s, d, n)));
                    }
                    b.copy_within(s..s + n, d);
                }
                return Ok(());
            }
            // Two locks, always taken in address order.
            let (mut dst, src_bytes);
            if (self as *const Self) < (from as *const Self) {
                dst = self.bytes.lock();
                src_bytes = from.bytes.lock();
            } else {
                src_bytes = from.bytes.lock();
                dst = self.bytes.lock();
            }
            for &(s, d, n) in runs {
                let from_run = s.checked_add(n).and_then(|end| src_bytes.get(s..end));
                let to_run = d.checked_add(n).and_then(|end| dst.get_mut(d..end));
                match (from_run, to_run) {
                    (Some(f), Some(t)) => t.copy_from_slice(f),
                    _ => return Err(bad((s, d, n))),
                }
            }
            Ok(())
        }))
    }

    fn device_name(&self) -> String {
        "staged-host".into()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_pages_copy_fill_and_refuse_out_of_range() {
        let d = StagedHostPages::new(16);
        let mut out = [0u8; 4];
        d.read(0, &mut out).unwrap();
        assert_eq!(out, [0xA5; 4], "fresh memory is not zeroed");
        d.fill(0, 16, &[0, 0, 0xC0, 0x7F]).unwrap();
        d.write(4, &[1, 2, 3, 4]).unwrap();
        d.read(2, &mut out).unwrap();
        assert_eq!(out, [0xC0, 0x7F, 1, 2]);
        assert!(d.read(14, &mut out).is_err());
        assert!(d.write(usize::MAX, &[1]).is_err());
        assert!(d.fill(0, 3, &[0, 0]).is_err());
        d.fail_after(1);
        assert!(d.read(0, &mut out).is_ok());
        let e = d.read(0, &mut out).unwrap_err();
        assert!(e.to_string().contains("device lost"), "{e}");
    }
}
