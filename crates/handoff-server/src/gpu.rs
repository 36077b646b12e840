//! `--backend cuda`: GPU 0, each model on its own backend there with its
//! KV pages in device memory, or the reason it cannot be. In a build
//! without the `cuda` feature [`Gpu`] has no values, so the GPU branch
//! compiles to nothing and [`open`] says which build flag it needs: the
//! server never serves from the CPU in the GPU's place.

/// The opened GPU.
#[cfg(feature = "cuda")]
pub type Gpu = handoff::backend::cuda::CudaDevice;

/// No GPU in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub enum Gpu {}

/// Opens GPU 0, or says why it cannot (`--backend cuda: ...`).
pub fn open() -> Result<Gpu, String> {
    #[cfg(feature = "cuda")]
    {
        Gpu::open(0).map_err(|e| format!("--backend cuda: no usable GPU: {e}"))
    }
    #[cfg(not(feature = "cuda"))]
    Err(
        "--backend cuda needs a build with the cuda feature (and nvcc to build it): \
         cargo install --path crates/handoff-server --features cuda"
            .into(),
    )
}

/// The backend [`backend`] makes (never made without the `cuda` feature).
#[cfg(feature = "cuda")]
pub type GpuBackend = handoff::backend::cuda::CudaBackend;
#[cfg(not(feature = "cuda"))]
pub type GpuBackend = handoff::backend::CpuBackend;

/// A backend on `gpu` whose pools keep their pages in its memory.
#[cfg(feature = "cuda")]
pub fn backend(gpu: &Gpu) -> GpuBackend {
    handoff::backend::cuda::CudaBackend::new(gpu.clone()).device_kv(true)
}

/// Never called: there is no [`Gpu`] without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn backend(gpu: &Gpu) -> GpuBackend {
    match *gpu {}
}

/// What the log says the models run on.
pub fn describe(gpu: &Gpu) -> String {
    #[cfg(feature = "cuda")]
    {
        format!("{}, KV pages in device memory", gpu.name())
    }
    #[cfg(not(feature = "cuda"))]
    match *gpu {}
}
