//! ggml's tensor storage types: their ids, block sizes and byte sizes.

use std::fmt;

/// How a GGUF tensor's elements are stored. Every type ggml defines is
/// known here, so a file's directory can be bounds-checked whatever it
/// holds; [`GgmlType::computable`] says which ones handoff can serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
}

/// (type, id, elements per block, bytes per block, name)
const TABLE: [(GgmlType, u32, u64, u64, &str); 32] = [
    (GgmlType::F32, 0, 1, 4, "F32"),
    (GgmlType::F16, 1, 1, 2, "F16"),
    (GgmlType::Q4_0, 2, 32, 18, "Q4_0"),
    (GgmlType::Q4_1, 3, 32, 20, "Q4_1"),
    (GgmlType::Q5_0, 6, 32, 22, "Q5_0"),
    (GgmlType::Q5_1, 7, 32, 24, "Q5_1"),
    (GgmlType::Q8_0, 8, 32, 34, "Q8_0"),
    (GgmlType::Q8_1, 9, 32, 36, "Q8_1"),
    (GgmlType::Q2K, 10, 256, 84, "Q2_K"),
    (GgmlType::Q3K, 11, 256, 110, "Q3_K"),
    (GgmlType::Q4K, 12, 256, 144, "Q4_K"),
    (GgmlType::Q5K, 13, 256, 176, "Q5_K"),
    (GgmlType::Q6K, 14, 256, 210, "Q6_K"),
    (GgmlType::Q8K, 15, 256, 292, "Q8_K"),
    (GgmlType::Iq2Xxs, 16, 256, 66, "IQ2_XXS"),
    (GgmlType::Iq2Xs, 17, 256, 74, "IQ2_XS"),
    (GgmlType::Iq3Xxs, 18, 256, 98, "IQ3_XXS"),
    (GgmlType::Iq1S, 19, 256, 50, "IQ1_S"),
    (GgmlType::Iq4Nl, 20, 32, 18, "IQ4_NL"),
    (GgmlType::Iq3S, 21, 256, 110, "IQ3_S"),
    (GgmlType::Iq2S, 22, 256, 82, "IQ2_S"),
    (GgmlType::Iq4Xs, 23, 256, 136, "IQ4_XS"),
    (GgmlType::I8, 24, 1, 1, "I8"),
    (GgmlType::I16, 25, 1, 2, "I16"),
    (GgmlType::I32, 26, 1, 4, "I32"),
    (GgmlType::I64, 27, 1, 8, "I64"),
    (GgmlType::F64, 28, 1, 8, "F64"),
    (GgmlType::Iq1M, 29, 256, 56, "IQ1_M"),
    (GgmlType::Bf16, 30, 1, 2, "BF16"),
    (GgmlType::Tq1_0, 34, 256, 54, "TQ1_0"),
    (GgmlType::Tq2_0, 35, 256, 66, "TQ2_0"),
    (GgmlType::Mxfp4, 39, 32, 17, "MXFP4"),
];

impl GgmlType {
    /// The type with ggml id `id`, if ggml defines one.
    pub fn from_id(id: u32) -> Option<Self> {
        TABLE.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    fn entry(self) -> &'static (GgmlType, u32, u64, u64, &'static str) {
        // Every variant has exactly one row (checked by a test).
        TABLE.iter().find(|e| e.0 == self).unwrap_or(&TABLE[0])
    }

    /// ggml's id for the type.
    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// Elements per block (1 for plain types).
    pub fn block_elems(self) -> u64 {
        self.entry().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        self.entry().3
    }

    /// ggml's name for the type (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        self.entry().4
    }

    /// Every type ggml defines, in id order (for tests that must cover
    /// each type of a kind).
    #[cfg(test)]
    pub(crate) fn every() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|e| e.0)
    }

    /// Whether handoff can compute with tensors of this type.
    pub fn computable(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | Bf16 | Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4K | Q5K | Q6K
        )
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_has_one_row_and_round_trips_its_id() {
        for (ty, id, ..) in TABLE {
            assert_eq!(GgmlType::from_id(id), Some(ty));
            assert_eq!(ty.id(), id);
            assert_eq!(TABLE.iter().filter(|e| e.0 == ty).count(), 1);
        }
        assert_eq!(GgmlType::from_id(4), None, "Q4_2 was removed from ggml");
        assert_eq!(GgmlType::Q4K.block_bytes(), 144);
        assert_eq!(GgmlType::Q6K.to_string(), "Q6_K");
    }
}
