//! Every kernel launch (queued now, recorded for a flush, or captured into
//! a CUDA graph), and every other `unsafe` of the CUDA backend but the
//! params structs' `DeviceRepr` (params.rs) and the graph and stream
//! handles' ownership (graph.rs). One file per op family; the launch
//! machinery itself (the one launch, graph replay and capture) is
//! `queue.rs`.
//!
//! Each public operation checks, before it launches, everything the kernel
//! relies on for memory safety: buffer lengths against the shapes in the
//! params struct, page tables and slot maps built for this arena (their
//! page indices were checked when they were built), and shapes with a
//! compiled instantiation (chosen by its plan, `plan/`). Then it binds its
//! buffers ([`Args`]) into the params struct and launches the kernel the
//! table pairs with that struct, through [`CudaDevice::launch_bound`] (or,
//! for a launch that checks a bound address first or overlaps the one
//! before, [`CudaDevice::launch`] itself). All work runs on the device's
//! one stream, in call order, so a buffer dropped after a call is freed
//! (stream-ordered) only after the kernels that use it.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};

use super::arena::Packed;
use super::kernels::Kernel;
use super::plan::Grid;
use super::{CudaDevice, CudaError};

mod attention;
mod checksum;
mod embedding;
mod kv;
mod linear;
mod linear_half;
mod norm_rope;
mod queue;
mod sampling;

pub use attention::{AttnKv, DecodeWorkspace};
pub use checksum::PageChecksums;
pub use embedding::Rows;

/// What a matmul does with its output buffer: store the product, or add it
/// to what the buffer holds (a projection added to the residual stream:
/// the bits of storing into a buffer then
/// [`CudaDevice::add_assign`], in one launch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// `out = x · wᵀ`.
    Store,
    /// `out += x · wᵀ`.
    Add,
}

impl Write {
    /// The params structs' `accumulate` flag.
    fn accumulate(self) -> u32 {
        u32::from(self == Write::Add)
    }
}

/// True when libcuda can be loaded (checked before any driver call, since
/// cudarc's context creation panics without it).
pub(in crate::backend::cuda) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library and drops the handle.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Most buffers one launch binds.
const MAX_ARGS: usize = 8;

/// The buffers one launch reads and writes: each one's device address for
/// the params struct, and the stream guard that orders it, held until the
/// launch is queued (see [`CudaDevice::launch`]).
struct Args<'a> {
    stream: &'a CudaStream,
    guards: [Option<SyncOnDrop<'a>>; MAX_ARGS],
    bound: usize,
}

impl<'a> Args<'a> {
    fn new(stream: &'a CudaStream) -> Self {
        Args {
            stream,
            guards: [const { None }; MAX_ARGS],
            bound: 0,
        }
    }

    /// The address of a buffer the kernel reads.
    fn read<T>(&mut self, buf: &'a impl DevicePtr<T>) -> u64 {
        let (ptr, guard) = buf.device_ptr(self.stream);
        self.hold(guard);
        ptr
    }

    /// The address of a buffer the kernel writes.
    fn write<T>(&mut self, buf: &'a mut impl DevicePtrMut<T>) -> u64 {
        let (ptr, guard) = buf.device_ptr_mut(self.stream);
        self.hold(guard);
        ptr
    }

    /// The addresses of the arrays of a packed buffer, which the kernel
    /// reads.
    fn read_arrays<const N: usize>(&mut self, packed: &'a Packed<N>) -> [u64; N] {
        let base = self.read(&packed.data);
        packed.at.map(|at| base + 4 * at as u64)
    }

    fn hold(&mut self, guard: SyncOnDrop<'a>) {
        if let Some(slot) = self.guards.get_mut(self.bound) {
            *slot = Some(guard);
        }
        // Past MAX_ARGS the guard is dropped here and the launch refused.
        self.bound += 1;
    }
}

impl CudaDevice {
    /// The launch of every op: `bind` fills `kernel`'s params struct,
    /// binding into `args` each buffer whose address it writes there (after
    /// the op has checked them all), then [`CudaDevice::launch`] queues it
    /// over `grid`.
    fn launch_bound<'a, P: DeviceRepr + bytemuck::NoUninit>(
        &'a self,
        kernel: Kernel<P>,
        grid: Grid,
        bind: impl FnOnce(&mut Args<'a>) -> P,
    ) -> Result<(), CudaError> {
        let mut args = Args::new(&self.inner.stream);
        let params = bind(&mut args);
        self.launch(kernel, &params, grid, args)
    }
}
