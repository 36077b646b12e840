//! The device: context, stream, and the kernels loaded from the fatbins
//! that build.rs embedded.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    PinnedHostSlice, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::CudaError;
use super::graph::{Graphs, Recorder};
use super::kernels::KernelId;
use super::ops;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// One CUDA device with its kernels loaded. Cheap to clone (shared).
///
/// Every operation is queued on one stream, in call order; results are
/// visible to the host after [`CudaDevice::download`] or
/// [`CudaDevice::synchronize`].
#[derive(Clone)]
pub struct CudaDevice {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    /// Graphs captured, and the lists seen lately. First, so dropped first:
    /// its graphs launch the kernels below, on the context `stream` holds.
    pub(super) graphs: parking_lot::Mutex<Graphs>,
    pub(super) stream: Arc<CudaStream>,
    /// Every kernel of the table, at `KernelId::index`; `None` for one that
    /// needs more shared memory per block than this device has (the wide
    /// decode kernel below compute capability 9.0).
    kernels: Vec<Option<CudaFunction>>,
    /// Dynamic shared memory a block may opt into on this device, in bytes.
    max_smem: u32,
    pub(super) sm_count: u32,
    /// Whether kernels that start with `pdl_wait()` may be queued with
    /// programmatic stream serialization: compute capability 9.0 or newer
    /// (older devices run sm_80 code, where the wait is compiled out), until
    /// the driver refuses it.
    pub(super) overlap_ok: std::sync::atomic::AtomicBool,
    /// The host's choice ([`CudaDevice::set_launch_overlap`]), on by default.
    overlap_on: std::sync::atomic::AtomicBool,
    name: String,
    /// Times the host waited for the device (downloads and syncs).
    syncs: std::sync::atomic::AtomicU64,
    /// Kernels queued.
    pub(super) launches: std::sync::atomic::AtomicU64,
    /// The host's choice ([`CudaDevice::set_graphs`]), off by default.
    pub(super) graphs_on: std::sync::atomic::AtomicBool,
    /// Which thread's pass records, and what (see `graph.rs`).
    pub(super) recorder: Recorder,
    /// A flush that failed with nobody to tell (a pass unwinding): the
    /// next download or sync reports it.
    pub(super) flush_error: parking_lot::Mutex<Option<CudaError>>,
    /// Recorded lists launched as one graph, and graphs captured.
    pub(super) graph_launches: std::sync::atomic::AtomicU64,
    pub(super) graph_captures: std::sync::atomic::AtomicU64,
}

/// An open pass's recording ([`CudaDevice::begin_pass`]): flushed and
/// closed on drop, so nothing recorded outlives the pass.
#[must_use]
pub(super) struct PassGuard<'a> {
    dev: Option<&'a CudaDevice>,
}

