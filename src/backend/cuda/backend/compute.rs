//! The [`Backend`] trait's operations on the device.

use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use crate::backend::cuda::table::{LGEMM_BM, LMMA_GROUPS, NORM_CARRY_ROWS};
use crate::backend::cuda::{
    CudaDevice, CudaError, CudaPages, DECODE_GROUPS, HEAD_DIMS, PREFILL_MAX_GROUP, PrefillKernel,
    QuantWeights, Rows, Split, Write,
};
use crate::backend::{
    AttnShape, Backend, BackendError, Norm, QuantMatrix, Rope, SeqSpan, check_rope_rows,
    check_view, rows_of, shape_err,
};
use crate::kv::{
    DeviceError, KvDtype, KvPool, KvSeq, LayerView, PoolConfig, PoolError, Residence, Writable,
};

use super::buffers::{MatData, exact_half, half_of_one_depth};
use super::{CudaBackend, CudaBuf, CudaMat, dev_err};

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Mat = CudaMat;

    fn name(&self) -> &'static str {
        "cuda"
    }

    /// Host pools (mirrored) and device-resident pools on [`CudaPages`].
    /// Opens the pass on the device: with graphs on
    /// ([`CudaDevice::set_graphs`]), its launches are recorded and queued
    /// (or replayed as one graph) at its flushes, the last before this
    /// returns.
    fn run_pass<R: Send, F: FnOnce() -> R + Send>(&self, rows: usize, weights: usize, f: F) -> R {
        let _ = (rows, weights);
        let _pass = self.dev.begin_pass();
        f()
    }

    fn accepts_kv(&self, _r: Residence) -> bool {
        true
    }

    /// Device-resident ([`CudaPages`]) with [`CudaBackend::device_kv`],
    /// host memory otherwise.
    fn new_pool(&self, cfg: PoolConfig) -> Result<KvPool, PoolError> {
        if !self.device_kv {
            return KvPool::new(cfg);
        }
        let pages = CudaPages::for_pool(&self.dev, &cfg).map_err(|e| {
            PoolError::Device(DeviceError {
                device: self.dev.name().to_string(),
                what: format!(
                    "allocating {} bytes of KV pages",
                    cfg.storage_bytes().unwrap_or(usize::MAX)
                ),
                reason: e.to_string(),
            })
        })?;
        KvPool::with_device_pages(cfg, Box::new(pages))
    }

    fn supports_qk_norm(&self) -> Result<(), BackendError> {
        // The RMSNorm kernel takes any row length, but no GPU story has
        // checked it over head rows yet: refuse rather than serve unchecked.
        Err(BackendError::Unsupported {
            what: "per-head q/k RMS norm",
            detail: "(Qwen3) on the CUDA backend".into(),
        })
    }

    fn supports(&self, s: AttnShape) -> Result<(), BackendError> {
        s.check()?;
        let unsupported = |what, detail| Err(BackendError::Unsupported { what, detail });
        if !HEAD_DIMS.contains(&s.head_dim) {
            return unsupported(
                "head_dim",
                format!("{} (compiled: {HEAD_DIMS:?})", s.head_dim),
            );
        }
        // Decode serves ratios past the largest compiled group in head
        // slices of it (cuda/decode_attention.cuh): one grid row per slice.
        // Prefill's scalar kernel, which every dtype and head dim has, takes
        // at most PREFILL_MAX_GROUP.
        let group = s.n_heads / s.n_kv_heads;
        if group > PREFILL_MAX_GROUP {
            return unsupported(
                "query heads per KV head",
                format!("{group} (prefill takes at most {PREFILL_MAX_GROUP})"),
            );
        }
        let most = DECODE_GROUPS[DECODE_GROUPS.len() - 1];
        let rows = s.n_kv_heads.saturating_mul(group.div_ceil(most));
        if rows > 65_535 {
            return unsupported("KV heads x head slices", format!("{rows} (at most 65535)"));
        }
        Ok(())
    }

    fn upload(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<CudaMat, BackendError> {
        let want =
            rows.checked_mul(cols)
                .ok_or(shape_err("upload", "rows * cols overflows", 0, 0))?;
        if data.len() != want || want == 0 {
            return Err(shape_err(
                "upload",
                "rows * cols (non-zero)",
                want,
                data.len(),
            ));
        }
        // A matrix of exact bf16 (or f16) values stays 16-bit (vectors stay
        // f32).
        let half = (self.bf16_weights && rows > 1 && cols > 1)
            .then(|| exact_half(&data))
            .flatten();
        let data = match half {
            Some((h, bits)) => MatData::Half(h, self.dev.upload(&bits).map_err(dev_err)?),
            None => MatData::F32(self.dev.upload(&data).map_err(dev_err)?),
        };
        Ok(CudaMat { data, rows, cols })
    }

    /// Quantized matrices (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K;
    /// a [`QuantMatrix`] holds whole blocks per row) stay in their ggml
    /// blocks on the device; the kernels widen each value as
    /// [`QuantMatrix::dequantize`] does. A single row (a vector, which ops
    /// read as f32) is widened here, as [`Backend::upload`] keeps vectors.
    fn upload_quant(&self, q: QuantMatrix) -> Result<CudaMat, BackendError> {
        let (rows, cols) = (q.rows(), q.cols());
        match QuantWeights::of(q.ggml_type()) {
            Some(f) if rows > 1 => {
                let data = MatData::Quant(f, self.dev.upload(q.bytes()).map_err(dev_err)?);
                Ok(CudaMat { data, rows, cols })
            }
            _ => self.upload(q.dequantize(), rows, cols),
        }
    }

    fn shape(&self, m: &CudaMat) -> (usize, usize) {
        (m.rows, m.cols)
    }

    /// Bytes as placed: 2 per element of a 16-bit matrix, 4 otherwise.
    fn mat_bytes(&self, m: &CudaMat) -> usize {
        match m.data {
            MatData::F32(_) => m.len() * 4,
            MatData::Half(..) => m.len() * 2,
            MatData::Quant(q, _) => m.rows * (m.cols / q.block_values()) * q.block_bytes(),
        }
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    /// Samples on the device (cuda/sampling.cuh): the logits stay there and
    /// only the token ids (or a failed row's culprit) and the
    /// log-probabilities asked for come back, after one sync.
    fn sample(
        &self,
        logits: &CudaBuf,
        vocab: usize,
        draws: &[crate::sampling::Draw],
        out: &mut Vec<Result<u32, crate::sampling::SamplingError>>,
        logprobs: &mut Vec<Option<crate::sampling::TokenLogprobs>>,
    ) -> Result<(), BackendError> {
        out.clear();
        logprobs.clear();
        if draws.is_empty() {
            return Ok(());
        }
        // The pass up to its logits is queued (or replayed) apart from the
        // sampling, whose draws are new every step.
        self.dev.flush().map_err(dev_err)?;
        let (tokens, lps) = self
            .dev
            .sample_rows(&logits.view()?, vocab, draws)
            .map_err(dev_err)?;
        *out = tokens;
        *logprobs = lps;
        Ok(())
    }

    fn to_host(&self, buf: &CudaBuf, out: &mut Vec<f32>) -> Result<(), BackendError> {
        out.clear();
        if buf.len > 0 {
            out.extend(self.dev.download(&buf.view()?).map_err(dev_err)?);
        }
        Ok(())
    }

    fn embed(
        &self,
        table: &CudaMat,
        tokens: &[u32],
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        out.ensure(&self.dev, tokens.len() * table.cols)?;
        let out = &mut out.view_mut()?;
        match &table.data {
            MatData::F32(t) => {
                self.dev
                    .embedding(Rows::Elems(KvDtype::F32), t, table.cols, tokens, out)
            }
            MatData::Half(h, t) => {
                self.dev
                    .embedding(Rows::Elems(h.dtype()), t, table.cols, tokens, out)
            }
            MatData::Quant(q, t) => {
                self.dev
                    .embedding(Rows::Blocks(*q), t, table.cols, tokens, out)
            }
        }
        .map_err(dev_err)?;
        // Queued now: its token ids are new every step, and the rest of the
        // pass, recorded apart, can then replay as one graph.
        self.dev.flush().map_err(dev_err)
    }

    fn rms_norm(
        &self,
        x: &CudaBuf,
        weight: &CudaMat,
        eps: f32,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        rows_of("rms_norm", x.len, weight.len())?;
        out.ensure(&self.dev, x.len)?;
        self.dev
            .rms_norm(
                &x.view()?,
                weight.f32s("rms_norm")?,
                &mut out.view_mut()?,
                eps,
            )
            .map_err(dev_err)
    }

    fn matmul(&self, x: &CudaBuf, w: &CudaMat, out: &mut CudaBuf) -> Result<(), BackendError> {
        let m = rows_of("matmul", x.len, w.cols)?;
        out.ensure(&self.dev, m * w.rows)?;
        self.linear(&x.view()?, w, &mut out.view_mut()?, Write::Store)
    }

    fn matmul_many<const N: usize>(
        &self,
        x: &CudaBuf,
        ws: [&CudaMat; N],
        outs: [&mut CudaBuf; N],
    ) -> Result<(), BackendError> {
        // 16-bit weights of one type and depth: one launch for all of them
        // (each product with the bits of its own). Anything else: one each.
        let Some(half) = half_of_one_depth(&ws).filter(|_| N >= 2 && N <= LMMA_GROUPS) else {
            for (w, out) in ws.into_iter().zip(outs) {
                self.matmul(x, w, out)?;
            }
            return Ok(());
        };
        let m = rows_of("matmul", x.len, ws[0].cols)?;
        self.half_group(x, m, None, half, ws, outs)
    }

    fn norm_matmul_many<const N: usize>(
        &self,
        x: &CudaBuf,
        norm: Norm<'_, CudaMat>,
        xn: &mut CudaBuf,
        ws: [&CudaMat; N],
        outs: [&mut CudaBuf; N],
    ) -> Result<(), BackendError> {
        let m = rows_of("norm_matmul_many", x.len, norm.weight.len())?;
        let half = half_of_one_depth(&ws);
        let Some(half) =
            half.filter(|_| m <= NORM_CARRY_ROWS && N <= LMMA_GROUPS && self.carries_stages())
        else {
            self.rms_norm(x, norm.weight, norm.eps, xn)?;
            return self.matmul_many(xn, ws, outs);
        };
        self.half_group(x, m, Some(norm), half, ws, outs)
    }

    fn norm_swiglu(
        &self,
        x: &CudaBuf,
        norm: Norm<'_, CudaMat>,
        xn: &mut CudaBuf,
        ws: [&CudaMat; 2],
        outs: [&mut CudaBuf; 2],
    ) -> Result<(), BackendError> {
        let m = rows_of("norm_swiglu", x.len, norm.weight.len())?;
        let [gate, up] = outs;
        let pair = half_of_one_depth(&ws).filter(|_| {
            m < LGEMM_BM && ws[0].rows == ws[1].rows && ws[0].cols == norm.weight.len()
        });
        let Some((h, [w_gate, w_up])) = pair.filter(|_| self.carries_stages()) else {
            self.norm_matmul_many(x, norm, xn, ws, [&mut *gate, &mut *up])?;
            return self.swiglu(gate, up);
        };
        gate.ensure(&self.dev, m * ws[0].rows)?;
        let weight = norm.weight.f32s("norm_swiglu")?;
        if m <= NORM_CARRY_ROWS {
            // The norm rides in the loads too.
            return self
                .dev
                .linear_half_swiglu(
                    h,
                    &x.view()?,
                    Some((weight, norm.eps)),
                    w_gate,
                    w_up,
                    ws[0].rows,
                    &mut gate.view_mut()?,
                )
                .map_err(dev_err);
        }
        self.rms_norm(x, norm.weight, norm.eps, xn)?;
        self.dev
            .linear_half_swiglu(
                h,
                &xn.view()?,
                None::<(&CudaSlice<f32>, f32)>,
                w_gate,
                w_up,
                ws[0].rows,
                &mut gate.view_mut()?,
            )
            .map_err(dev_err)
    }

    fn matmul_add(
        &self,
        a: &CudaBuf,
        w: &CudaMat,
        _tmp: &mut CudaBuf,
        x: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        // One launch that adds each product to x as it stores it: the bits
        // of matmul then add_assign, one launch and no round trip through
        // a buffer.
        let m = rows_of("matmul_add", a.len, w.cols)?;
        if x.len != m * w.rows {
            return Err(shape_err(
                "matmul_add",
                "residual length",
                m * w.rows,
                x.len,
            ));
        }
        self.linear(&a.view()?, w, &mut x.view_mut()?, Write::Add)
    }

    fn add_bias(&self, x: &mut CudaBuf, bias: &CudaMat) -> Result<(), BackendError> {
        rows_of("add_bias", x.len, bias.len())?;
        self.dev
            .add_assign(&mut x.view_mut()?, bias.f32s("add_bias")?)
            .map_err(dev_err)
    }

    fn add_assign(&self, x: &mut CudaBuf, y: &CudaBuf) -> Result<(), BackendError> {
        self.elementwise("add_assign", x, y, |d, x, y| d.add_assign(x, y))
    }

    fn rope(&self, x: &mut CudaBuf, positions: &[usize], rope: Rope) -> Result<(), BackendError> {
        check_rope_rows(x.len, positions, rope.n_heads * rope.head_dim)?;
        let pos = self.device_positions(positions)?;
        self.dev
            .rope(&mut x.view_mut()?, &*pos, rope)
            .map_err(dev_err)
    }

    fn rope_qk(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        positions: &[usize],
        rope: Rope,
        k_heads: usize,
    ) -> Result<(), BackendError> {
        check_rope_rows(q.len, positions, rope.n_heads * rope.head_dim)?;
        check_rope_rows(k.len, positions, k_heads * rope.head_dim)?;
        let pos = self.device_positions(positions)?;
        self.dev
            .rope_pair(&mut q.view_mut()?, &mut k.view_mut()?, k_heads, &*pos, rope)
            .map_err(dev_err)
    }

    fn swiglu(&self, gate: &mut CudaBuf, up: &CudaBuf) -> Result<(), BackendError> {
        self.elementwise("swiglu", gate, up, |d, g, u| d.swiglu(g, u))
    }

    fn gather_rows(
        &self,
        x: &CudaBuf,
        cols: usize,
        rows: &[usize],
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let n = rows_of("gather_rows", x.len, cols)?;
        let ids: Vec<u32> = rows
            .iter()
            .map(|&r| {
                u32::try_from(r)
                    .ok()
                    .filter(|&r| (r as usize) < n)
                    .ok_or(shape_err("gather_rows", "row index below", n, r))
            })
            .collect::<Result<_, _>>()?;
        out.ensure(&self.dev, rows.len() * cols)?;
        if rows.is_empty() {
            return Ok(());
        }
        self.dev
            .embedding(
                Rows::Elems(KvDtype::F32),
                &x.view()?,
                cols,
                &ids,
                &mut out.view_mut()?,
            )
            .map_err(dev_err)
    }

    fn kv_append<S: Writable>(
        &self,
        seq: &mut KvSeq<S>,
        layer: usize,
        k: &CudaBuf,
        v: &CudaBuf,
        rows: Range<usize>,
    ) -> Result<(), BackendError> {
        self.append_rows(seq, layer, k, v, rows)
    }

    /// One slot map and one launch for the whole pass when every sequence
    /// is in the same device-resident pool and the spans' rows follow each
    /// other, instead of an upload and a launch per sequence and layer: the
    /// host cost that grew with the batch (an H200 run measured 84 ms of
    /// host time per step at batch 256, 0.77 of the step, ~20 µs for each
    /// of its 4,096 per-sequence appends).
    /// Every reservation is checked before anything is launched, and no row
    /// counts as written before the launch is enqueued; on any error none
    /// of the pass's rows for this layer count. Otherwise, one
    /// [`Backend::kv_append`] per sequence.
    fn kv_append_each<S: Writable>(
        &self,
        seqs: &mut [&mut KvSeq<S>],
        layer: usize,
        k: &CudaBuf,
        v: &CudaBuf,
        spans: &[SeqSpan],
    ) -> Result<(), (usize, BackendError)> {
        let batched =
            self.append_batched(seqs, layer, k.len, v.len, spans, |arena, map, rows| {
                let kvd = arena.geometry().kv_dim();
                let elems = rows.start * kvd..rows.end * kvd;
                let k_rows = k.view()?.slice(elems.clone());
                let v_rows = v.view()?.slice(elems);
                self.dev
                    .kv_append(arena, layer, map, &k_rows, &v_rows)
                    .map_err(dev_err)
            })?;
        if batched.is_none() {
            for (i, (seq, span)) in seqs.iter_mut().zip(spans).enumerate() {
                self.kv_append(seq, layer, k, v, span.row_range())
                    .map_err(|e| (i, e))?;
            }
        }
        Ok(())
    }

    /// RoPE and the append in one launch where the append is batched (see
    /// [`CudaBackend::kv_append_each`]) and covers every row of the pass:
    /// one launch a layer fewer, with the bits of the two.
    fn rope_qk_append_each<S: Writable>(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        positions: &[usize],
        rope: Rope,
        k_heads: usize,
        seqs: &mut [&mut KvSeq<S>],
        layer: usize,
        spans: &[SeqSpan],
    ) -> Result<(), (usize, BackendError)> {
        let every_row = !positions.is_empty()
            && spans.first().is_some_and(|s| s.first_row == 0)
            && spans.last().map(|s| s.first_row + s.rows) == Some(positions.len());
        if every_row {
            let checks = check_rope_rows(q.len, positions, rope.n_heads * rope.head_dim)
                .and_then(|()| check_rope_rows(k.len, positions, k_heads * rope.head_dim));
            checks.map_err(|e| (0, e))?;
            let pos = self.device_positions(positions).map_err(|e| (0, e))?;
            let k_len = k.len;
            let batched =
                self.append_batched(seqs, layer, k_len, v.len, spans, |arena, map, _| {
                    self.dev
                        .rope_pair_append(
                            &mut q.view_mut()?,
                            &mut k.view_mut()?,
                            k_heads,
                            &*pos,
                            rope,
                            arena,
                            layer,
                            map,
                            &v.view()?,
                        )
                        .map_err(dev_err)
                })?;
            if batched.is_some() {
                return Ok(());
            }
        }
        self.rope_qk(q, k, positions, rope, k_heads)
            .map_err(|e| (0, e))?;
        self.kv_append_each(seqs, layer, k, v, spans)
    }

    fn attention_prefill(
        &self,
        q: &CudaBuf,
        kv: &[LayerView<'_>],
        spans: &[SeqSpan],
        shape: AttnShape,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let rows = rows_of("attention_prefill", q.len, shape.q_dim())?;
        if kv.len() != spans.len() || spans.is_empty() {
            return Err(shape_err(
                "attention_prefill",
                "one KV view per span (at least one)",
                spans.len(),
                kv.len(),
            ));
        }
        if kv.iter().any(|v| v.layer_index() != kv[0].layer_index()) {
            return Err(shape_err(
                "attention_prefill",
                "views of one layer",
                kv[0].layer_index(),
                0,
            ));
        }
        let mut next_row = 0;
        let mut lens = Vec::with_capacity(spans.len());
        for (s, (span, view)) in spans.iter().zip(kv).enumerate() {
            if span.first_row != next_row || span.rows == 0 {
                return Err(shape_err(
                    "attention_prefill",
                    "non-empty spans contiguous from row 0",
                    next_row,
                    span.first_row,
                ));
            }
            next_row += span.rows;
            check_view(view, shape, s, span.end_pos())?;
            lens.push((span.end_pos(), span.rows));
        }
        if next_row != rows {
            return Err(shape_err(
                "attention_prefill",
                "rows covered by spans",
                rows,
                next_row,
            ));
        }
        out.ensure(&self.dev, q.len)?;
        self.with_arena(kv, &lens, shape, |at| {
            self.dev
                .prefill_attention(at, &q.view()?, &mut out.view_mut()?, PrefillKernel::Auto)
                .map(drop)
                .map_err(dev_err)
        })
    }

    fn attention_decode(
        &self,
        q: &CudaBuf,
        kv: &[LayerView<'_>],
        shape: AttnShape,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let rows = rows_of("attention_decode", q.len, shape.q_dim())?;
        if kv.len() != rows || rows == 0 {
            return Err(shape_err(
                "attention_decode",
                "one KV view per query row",
                rows,
                kv.len(),
            ));
        }
        let mut lens = Vec::with_capacity(rows);
        for (s, view) in kv.iter().enumerate() {
            check_view(view, shape, s, 1)?;
            lens.push((view.len(), 1));
        }
        if kv.iter().any(|v| v.layer_index() != kv[0].layer_index()) {
            return Err(shape_err(
                "attention_decode",
                "views of one layer",
                kv[0].layer_index(),
                0,
            ));
        }
        out.ensure(&self.dev, q.len)?;
        let mut ws = self
            .workspace
            .lock()
            .map_err(|_| BackendError::Device("decode workspace lock poisoned".into()))?;
        let kernel = self.decode_kernel();
        self.with_arena(kv, &lens, shape, |at| {
            self.dev
                .decode_attention(
                    at,
                    &q.view()?,
                    &mut out.view_mut()?,
                    &mut ws,
                    Split::Auto,
                    kernel,
                )
                .map(drop)
                .map_err(dev_err)
        })
    }
}

impl CudaBackend {
    /// `op(x, y)` in place on `x`, for two buffers of one length (`what`
    /// names the op in the error otherwise).
    fn elementwise(
        &self,
        what: &'static str,
        x: &mut CudaBuf,
        y: &CudaBuf,
        op: impl FnOnce(
            &CudaDevice,
            &mut CudaViewMut<'_, f32>,
            &CudaView<'_, f32>,
        ) -> Result<(), CudaError>,
    ) -> Result<(), BackendError> {
        if x.len != y.len {
            return Err(shape_err(what, "lengths", x.len, y.len));
        }
        op(&self.dev, &mut x.view_mut()?, &y.view()?).map_err(dev_err)
    }

    /// `out = x · wᵀ` or `out += x · wᵀ` (as `write` says) by the kernel
    /// of `w`'s storage.
    fn linear(
        &self,
        x: &CudaView<'_, f32>,
        w: &CudaMat,
        out: &mut CudaViewMut<'_, f32>,
        write: Write,
    ) -> Result<(), BackendError> {
        let (n, k) = (w.rows, w.cols);
        match &w.data {
            MatData::F32(d) => self.dev.linear(x, d, n, out, write),
            MatData::Half(h, d) => self.dev.linear_half(*h, x, d, n, out, write),
            MatData::Quant(q, d) => self.dev.linear_quant(*q, x, d, n, k, out, write),
        }
        .map_err(dev_err)
    }
}
