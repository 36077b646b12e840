//! The crate's one kernel launch ([`CudaDevice::launch`]): queued on the
//! device's stream now, or recorded for the pass's flush, which replays an
//! equal list as the CUDA graph captured from it.

use cudarc::driver::DeviceRepr;

use super::{Args, MAX_ARGS};
use crate::backend::cuda::graph;
use crate::backend::cuda::kernels::{Kernel, KernelId};
use crate::backend::cuda::plan::Grid;
use crate::backend::cuda::{CudaDevice, CudaError};

impl CudaDevice {
    /// Queues `kernel` over `grid` blocks on the device's stream, with the
    /// block size and dynamic shared memory the table gives it; `args` are
    /// the guards of the buffers whose addresses `params` holds, released
    /// once the launch is queued. The crate's one kernel launch.
    pub(super) fn launch<P: DeviceRepr + bytemuck::NoUninit>(
        &self,
        kernel: Kernel<P>,
        params: &P,
        grid: Grid,
        args: Args<'_>,
    ) -> Result<(), CudaError> {
        self.launch_with(kernel, params, grid, args, false)
    }

    /// [`CudaDevice::launch`], or with `overlap` for a kernel whose first
    /// instruction is `pdl_wait()` (cuda/common.cuh) and that reads nothing
    /// but what the launch before it on the stream wrote or what was there
    /// before it: queued with programmatic stream serialization, its blocks
    /// may be scheduled once every block of the launch before it has
    /// started (the decode kernels signal at their start), and wait there
    /// until that launch has completed and its writes are visible. Ask for
    /// it only where [`CudaDevice::launch_overlap`] says so; where the
    /// driver refuses the attribute, the kernel is launched as usual and
    /// overlap stays off.
    pub(super) fn launch_with<P: DeviceRepr + bytemuck::NoUninit>(
        &self,
        kernel: Kernel<P>,
        params: &P,
        grid: Grid,
        args: Args<'_>,
        overlap: bool,
    ) -> Result<(), CudaError> {
        if args.bound > MAX_ARGS {
            return Err(CudaError::Unsupported {
                what: "buffers bound to one launch",
                detail: format!("{} (at most {MAX_ARGS})", args.bound),
            });
        }
        // Refused now (not at the flush) when this device cannot run it.
        self.function(kernel.id())?;
        self.inner
            .launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY (the launch here, or the recorded one at the flush):
        // `Kernel<P>` exists only for a compiled kernel whose parameter is
        // `P` (the table pairs them; the layout of `P` is asserted against
        // cuda/params.cuh on both sides), launched with the block size its
        // code assumes and the dynamic shared memory it was allowed at
        // load. Every caller fills `params` only from buffers it bound in
        // `args` after checking their lengths, and their indices and sizes
        // against the shapes the kernel reads (its "Launch contract"
        // comment), with `grid` the blocks the kernel indexes; the guards in
        // `args` live until the launch is queued, and a recorded launch's
        // buffers until its flush (`CudaDevice::retire`).
        let recorded =
            self.record(|| graph::Op::new(kernel.id(), grid, overlap, bytemuck::bytes_of(params)));
        let queued = if recorded {
            Ok(())
        } else {
            let params = params as *const P as *mut std::ffi::c_void;
            self.enqueue(kernel.id(), grid, params, overlap)
        };
        drop(args);
        queued
    }

    /// Queues `kernel` on the device's stream with the params struct at
    /// `params`; with `overlap`, with programmatic stream serialization,
    /// falling back to a plain launch (and overlap off from then on) where
    /// the driver refuses it.
    fn enqueue(
        &self,
        kernel: KernelId,
        grid: Grid,
        params: *mut std::ffi::c_void,
        overlap: bool,
    ) -> Result<(), CudaError> {
        let stream = self.inner.stream.cu_stream();
        if overlap {
            if self.enqueue_on(stream, kernel, grid, params, true).is_ok() {
                return Ok(());
            }
            // Refused (nothing was queued): launch as usual from now on.
            self.inner
                .overlap_ok
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
        self.enqueue_on(stream, kernel, grid, params, false)
    }

    /// The crate's one kernel launch: `kernel` over `grid` blocks on
    /// `stream` (the device's, or the capture stream), with the block size
    /// and dynamic shared memory the table gives it and the params struct
    /// at `params`. With `overlap` it is queued with programmatic stream
    /// serialization: its blocks may be scheduled once every block of the
    /// launch before it has started, and wait (its first instruction is
    /// `pdl_wait()`) until that launch has completed and its writes are
    /// visible. Callers ask for it only where
    /// [`CudaDevice::launch_overlap`] says so.
    fn enqueue_on(
        &self,
        stream: cudarc::driver::sys::CUstream,
        kernel: KernelId,
        grid: Grid,
        params: *mut std::ffi::c_void,
        overlap: bool,
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        let spec = kernel.spec();
        let func = self.function(kernel)?;
        self.inner
            .stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver(spec.during))?;
        // SAFETY: CUlaunchAttribute is a plain C struct (an id and a union
        // of plain values); all zeros is a valid value of it.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: spec.threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: spec.dynamic_smem,
            hStream: stream,
            attrs: if overlap {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: u32::from(overlap),
        };
        // The kernel's one parameter, by address (as cuLaunchKernel takes
        // it).
        let mut arg = [params];
        // SAFETY: the caller's (`launch_with`'s contract, or a recorded
        // launch's, made under it); `cfg`, `attr` and `arg` outlive the
        // call, which copies them. The overlap cannot expose a partial
        // write: it is asked for only for a kernel that waits
        // (griddepcontrol.wait, compiled for every device where overlap is
        // on) before its first read.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                func.cu_function(),
                arg.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(CudaError::driver(spec.during))
    }