impl Drop for PassGuard<'_> {
    fn drop(&mut self) {
        let Some(dev) = self.dev else {
            return;
        };
        // A pass that ended in a download has flushed already; one that
        // failed on the way may leave launches here.
        dev.flush_or_keep_error();
        dev.inner.recorder.close(std::thread::current().id());
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.inner.name)
            .field("sm_count", &self.inner.sm_count)
            .field("kernels", &self.inner.kernels.len())
            .finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal` and loads every kernel. Fails with
    /// [`CudaError::NoDriver`] where libcuda is absent (checked first:
    /// creating a context without it would panic), [`CudaError::NoDevice`]
    /// where the ordinal does not exist, and [`CudaError::MissingKernel`]
    /// where the fatbin lacks a kernel of the kernel table.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        if !ops::driver_present() {
            return Err(CudaError::NoDriver);
        }
        cudarc::driver::result::init().map_err(CudaError::driver("initialising the driver"))?;
        let count = cudarc::driver::result::device::get_count()
            .map_err(CudaError::driver("counting devices"))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("creating a context"))?;
        let name = ctx
            .name()
            .map_err(CudaError::driver("reading the device name"))?;
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(CudaError::driver("reading the SM count"))?;
        let (major, _) = ctx
            .compute_capability()
            .map_err(CudaError::driver("reading the compute capability"))?;
        let max_smem = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(CudaError::driver("reading the shared memory per block"))?;
        let max_smem = u32::try_from(max_smem).unwrap_or(0);
        let mut modules = Vec::new();
        for (stem, image) in embedded::FATBINS {
            // from_binary takes cubin/fatbin bytes (not PTX text) by value.
            let module = ctx
                .load_module(Ptx::from_binary(image.to_vec()))
                .map_err(|e| CudaError::Driver {
                    during: "loading a kernel module",
                    detail: format!("cuda/{stem}.cu: {e}"),
                })?;
            modules.push(module);
        }
        let mut kernels = Vec::with_capacity(KernelId::ALL.len());
        for id in KernelId::ALL {
            let spec = id.spec();
            let func = modules
                .iter()
                .find_map(|m| m.load_function(spec.symbol).ok())
                .ok_or_else(|| CudaError::MissingKernel {
                    name: spec.symbol.to_string(),
                })?;
            if spec.dynamic_smem > max_smem {
                kernels.push(None); // refused at launch, with the reason
                continue;
            }
            if spec.dynamic_smem > 48 * 1024 {
                func.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    spec.dynamic_smem as i32,
                )
                .map_err(CudaError::driver("raising a kernel's shared memory limit"))?;
            }
            kernels.push(Some(func));
        }
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                graphs: parking_lot::Mutex::new(Graphs::default()),
                stream: ctx.default_stream(),
                kernels,
                max_smem,
                sm_count: sm_count.max(1) as u32,
                overlap_ok: std::sync::atomic::AtomicBool::new(major >= 9),
                overlap_on: std::sync::atomic::AtomicBool::new(true),
                name,
                syncs: std::sync::atomic::AtomicU64::new(0),
                launches: std::sync::atomic::AtomicU64::new(0),
                graphs_on: std::sync::atomic::AtomicBool::new(false),
                recorder: Recorder::default(),
                flush_error: parking_lot::Mutex::new(None),
                graph_launches: std::sync::atomic::AtomicU64::new(0),
                graph_captures: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }

    /// Whether passes run as CUDA graphs (default: off). On, the launches of
    /// a pass (`CudaBackend`'s `run_pass`, which opens it) are recorded and,
    /// at its flush, launched as one graph when an equal list was captured
    /// before, or queued one by one (and captured once seen twice) when
    /// not. A replay is the same launches with the same bytes, so results
    /// are those of graphs off bit for bit; see `graph.rs` for the rules
    /// that keep the recorded launches' memory alive and in order. Where
    /// the driver refuses a capture or a graph launch, graphs stay off.
    pub fn set_graphs(&self, on: bool) {
        self.inner
            .graphs_on
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether passes run as CUDA graphs ([`CudaDevice::set_graphs`]): off
    /// once the driver refused one.
    pub fn graphs(&self) -> bool {
        self.inner
            .graphs_on
            .load(std::sync::atomic::Ordering::Relaxed)
            && !self.inner.graphs.lock().broken
    }

    /// Recorded lists launched as one graph so far, and graphs captured
    /// (a decode loop at a steady batch captures a few, then replays).
    pub fn graph_counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.inner.graph_launches.load(Relaxed),
            self.inner.graph_captures.load(Relaxed),
        )
    }

    /// Opens a pass on this thread: with graphs on and no other pass open,
    /// its launches are recorded until the returned guard flushes them
    /// (dropped: at the end of the pass). Otherwise launches are queued at
    /// once, as always.
    pub(super) fn begin_pass(&self) -> PassGuard<'_> {
        let on = self
            .inner
            .graphs_on
            .load(std::sync::atomic::Ordering::Relaxed);
        let open = on && self.inner.recorder.open(std::thread::current().id());
        PassGuard {
            dev: open.then_some(self),
        }
    }

    /// Records the launch `op()` when this thread's pass is recording
    /// (true); false: nothing recorded, queue it now.
    pub(super) fn record(&self, op: impl FnOnce() -> super::graph::Op) -> bool {
        self.inner.recorder.record(std::thread::current().id(), op)
    }

    /// Keeps `x` (memory a recorded launch may use) until the open pass's
    /// next flush has queued its launches (whichever thread retires it: a
    /// buffer shared through a backend's memo may be another thread's);
    /// drops it now when nothing is recorded.
    pub(super) fn retire<T: Send + 'static>(&self, x: T) {
        self.inner.recorder.retire(Box::new(x));
    }

    /// Queues what this thread's pass has recorded (as one graph where one
    /// was captured from an equal list), then frees what was kept for it.
    pub(super) fn flush(&self) -> Result<(), CudaError> {
        let Some(flushed) = self.inner.recorder.take(std::thread::current().id()) else {
            return Ok(());
        };
        let queued = self.run_recorded(flushed.ops);
        // Only now may a memo refill what those launches read: the copy is
        // queued after them.
        self.inner.recorder.flushed();
        // Freed on the stream after the launches that used it.
        drop(flushed.keep);
        queued
    }

    /// [`CudaDevice::flush`] where no caller can take its error: kept for
    /// the next download or sync.
    fn flush_or_keep_error(&self) {
        if let Err(e) = self.flush() {
            self.inner.flush_error.lock().get_or_insert(e);
        }
    }

    fn take_flush_error(&self) -> Result<(), CudaError> {
        match self.inner.flush_error.lock().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// True when both handles are the same opened device (one context and
    /// stream): memory of one is only for the other's kernels then.
    pub fn same(&self, other: &CudaDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Free and total device memory in bytes, now: what a device-resident
    /// pool's budget is planned from (free memory after the weights and
    /// workspaces are placed, less a margin the host chooses; see
    /// [`crate::EngineConfigBuilder::pool_memory`]).
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.inner
            .stream
            .context()
            .mem_get_info()
            .map_err(CudaError::driver("asking the device for its free memory"))
    }

    /// Streaming multiprocessors (used to size split-KV decode).
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// Whether a kernel that only depends on the launch before it (the
    /// split-KV merge) may be scheduled while that launch finishes
    /// (programmatic dependent launch: on by default from compute
    /// capability 9.0; its first instruction waits until the launch before
    /// it has completed and its writes are visible, so results do not
    /// change). Off, every launch waits for the one before it to end.
    pub fn set_launch_overlap(&self, on: bool) {
        self.inner
            .overlap_on
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether launches overlap (see [`CudaDevice::set_launch_overlap`]):
    /// never before compute capability 9.0 or after the driver refused it.
    pub fn launch_overlap(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.inner.overlap_on.load(Relaxed) && self.inner.overlap_ok.load(Relaxed)
    }

    /// Number of kernels loaded.
    pub fn kernel_count(&self) -> usize {
        self.inner.kernels.len()
    }

    /// Dynamic shared memory a block may opt into on this device, in bytes:
    /// a kernel that needs more is refused at launch
    /// ([`CudaError::Unsupported`]).
    pub fn max_shared_memory_per_block(&self) -> usize {
        self.inner.max_smem as usize
    }

    /// The stream every operation is queued on (for timing with events).
    /// Launches this thread's open pass has recorded are queued first (see
    /// [`CudaDevice::set_graphs`]), so that what is queued on it directly
    /// comes after them.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.flush_or_keep_error();
        &self.inner.stream
    }

    /// Copies `host` into a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.inner
            .stream
            .clone_htod(host)
            .map_err(CudaError::driver("copying to the device"))
    }

    /// Copies `host` into `dst`, which must have the same length.
    pub fn write<T: DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        if host.len() != dst.len() {
            return Err(CudaError::Shape {
                what: "host data for a device buffer",
                expected: dst.len(),
                got: host.len(),
            });
        }
        // A recorded launch may read `dst`: it goes first.
        self.flush()?;
        self.inner
            .stream
            .memcpy_htod(host, dst)
            .map_err(CudaError::driver("copying to the device"))
    }

    /// `len` zeroed bytes of page-locked host memory: a copy between it
    /// and the device is DMA that queues without waiting, so a staged pass
    /// of many copies waits for the device once.
    pub(super) fn pinned(&self, len: usize) -> Result<PinnedHostSlice<u8>, CudaError> {
        let what = "allocating page-locked host memory";
        // SAFETY: the allocation's bytes are unset; they are zeroed below
        // before anything reads them. Flags 0: cached (the host reads it
        // back), not write-combined.
        let mut buf = unsafe {
            self.inner
                .stream
                .context()
                .alloc_pinned_with_flags::<u8>(len, 0)
        }
        .map_err(CudaError::driver(what))?;
        let ptr = buf.as_mut_ptr().map_err(CudaError::driver(what))?;
        // SAFETY: `ptr` is the start of this allocation of `len` bytes, which
        // nothing else references yet.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(buf)
    }

    /// A new zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.inner
            .stream
            .alloc_zeros(len)
            .map_err(CudaError::driver("allocating device memory"))
    }

    /// Copies `host` to the start of `dst` without flushing: for memory no
    /// launch still to be recorded-and-queued reads (a memo's refill; see
    /// `memo.rs`). Stream-ordered after every launch already queued.
    pub(super) fn overwrite<T: DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), CudaError> {
        if host.len() > dst.len() {
            return Err(CudaError::Shape {
                what: "host data for a device buffer (at most its length)",
                expected: dst.len(),
                got: host.len(),
            });
        }
        if host.is_empty() {
            return Ok(());
        }
        self.inner
            .stream
            .memcpy_htod(host, dst)
            .map_err(CudaError::driver("copying to the device"))
    }

    /// Now, for a memo (see `memo.rs`): the flush count and whether a pass
    /// records (on any thread: a memo may be shared by threads).
    pub(super) fn moment(&self) -> super::memo::Moment {
        self.inner.recorder.moment()
    }

    /// Copies a device buffer or view to the host (waits for queued work).
    pub fn download<T: DeviceRepr>(&self, src: &impl DevicePtr<T>) -> Result<Vec<T>, CudaError> {
        self.flush()?;
        self.take_flush_error()?;
        self.count_sync();
        self.inner
            .stream
            .clone_dtoh(src)
            .map_err(CudaError::driver("copying from the device"))
    }

    /// Times the host has waited for this device so far (every download
    /// and sync through this handle and its clones): a decode step that
    /// samples on the device waits once.
    pub fn host_syncs(&self) -> u64 {
        self.inner.syncs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Kernels queued on this device so far (through this handle and its
    /// clones): what a decode step costs the host in launches.
    pub fn launches(&self) -> u64 {
        self.inner
            .launches
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(super) fn count_sync(&self) {
        self.inner
            .syncs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Waits for every queued operation; reports a failed kernel.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.flush()?;
        self.take_flush_error()?;
        self.count_sync();
        self.inner
            .stream
            .synchronize()
            .map_err(CudaError::driver("waiting for the device"))?;
        self.inner
            .stream
            .context()
            .check_err()
            .map_err(CudaError::driver("a deferred device operation"))
    }

    /// The loaded kernel `id` (every one is loaded by `open`), or
    /// [`CudaError::Unsupported`] for one that needs more shared memory per
    /// block than this device has.
    pub(super) fn function(&self, id: KernelId) -> Result<&CudaFunction, CudaError> {
        let spec = id.spec();
        match self.inner.kernels.get(id.index()) {
            Some(Some(f)) => Ok(f),
            Some(None) => Err(CudaError::Unsupported {
                what: "a kernel's shared memory on this device",
                detail: format!(
                    "{} needs {} bytes per block, {} allows {}",
                    spec.symbol, spec.dynamic_smem, self.inner.name, self.inner.max_smem
                ),
            }),
            None => Err(CudaError::MissingKernel {
                name: spec.symbol.to_string(),
            }),
        }
    }
}
