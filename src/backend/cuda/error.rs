use crate::http::HttpStatus;

/// Errors of the CUDA backend. A failed launch or copy fails the requests
/// of that step; nothing computed from it is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    #[error(
        "no CUDA driver (libcuda) on this machine: run on a machine with an NVIDIA driver, \
         or use the CPU backend"
    )]
    NoDriver,
    #[error("no CUDA device with ordinal {ordinal} ({count} present): pick another ordinal")]
    NoDevice { ordinal: usize, count: usize },
    #[error("CUDA driver call failed while {during}: {detail}; the step's requests are failed")]
    Driver {
        during: &'static str,
        detail: String,
    },
    #[error("kernel {name} is missing from the embedded fatbin: rebuild with `--features cuda`")]
    MissingKernel { name: String },
    #[error("{what} is not supported by the CUDA kernels: {detail}")]
    Unsupported { what: &'static str, detail: String },
    #[error("shape mismatch: {what}: expected {expected}, got {got}")]
    Shape {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("page {page} is outside the device KV arena of {pages} pages: refused before launch")]
    PageOutOfRange { page: u32, pages: usize },
    #[error(
        "sequence {seq}: {detail}; page tables are checked before any launch and this one is refused"
    )]
    BadPageTable { seq: usize, detail: String },
    #[error("token id {token} is outside the vocabulary of {vocab}: refused before launch")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error(
        "logits of row {row} hold {nans} NaN values: the step read poisoned or corrupt data and \
         its output is refused"
    )]
    NanLogits { row: usize, nans: u32 },
    #[error("the page tables or slots were built for another KV arena: rebuild them for this one")]
    ForeignArena,
}

impl CudaError {
    pub(crate) fn driver(during: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        move |e| CudaError::Driver {
            during,
            detail: e.to_string(),
        }
    }
}

impl HttpStatus for CudaError {
    fn http_status(&self) -> u16 {
        match self {
            // The deployment lacks what it needs: not the client's fault, retry elsewhere.
            CudaError::NoDriver | CudaError::NoDevice { .. } | CudaError::MissingKernel { .. } => {
                503
            }
            CudaError::TokenOutOfRange { .. } => 400,
            _ => 500,
        }
    }
}
