//! Paged attention on the CPU: one query row against the written positions
//! of one sequence, streamed page by page through its [`LayerView`].
//!
//! Scores, softmax and the weighted sum run over positions in order, so the
//! result does not depend on the page size, on the batch, or on whether the
//! query came from a prefill or a decode step.

use crate::backend::AttnShape;
use crate::backend::cpu::Isa;
use crate::backend::cpu::attend::{SCRATCH, attend_row_with};
use crate::backend::cpu::kernel::Portable;
use crate::kv::LayerView;

/// `out[h] = softmax(q[h] · K[0..n_keys]ᵀ / sqrt(d)) · V[0..n_keys]` for
/// every query head `h`, with K/V of the head's group.
pub(crate) fn attend_row(
    isa: Isa,
    q: &[f32],
    kv: &LayerView<'_>,
    n_keys: usize,
    shape: AttnShape,
    out: &mut [f32],
) {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma | Isa::Avx512 if crate::backend::cpu::x86::has_hd8_kernel(shape) => {
                // SAFETY: as below (AVX2 and FMA were detected).
                unsafe {
                    crate::backend::cpu::x86::attend_row_hd8(q, kv, n_keys, shape, out, &mut s)
                }
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma | Isa::Avx512 => {
                // SAFETY: a CpuBackend holds an AVX2 `Isa` only after the
                // CPU reported AVX2 and FMA (see `Isa::detect`).
                unsafe { crate::backend::cpu::x86::attend_row(q, kv, n_keys, shape, out, &mut s) }
            }
            _ => attend_row_with::<Portable>(q, kv, n_keys, shape, out, &mut s),
        }
    })
}
