//! Paged attention: decode (one query a sequence, split-KV with its merge)
//! and causal prefill, each as its plan (`plan/mod.rs`) chose.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::Args;
use crate::backend::cuda::params::DecodeParams;
use crate::backend::cuda::plan::{
    self, Attn, Batch, DecodeKernel, DecodePlan, PrefillKernel, Split, Step,
};
use crate::backend::cuda::{CudaDevice, CudaError, DeviceKvArena, PageTables};

/// The KV one attention launch reads: layer `layer` of `arena`, through
/// `tables` (built for this arena: checked at the launch), for `n_heads`
/// query heads.
#[derive(Clone, Copy)]
pub struct AttnKv<'a> {
    pub arena: &'a DeviceKvArena,
    pub tables: &'a PageTables,
    pub layer: usize,
    pub n_heads: usize,
}

/// Scratch buffers of split-KV decode, grown on demand and reused.
#[derive(Default)]
pub struct DecodeWorkspace {
    part_o: Option<CudaSlice<f32>>,
    part_lse: Option<CudaSlice<f32>>,
}

impl DecodeWorkspace {
    fn ensure(
        &mut self,
        dev: &CudaDevice,
        size: plan::Workspace,
    ) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<f32>), CudaError> {
        // A recorded launch may still use a buffer replaced here.
        if self.part_o.as_ref().is_none_or(|b| b.len() < size.part_o)
            && let Some(old) = self.part_o.replace(dev.zeros(size.part_o)?)
        {
            dev.retire(old);
        }
        if self
            .part_lse
            .as_ref()
            .is_none_or(|b| b.len() < size.part_lse)
            && let Some(old) = self.part_lse.replace(dev.zeros(size.part_lse)?)
        {
            dev.retire(old);
        }
        match (self.part_o.as_mut(), self.part_lse.as_mut()) {
            (Some(o), Some(l)) => Ok((o, l)),
            _ => Err(CudaError::Shape {
                what: "decode workspace",
                expected: size.part_o,
                got: 0,
            }),
        }
    }
}

fn batch_of(tables: &PageTables) -> Batch {
    Batch {
        batch: tables.batch,
        total_q: tables.total_q,
        max_q_len: tables.max_q_len,
        max_kv_len: tables.max_kv_len,
    }
}

/// `p` with what both decode launches read bound: q, the arena and the
/// page tables.
fn bind_decode<'a>(
    args: &mut Args<'a>,
    mut p: DecodeParams,
    q: &'a impl DevicePtr<f32>,
    arena: &'a DeviceKvArena,
    tables: &'a PageTables,
) -> DecodeParams {
    p.q = args.read(q);
    p.kv = args.read(&arena.data);
    let [page_table, page_indptr, _, kv_len] = args.read_arrays(&tables.arrays);
    (p.page_table, p.page_indptr, p.kv_len) = (page_table, page_indptr, kv_len);
    p
}

impl CudaDevice {
    /// The attention shape of `kv`, whose tables must be built for its
    /// arena.
    fn attn(&self, kv: AttnKv<'_>) -> Result<Attn, CudaError> {
        if kv.tables.arena_id != kv.arena.id {
            return Err(CudaError::ForeignArena);
        }
        Attn::new(
            &kv.arena.geometry(),
            kv.arena.page_size(),
            kv.arena.page_elems(),
            kv.layer,
            kv.n_heads,
        )
    }