    /// Queues a flushed list: as the graph captured from an equal list, or
    /// launch by launch (then captured when it was seen before).
    pub(in crate::backend::cuda) fn run_recorded(
        &self,
        ops: Vec<graph::Op>,
    ) -> Result<(), CudaError> {
        use std::sync::atomic::Ordering::Relaxed;
        if ops.is_empty() {
            return Ok(());
        }
        let hash = graph::hash_ops(&ops);
        let mut graphs = self.inner.graphs.lock();
        let capture = match graphs.plan(&ops, hash) {
            graph::Plan::Replay(exec) => {
                let stream = self.inner.stream.cu_stream();
                let launched = self.inner.stream.context().bind_to_thread().is_ok()
                    // SAFETY: `exec` is a graph instantiated from launches
                    // equal to these in every byte (so under their
                    // contract), alive while `graphs` is locked.
                    && unsafe { cudarc::driver::result::graph::launch(exec, stream) }.is_ok();
                if launched {
                    self.inner.graph_launches.fetch_add(1, Relaxed);
                    return Ok(());
                }
                // Nothing was queued: launch by launch, and no graphs again.
                graphs.broken = true;
                false
            }
            graph::Plan::EagerThenCapture => true,
            graph::Plan::Eager => false,
        };
        for op in &ops {
            self.enqueue(op.kernel, op.grid, op.params_ptr(), op.overlap)?;
        }
        if capture {
            match self.capture(&mut graphs, &ops) {
                Ok(exec) => {
                    graphs.keep(ops, hash, exec);
                    self.inner.graph_captures.fetch_add(1, Relaxed);
                }
                Err(_) => graphs.broken = true,
            }
        }
        Ok(())
    }

    /// A graph of `ops`, captured on the capture stream (nothing runs).
    fn capture(
        &self,
        graphs: &mut graph::Graphs,
        ops: &[graph::Op],
    ) -> Result<graph::Exec, CudaError> {
        use cudarc::driver::{result, sys};
        let during = "capturing a CUDA graph";
        self.inner
            .stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver(during))?;
        let stream = match &graphs.capture {
            Some(s) => s.handle(),
            None => {
                let s = graph::CaptureStream::new().map_err(CudaError::driver(during))?;
                graphs.capture.insert(s).handle()
            }
        };
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `stream` is the live capture stream, used by nothing else.
        unsafe { result::stream::begin_capture(stream, mode) }
            .map_err(CudaError::driver(during))?;
        // Overlap as recorded: captured as a programmatic edge.
        let queued = ops.iter().try_for_each(|op| {
            self.enqueue_on(stream, op.kernel, op.grid, op.params_ptr(), op.overlap)
        });
        // SAFETY: as above; capture is ended whatever was queued.
        let graph = unsafe { result::stream::end_capture(stream) };
        let graph = match (queued, graph) {
            (Ok(()), Ok(g)) if !g.is_null() => g,
            (queued, graph) => {
                if let Ok(g) = graph
                    && !g.is_null()
                {
                    // SAFETY: the graph the capture made, destroyed once.
                    let _ = unsafe { result::graph::destroy(g) };
                }
                queued?;
                return Err(CudaError::Driver {
                    during,
                    detail: "the capture made no graph".into(),
                });
            }
        };
        // SAFETY: `graph` is the captured graph, valid until destroyed below.
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        // SAFETY: the exec does not depend on the graph it was made from,
        // which is destroyed once, here.
        let _ = unsafe { result::graph::destroy(graph) };
        exec.map(graph::Exec::new)
            .map_err(CudaError::driver(during))
    }
}
