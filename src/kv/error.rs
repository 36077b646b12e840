use crate::http::HttpStatus;
use crate::ids::RequestId;
use crate::kv::PageId;
use crate::kv::device::DeviceError;

/// Errors of the KV layer. None of them ever comes with data: a read that
/// would be stale, foreign or out of range is refused, not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    #[error(
        "KV pool exhausted: {requested} pages requested, {free} free of {capacity}; \
         wait for running requests to finish or enlarge the pool"
    )]
    Exhausted {
        requested: usize,
        /// Pages free, counting idle prefix-cache pages (which an
        /// allocation evicts): what the request could have had.
        free: usize,
        capacity: usize,
    },
    #[error(
        "{tokens} tokens can never fit a pool of {capacity_tokens} token slots: reject the request"
    )]
    NeverFits {
        tokens: usize,
        capacity_tokens: usize,
    },
    #[error(
        "write beyond reservation in layer {layer}: {written} written + {adding} new > {reserved} reserved; \
         grow the sequence before appending"
    )]
    BeyondReservation {
        layer: usize,
        written: usize,
        adding: usize,
        reserved: usize,
    },
    #[error(
        "stale page {page:?}: its current generation is {current}; the handle no longer owns it"
    )]
    StalePage { page: PageId, current: u64 },
    #[error(
        "page {page:?} does not belong to this pool: use the handle from the pool that issued it"
    )]
    ForeignPage { page: PageId },
    #[error("page {page:?} is not in use (it is free or held): nothing may read or write it")]
    PageNotInUse { page: PageId },
    #[error(
        "layer {layer} out of range: the model has {n_layers} layers; build the pool from the model's geometry"
    )]
    LayerOutOfRange { layer: usize, n_layers: usize },
    #[error(
        "shape mismatch: {what}: expected {expected}, got {got}; pass buffers of the pool's geometry"
    )]
    Shape {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error(
        "KV incomplete: layer {layer} has {written} tokens, {expected} expected; it cannot be used for decode"
    )]
    Incomplete {
        layer: usize,
        written: usize,
        expected: usize,
    },
    #[error(
        "isolation violation: {reader} read layer {layer} slot {slot} of page {page} written by {writer:?}; \
         the read was refused: fail the request and report this as a bug"
    )]
    IsolationViolation {
        reader: RequestId,
        writer: Option<RequestId>,
        page: u32,
        layer: usize,
        slot: usize,
    },
    #[error(
        "no randomness for the prefix cache's server secret: {reason}; pass one with CacheSecret::from_bytes"
    )]
    NoEntropy { reason: String },
    #[error(
        "prefix keys do not fit this sequence: {reason}; derive them from this pool's cache for this request"
    )]
    PrefixMismatch { reason: &'static str },
    #[error(
        "rows written on a device are committed only to a device-resident pool; \
         this one keeps its pages in host memory: append through KvSeq::append"
    )]
    NotDeviceResident,
    #[error(
        "the KV pool's device failed: {0}; the pool hands out no more pages: \
         send the request to another worker and rebuild this one's pool"
    )]
    Device(DeviceError),
}

/// Why a pool (or a KV geometry) could not be built. Every variant names the
/// size at fault; deployments see these as the matching
/// `ConfigError` (the config layer above).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    #[error("{field} is zero: every size must be at least 1")]
    Zero { field: &'static str },
    #[error("page_size {page_size} is not a power of two: use 1, 2, 4, ... 16, 64, ...")]
    PageSizeNotPowerOfTwo { page_size: usize },
    #[error("{what} overflows: the pool is too large for this machine")]
    Overflow { what: &'static str },
    #[error(
        "the KV pool's {bytes} bytes could not be allocated: build a smaller pool or free memory"
    )]
    OutOfMemory { bytes: usize },
    #[error(
        "the device memory given for the KV pool holds {have} bytes, the pool needs {need}: \
         give it more or build a smaller pool"
    )]
    DeviceTooSmall { have: usize, need: usize },
    #[error("the KV pool's device memory could not be scrubbed: {0}")]
    Device(DeviceError),
}

impl HttpStatus for PoolError {
    fn http_status(&self) -> u16 {
        match self {
            // The machine lacks the memory now: another may have it.
            PoolError::OutOfMemory { .. } | PoolError::Device(_) => 503,
            _ => 500,
        }
    }
}

impl HttpStatus for KvError {
    fn http_status(&self) -> u16 {
        match self {
            KvError::Exhausted { .. } => 503,
            KvError::NeverFits { .. } => 413,
            // The device is gone here; another worker may serve it.
            KvError::Device(_) => 503,
            _ => 500,
        }
    }
}

impl HttpStatus for crate::kv::SealError {
    fn http_status(&self) -> u16 {
        self.error.http_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolConfig;
    use crate::kv::KvPool;
    use crate::kv::{KvDtype, KvGeometry};

    #[test]
    fn a_seal_error_is_an_error_with_the_status_of_its_cause() {
        fn seal(
            seq: crate::kv::KvSeq<crate::kv::Filling>,
        ) -> Result<(), Box<dyn std::error::Error>> {
            let _ready = seq.seal(4)?;
            Ok(())
        }
        let g = KvGeometry {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 1,
            dtype: KvDtype::F32,
        };
        let pool = KvPool::new(PoolConfig::new(g, 4, 1)).unwrap();
        let seq = pool.reserve(RequestId(1), 4).unwrap();
        let e = seal(seq).unwrap_err();
        assert!(e.to_string().contains("incomplete"), "{e}");
        drop(e); // it holds the unsealed sequence, and so its page
        let seq = pool.reserve(RequestId(2), 4).unwrap();
        let e = seq.seal(4).unwrap_err();
        assert_eq!(e.http_status(), 500);
    }
}