    /// Paged decode attention over `kv`: one query per sequence,
    /// by the kernel `kernel` chooses ([`DecodeKernel::Auto`]: the plan's).
    ///
    /// `q` is `[batch, n_heads, head_dim]`, `out` the same; every sequence of
    /// `tables` must have `q_len == 1`. Returns the number of KV chunks
    /// launched per sequence, an upper bound on what each one used (1: no
    /// merge pass), and the kernel that ran (never [`DecodeKernel::Auto`]).
    pub fn decode_attention(
        &self,
        kv: AttnKv<'_>,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        ws: &mut DecodeWorkspace,
        split: Split,
        kernel: DecodeKernel,
    ) -> Result<(usize, DecodeKernel), CudaError> {
        let (a, arena, tables) = (self.attn(kv)?, kv.arena, kv.tables);
        let (chosen, plan) =
            plan::decode(&a, &batch_of(tables), q.len(), out.len(), split, kernel)?;
        let splits = plan.splits();
        // Launch contract (both launches): q and out hold
        // batch*n_heads*head_dim f32 (checked by the plan); the page tables
        // were built for this arena (id checked) with every page index
        // inside it and kv_len covered by each sequence's pages; the kernel
        // matches dtype and head_dim and its group is at least p.group, or
        // it runs in grid.y / n_kv_heads slices of its group; grid
        // (num_splits, n_kv_heads x slices, batch) as the kernel indexes,
        // and num_splits chunks cover every sequence's kv_len (fixed chunks
        // cover max_kv_len; auto chunks are at most num_splits per
        // sequence). The tensor-core kernel's 16-byte copies need pages on
        // 16 bytes (the plan checked page_stride; the arena's base is
        // allocation-aligned).
        match plan {
            DecodePlan::Empty => {}
            DecodePlan::Whole(Step {
                kernel,
                params,
                grid,
            }) => {
                self.launch_bound(kernel, grid, |a| {
                    let p = bind_decode(a, params, q, arena, tables);
                    DecodeParams {
                        out: a.write(out),
                        ..p
                    }
                })?;
            }
            DecodePlan::Split {
                attn,
                merge,
                workspace,
            } => {
                let (part_o, part_lse) = ws.ensure(self, workspace)?;
                // part_o and part_lse hold at least the plan's workspace.
                self.launch_bound(attn.kernel, attn.grid, |a| {
                    let p = bind_decode(a, attn.params, q, arena, tables);
                    DecodeParams {
                        part_o: a.write(part_o),
                        part_lse: a.write(part_lse),
                        ..p
                    }
                })?;
                // Launch contract (merge): part_o/part_lse were sized for
                // (batch, n_heads, num_splits) and written by the launch
                // before on the same stream; out holds
                // batch*n_heads*head_dim f32; grid (n_heads, batch).
                let mut m = merge.params;
                let mut args = Args::new(&self.inner.stream);
                m.part_o = args.read(part_o);
                m.part_lse = args.read(part_lse);
                m.out = args.write(out);
                // The merge waits for the split launch on the device.
                let overlap = self.launch_overlap();
                self.launch_with(merge.kernel, &m, merge.grid, args, overlap)?;
            }
        }
        Ok((splits, chosen))
    }

    /// Paged causal prefill attention over `kv`, on tensor cores
    /// where compiled (see [`PrefillKernel::Auto`]) or by the kernel
    /// `kernel` names; returns the one that ran (never
    /// [`PrefillKernel::Auto`]).
    ///
    /// `q` and `out` are `[total_q, n_heads, head_dim]`, the rows of each
    /// sequence's `q_len` new positions in batch order; their K/V must
    /// already be appended (they are the last `q_len` of `kv_len`).
    pub fn prefill_attention(
        &self,
        kv: AttnKv<'_>,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        kernel: PrefillKernel,
    ) -> Result<PrefillKernel, CudaError> {
        let (a, arena, tables) = (self.attn(kv)?, kv.arena, kv.tables);
        let plan = plan::prefill(&a, &batch_of(tables), q.len(), out.len(), kernel)?;
        let Some(Step {
            kernel,
            mut params,
            grid,
        }) = plan.step
        else {
            return Ok(plan.chosen);
        };
        let mut args = Args::new(&self.inner.stream);
        params.q = args.read(q);
        params.kv = args.read(&arena.data);
        [
            params.page_table,
            params.page_indptr,
            params.q_indptr,
            params.kv_len,
        ] = args.read_arrays(&tables.arrays);
        params.out = args.write(out);
        if plan.needs_aligned_rows && (params.q % 8 != 0 || params.out % 8 != 0) {
            return Err(CudaError::Unsupported {
                what: "tensor-core prefill buffers",
                detail: "q and out must be 8-byte aligned (views at an odd element)".into(),
            });
        }
        // Launch contract: q and out hold total_q*n_heads*head_dim f32
        // (checked by the plan); the page tables were built for this arena
        // with every page inside it, each sequence's kv_len covered by its
        // pages and q_len <= kv_len; the kernel matches dtype and head_dim.
        // Scalar: group <= 32 rows per tile. Tensor cores: group <= 64 rows
        // per block (128 for the wide kernel); q and out 8-byte aligned
        // (checked) for their float2 accesses; KV rows are 16-byte
        // multiples (arena invariant) for their 16-byte loads.
        self.launch(kernel, &params, grid, args)?;
        Ok(plan.chosen)
    }
}
