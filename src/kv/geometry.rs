//! The shape of KV: what one token stores in every layer, and in which
//! element type. A leaf type: the pool sizes pages from it, configurations
//! check pools against it, backends lay out attention by it.

use crate::kv::PoolError;

/// Element type of KV storage. Attention always accumulates in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    F16,
    BF16,
    /// FP8 E4M3 ([`F8E4M3`](crate::kv::F8E4M3)): half of bf16's bytes, about
    /// two significant decimal digits, stored unscaled (±448 at most).
    F8E4M3,
}

impl KvDtype {
    /// Bytes per stored element.
    pub const fn size_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::BF16 => 2,
            KvDtype::F8E4M3 => 1,
        }
    }

    /// The name [`KvDtype::parse`] reads back: `f32`, `f16`, `bf16`, `fp8`.
    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
            KvDtype::F8E4M3 => "fp8",
        }
    }

    /// Parses `f32`, `f16`, `bf16` or `fp8` (also `f8e4m3`, `fp8_e4m3`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" => Some(KvDtype::F32),
            "f16" => Some(KvDtype::F16),
            "bf16" => Some(KvDtype::BF16),
            "fp8" | "f8e4m3" | "fp8_e4m3" => Some(KvDtype::F8E4M3),
            _ => None,
        }
    }
}

/// The shape of one token's KV across the whole model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvGeometry {
    /// Transformer layers; every layer stores K and V for every token.
    pub n_layers: usize,
    /// Key/value heads (grouped-query attention: fewer than query heads).
    pub n_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Storage element type.
    pub dtype: KvDtype,
}

impl KvGeometry {
    /// An f32 geometry of `n_layers` layers and one KV head of `head_dim`
    /// elements: the unit tests' small pools.
    #[cfg(test)]
    pub(crate) const fn tiny(n_layers: usize, head_dim: usize) -> Self {
        KvGeometry {
            n_layers,
            n_kv_heads: 1,
            head_dim,
            dtype: KvDtype::F32,
        }
    }

    /// Elements of K (or of V) for one token in one layer.
    pub const fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Bytes of KV (K and V, all layers) one token occupies.
    pub const fn bytes_per_token(&self) -> usize {
        self.n_layers * 2 * self.kv_dim() * self.dtype.size_bytes()
    }

    /// Checks that no size is zero and that the sizes do not overflow.
    pub fn validate(&self) -> Result<(), PoolError> {
        for (name, v) in [
            ("n_layers", self.n_layers),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return Err(PoolError::Zero { field: name });
            }
        }
        self.n_layers
            .checked_mul(2)
            .and_then(|x| x.checked_mul(self.n_kv_heads))
            .and_then(|x| x.checked_mul(self.head_dim))
            .and_then(|x| x.checked_mul(self.dtype.size_bytes()))
            .map(|_| ())
            .ok_or(PoolError::Overflow {
                what: "bytes per token",
            })
    }
}

#[cfg(test)]
mod tests {
    use super::KvDtype;

    #[test]
    fn each_dtype_parses_back_from_its_name() {
        for d in [KvDtype::F32, KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
            assert_eq!(KvDtype::parse(d.name()), Some(d));
        }
        assert_eq!(KvDtype::parse("f64"), None);
    }
}
