//! The instruction sets the CPU kernels are compiled for, and which of
//! them this CPU runs.

/// The instruction set the CPU kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Baseline code for the target (SSE2 on x86-64).
    Portable,
    /// AVX2 with fused multiply-add (x86-64 CPUs since ~2013), and F16C
    /// (which every such CPU has) to widen f16 weights.
    Avx2Fma,
    /// Everything of [`Isa::Avx2Fma`], and AVX-512 (F, BW, DQ, VL): the
    /// quantized decode kernels (Q8_0 and Q4_1 at one to eight activation
    /// rows, the other block types at five to eight) run 16 lanes wide, two
    /// weight rows at once. The same bits as `Avx2Fma`: each lane does the
    /// same operations in the same order.
    Avx512,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512dq")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return Isa::Avx512;
            }
            return Isa::Avx2Fma;
        }
        Isa::Portable
    }

    /// Every instruction set this CPU supports.
    pub fn available() -> Vec<Isa> {
        match Isa::detect() {
            Isa::Portable => vec![Isa::Portable],
            Isa::Avx2Fma => vec![Isa::Portable, Isa::Avx2Fma],
            Isa::Avx512 => vec![Isa::Portable, Isa::Avx2Fma, Isa::Avx512],
        }
    }

    /// Whether the AVX2, FMA and F16C kernels may run (a backend holds
    /// such an `Isa` only after the CPU reported those features).
    pub(crate) fn avx2(self) -> bool {
        matches!(self, Isa::Avx2Fma | Isa::Avx512)
    }
}
