//! Decode and prefill attention figures on the GPU (prints tables; no
//! timing assertions). Without a GPU it prints a SKIP line and exits 0.
//!
//! Decode: achieved bandwidth = KV bytes read / kernel time, as a share of
//! a device-to-device copy ((read + write) bytes / time) measured in the
//! same process, for the tensor-core kernel, its wide form (eight warps a
//! block) and the scalar one side by side on the same pages. GQA 32:4, head_dim 128, bf16 KV, one layer, page
//! 16 vs 64, batch {1, 8, 64, 256} x context {1k, 8k, 32k, 128k}, and GQA
//! 32:8 at the goal cells; cells whose arena would exceed
//! HANDOFF_BENCH_MAX_GIB (default 80; the largest, 256 x 128k, is 64 GiB)
//! or fail to allocate are reported as skipped. Prints
//! `decode_copy_share_b8_ctx8k=X` and `decode_copy_share_b1_ctx32k=X`
//! (GQA 32:4, page 16, the kernel `DecodeKernel::Auto` takes: tensor cores),
//! each followed by `decode_wide_copy_share_...=X` for the wide kernel.
//!
//! Prefill: causal, head_dim 128, 32:8 heads, bf16 KV, page 16, 1k-8k
//! positions, on the tensor-core kernel and on the scalar reference:
//! TFLOP/s (causal triangle only) and the share of the H200's dense bf16
//! peak (989 TFLOP/s).
//!
//! cuBLAS is not linked (the GPU machine has no libcublas outside its
//! torch install): gpu-bundle/run.sh times torch's cuBLAS bf16 GEMMs right
//! after this bench and divides the line `prefill_tc_tflops_8k=<x>` printed
//! here by them.
//!
//! On an H200, the cells that match a published figure (as issue 16 quotes
//! them) also print their share of it: decode at 8k and longer against
//! FlashInfer's 0.88 of spec bandwidth, prefill at 8k against
//! FlashAttention-2 (360 TFLOP/s) and FlashAttention-3 (695).
//!
//! Dense layers: the bf16 tensor-core matmul on the Llama-3.2-1B layer
//! shapes at 1 to 4,096 rows: TFLOP/s, weight GB/s as a share of the copy,
//! and `linear_tflops_m<m>_n<n>_k<k>=X` lines that the cuBLAS script sets
//! beside torch's bf16 GEMM on the same shapes.
//!
//! Last, tuning data: what one decode call costs on the device and on the
//! host however little it reads, and a sweep of split-KV chunk sizes at the
//! decode goal cells on both tensor-core kernels, to tune `Split::Auto` from.
#![cfg_attr(not(feature = "cuda"), allow(unused))]

#[cfg(not(feature = "cuda"))]
fn main() {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIP cuda_attention: built without --features cuda"
    );
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = gpu::run() {
        eprintln!("cuda_attention failed: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use handoff::backend::cuda::{
        AttnKv, CudaDevice, CudaError, CudaSlice, DecodeKernel, DecodeWorkspace, DeviceKvArena,
        HalfWeights, LGEMM_BM, LIN_ROWS_FEW, LIN_ROWS_MANY, LIN_ROWS_ONE, LMMA_WIDE_BM, PageTables,
        PrefillKernel, QuantWeights, SeqPages, Split, Write, device_for_test,
    };
    use handoff::{KvDtype, KvGeometry};

    /// (batch, context) cells of the GQA 32:4 decode table: every batch of
    /// {1, 8, 64, 256} with every context of {1k, 8k, 32k, 128k}.
    const DECODE_CELLS_32_4: &[(usize, usize)] = &[
        (1, 1024),
        (1, 8192),
        (1, 32768),
        (1, 131072),
        (8, 1024),
        (8, 8192),
        (8, 32768),
        (8, 131072),
        (64, 1024),
        (64, 8192),
        (64, 32768),
        (64, 131072),
        (256, 1024),
        (256, 8192),
        (256, 32768),
        (256, 131072),
    ];
    /// The GQA 32:8 cells of the goals (batch 1 at 32k, batch 8 and 64 at 8k).
    const DECODE_CELLS_32_8: &[(usize, usize)] = &[(1, 32768), (8, 8192), (64, 8192)];

    /// Published reference points, as issue 16 quotes them: FlashInfer's
    /// paged batch decode reads about 0.88 of the spec HBM bandwidth at long
    /// contexts; FlashAttention-2-class prefill on Hopper runs about 350-370
    /// TFLOP/s and FlashAttention-3 650-740 (midpoints here).
    const FLASHINFER_DECODE_SPEC_SHARE: f64 = 0.88;
    const FA2_TFLOPS: f64 = 360.0;
    const FA3_TFLOPS: f64 = 695.0;

    /// The spec HBM bandwidth (GB/s) of a GPU those figures can be compared
    /// on; `None` elsewhere (the comparison columns stay empty).
    fn spec_gbps(name: &str) -> Option<f64> {
        name.contains("H200").then_some(4800.0)
    }

    /// One decode cell: `batch` sequences of `ctx` positions on pages of
    /// `ps`, their pages interleaved (page i of sequence b at i * batch + b),
    /// with zero queries.
    struct DecodeCell {
        arena: DeviceKvArena,
        tables: PageTables,
        q: CudaSlice<f32>,
        out: CudaSlice<f32>,
        ws: DecodeWorkspace,
        n_heads: usize,
        /// KV bytes one call reads.
        kv_bytes: usize,
    }

    impl DecodeCell {
        fn new(
            dev: &CudaDevice,
            g: KvGeometry,
            n_heads: usize,
            ps: usize,
            batch: usize,
            ctx: usize,
        ) -> Result<DecodeCell, CudaError> {
            let per_seq = ctx / ps;
            let arena = DeviceKvArena::new(dev, g, ps, batch * per_seq)?;
            let pages: Vec<Vec<u32>> = (0..batch)
                .map(|b| (0..per_seq).map(|i| (i * batch + b) as u32).collect())
                .collect();
            let seqs: Vec<SeqPages> = pages
                .iter()
                .map(|p| SeqPages {
                    pages: p,
                    kv_len: ctx,
                    q_len: 1,
                })
                .collect();
            let tables = PageTables::new(dev, &arena, &seqs)?;
            let rows = batch * n_heads * g.head_dim;
            Ok(DecodeCell {
                tables,
                q: dev.zeros::<f32>(rows)?,
                out: dev.zeros::<f32>(rows)?,
                ws: DecodeWorkspace::default(),
                n_heads,
                kv_bytes: batch * ctx * g.bytes_per_token(),
                arena,
            })
        }

        /// One call of `kernel` with `split`; the chunks it launched per
        /// sequence.
        fn call(
            &mut self,
            dev: &CudaDevice,
            split: Split,
            kernel: DecodeKernel,
        ) -> Result<usize, CudaError> {
            dev.decode_attention(
                AttnKv {
                    arena: &self.arena,
                    tables: &self.tables,
                    layer: 0,
                    n_heads: self.n_heads,
                },
                &self.q,
                &mut self.out,
                &mut self.ws,
                split,
                kernel,
            )
            .map(|(n, _)| n)
        }

        /// Device ms per call of `kernel` (`Split::Auto`) over `iters` calls.
        fn call_ms(&mut self, dev: &CudaDevice, iters: usize, kernel: DecodeKernel) -> R<f64> {
            time_ms(dev, iters, || self.call(dev, Split::Auto, kernel).map(drop))
        }

        /// GB/s of KV read by `kernel` with `split`, and the chunks it
        /// launched per sequence.
        fn gbps(
            &mut self,
            dev: &CudaDevice,
            split: Split,
            kernel: DecodeKernel,
        ) -> R<(f64, usize)> {
            let mut splits = 0;
            let ms = time_ms(dev, 20, || {
                splits = self.call(dev, split, kernel)?;
                Ok(())
            })?;
            Ok((self.kv_bytes as f64 / (ms * 1e-3) / 1e9, splits))
        }
    }

    type R<T> = Result<T, Box<dyn std::error::Error>>;

    /// Milliseconds per call of `f`, by device events around `iters` calls.
    fn time_ms(
        dev: &CudaDevice,
        iters: usize,
        mut f: impl FnMut() -> Result<(), CudaError>,
    ) -> R<f64> {
        for _ in 0..3 {
            f()?;
        }
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = dev.stream().record_event(flags)?;
        for _ in 0..iters {
            f()?;
        }
        let end = dev.stream().record_event(flags)?;
        end.synchronize()?;
        dev.synchronize()?;
        Ok(start.elapsed_ms(&end)? as f64 / iters as f64)
    }

    /// Dense layers of the Llama-3.2-1B shape, `(name, n, k)`.
    const LAYER_SHAPES_1B: [(&str, usize, usize); 3] = [
        ("attention out", 2048, 2048),
        ("mlp up", 8192, 2048),
        ("mlp down", 2048, 8192),
    ];

    /// The dense layers' bf16 tensor-core matmul (cuda/linear_mma.cuh) on
    /// the Llama-3.2-1B shapes, at decode and prefill row counts: TFLOP/s,
    /// weight GB/s as a share of the copy (what bounds a few rows), and the
    /// tile the launch picks. Prints `linear_tflops_m<m>_n<n>_k<k>=X` lines
    /// that gpu-bundle/cublas_reference.py sets beside cuBLAS on the same
    /// shapes.
    fn dense(dev: &CudaDevice, copy: f64) -> R<()> {
        println!("\n## Dense layers: bf16 weights on tensor cores, f32 activations\n");
        println!(
            "| rows (m) | layer [n x k] | tile | ms | TFLOP/s | weight GB/s | share of copy |"
        );
        println!("|---|---|---|---|---|---|---|");
        let mut lines = Vec::new();
        let mut rng = 0x5eed_u64;
        for (name, n, k) in LAYER_SHAPES_1B {
            let w_host: Vec<u16> = random_bf16_bytes(&mut rng, n * k * 2)
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            let w = dev.upload(&w_host)?;
            // The same values as f16 (bf16's 8 significant bits fit f16's
            // 11, and these magnitudes its range): an f16 checkpoint's
            // weights, split into bf16 parts in registers (twice the mma).
            let w_f16 = dev.upload(
                &w_host
                    .iter()
                    .map(|&b| half::f16::from_f32(half::bf16::from_bits(b).to_f32()).to_bits())
                    .collect::<Vec<u16>>(),
            )?;
            for m in [1usize, 8, 64, 256, 1024, 4096] {
                let x_host: Vec<f32> = (0..m * k)
                    .map(|_| (next(&mut rng) >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
                    .collect();
                let x = dev.upload(&x_host)?;
                let mut out = dev.zeros::<f32>(m * n)?;
                let ms = time_ms(dev, 10, || {
                    dev.linear_half(HalfWeights::Bf16, &x, &w, n, &mut out, Write::Store)
                })?;
                let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
                let gbps = (n * k * 2) as f64 / (ms * 1e-3) / 1e9;
                // As CudaDevice::linear_bf16 picks it.
                let tile = if m >= LGEMM_BM {
                    "128 x 64 (pipelined)"
                } else if m >= LMMA_WIDE_BM {
                    "32 x 32"
                } else {
                    "16 x 16"
                };
                println!(
                    "| {m} | {name} [{n} x {k}] | {tile} | {ms:.4} | {tflops:.1} | {gbps:.0} | {:.2} |",
                    // As decode attention's share: bytes read over the
                    // copy's (read + write) rate.
                    gbps / copy
                );
                lines.push(format!("linear_tflops_m{m}_n{n}_k{k}={tflops:.3}"));
                if m == 1 || m == 4096 {
                    let f16_ms = time_ms(dev, 10, || {
                        dev.linear_half(HalfWeights::F16, &x, &w_f16, n, &mut out, Write::Store)
                    })?;
                    lines.push(format!(
                        "linear_f16_time_vs_bf16_m{m}_n{n}_k{k}={:.3} ({f16_ms:.4} ms, bf16 {ms:.4} ms)",
                        f16_ms / ms
                    ));
                }
            }
        }
        // Read by gpu-bundle/cublas_reference.py.
        println!();
        for l in lines {
            println!("{l}");
        }
        Ok(())
    }

    /// The dense layers with f32 weights (f32 checkpoints, quantized GGUF
    /// widened exactly): the SIMT matmul (cuda/linear_f32.cuh) on the same
    /// shapes at decode row counts, with the block shape the launch picks.
    /// Prints `linear_f32_weight_share_m<m>_n<n>_k<k>=X` (weight bytes read
    /// per second over the copy's rate): at batch 1 it bounds the
    /// end-to-end rate of an f32 model.
    fn dense_f32(dev: &CudaDevice, copy: f64) -> R<()> {
        println!("\n## Dense layers: f32 weights on the SIMT cores\n");
        println!(
            "| rows (m) | layer [n x k] | rows a block | ms | TFLOP/s | weight GB/s | share of copy |"
        );
        println!("|---|---|---|---|---|---|---|");
        let mut lines = Vec::new();
        let mut rng = 0xf32_u64;
        for (name, n, k) in LAYER_SHAPES_1B {
            let w_host: Vec<f32> = (0..n * k).map(|_| unit(&mut rng) * 0.05).collect();
            let w = dev.upload(&w_host)?;
            // The same shape in a GGUF checkpoint's blocks (random nibbles
            // and bytes, finite f16 scales), read as stored.
            let blocks: Vec<_> = [QuantWeights::Q4_1, QuantWeights::Q8_0, QuantWeights::Q4K]
                .into_iter()
                .map(|q| {
                    let mut b: Vec<u8> = (0..n * k / q.block_values() * q.block_bytes())
                        .map(|_| next(&mut rng) as u8)
                        .collect();
                    for blk in b.chunks_exact_mut(q.block_bytes()) {
                        let d = half::f16::from_f32(unit(&mut rng) * 0.01).to_le_bytes();
                        blk[..2].copy_from_slice(&d);
                        if q != QuantWeights::Q8_0 {
                            blk[2..4].copy_from_slice(&d);
                        }
                    }
                    dev.upload(&b).map(|d| (q, d, b.len()))
                })
                .collect::<Result<_, _>>()?;
            for m in [1usize, 4, 8, 64, 256] {
                let x_host: Vec<f32> = (0..m * k).map(|_| unit(&mut rng)).collect();
                let x = dev.upload(&x_host)?;
                let mut out = dev.zeros::<f32>(m * n)?;
                if m == 1 || m == 8 {
                    for (q, d, bytes) in &blocks {
                        let qms = time_ms(dev, 10, || {
                            dev.linear_quant(*q, &x, d, n, k, &mut out, Write::Store)
                        })?;
                        let share = *bytes as f64 / (qms * 1e-3) / 1e9 / copy;
                        lines.push(format!(
                            "linear_{q:?}_weight_share_m{m}_n{n}_k{k}={share:.3} ({qms:.4} ms)"
                        ));
                    }
                }
                let ms = time_ms(dev, 10, || dev.linear(&x, &w, n, &mut out, Write::Store))?;
                let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
                let gbps = (n * k * 4) as f64 / (ms * 1e-3) / 1e9;
                // As CudaDevice::linear picks it.
                let rows = match m {
                    1 => LIN_ROWS_ONE,
                    2..=LIN_ROWS_FEW => LIN_ROWS_FEW,
                    _ => LIN_ROWS_MANY,
                };
                println!(
                    "| {m} | {name} [{n} x {k}] | {rows} | {ms:.4} | {tflops:.2} | {gbps:.0} | {:.2} |",
                    gbps / copy
                );
                lines.push(format!(
                    "linear_f32_weight_share_m{m}_n{n}_k{k}={:.3}",
                    gbps / copy
                ));
            }
        }
        println!();
        for l in lines {
            println!("{l}");
        }
        Ok(())
    }

    /// Uniform in [-1, 1).
    fn unit(state: &mut u64) -> f32 {
        (next(state) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn next(state: &mut u64) -> u64 {
        // SplitMix64.
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// bf16 values of magnitude 2^-7..1 with random signs and mantissas.
    fn random_bf16_bytes(state: &mut u64, n_bytes: usize) -> Vec<u8> {
        (0..n_bytes / 2)
            .flat_map(|_| {
                let r = next(state);
                let bits = ((r & 1) << 15) | ((120 + (r >> 1) % 7) << 7) | ((r >> 8) & 0x7f);
                (bits as u16).to_le_bytes()
            })
            .collect()
    }

    /// Finite E4M3 bytes below 2 in magnitude (exponent's top bit clear:
    /// no NaN).
    fn random_fp8_bytes(state: &mut u64, n_bytes: usize) -> Vec<u8> {
        (0..n_bytes)
            .map(|_| (next(state) >> 56) as u8 & 0xBF)
            .collect()
    }

    /// One causal prompt of `len` positions on pages of 16 filled by
    /// `bytes`, and its page table.
    fn prompt_arena(
        dev: &CudaDevice,
        g: KvGeometry,
        len: usize,
        rng: &mut u64,
        bytes: fn(&mut u64, usize) -> Vec<u8>,
    ) -> R<(DeviceKvArena, PageTables)> {
        let ps = 16;
        let mut arena = DeviceKvArena::new(dev, g, ps, len / ps)?;
        for page in 0..(len / ps) as u32 {
            let b = bytes(rng, arena.page_bytes());
            arena.write_page(dev, page, &b)?;
        }
        let pages: Vec<u32> = (0..(len / ps) as u32).collect();
        let pt = PageTables::new(
            dev,
            &arena,
            &[SeqPages {
                pages: &pages,
                kv_len: len,
                q_len: len,
            }],
        )?;
        Ok((arena, pt))
    }

    fn copy_gbps(dev: &CudaDevice) -> R<f64> {
        let n = 1usize << 30;
        let src = dev.zeros::<u8>(n)?;
        let mut dst = dev.zeros::<u8>(n)?;
        let ms = time_ms(dev, 20, || {
            dev.stream()
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| CudaError::Driver {
                    during: "copy",
                    detail: e.to_string(),
                })
        })?;
        Ok(2.0 * n as f64 / (ms * 1e-3) / 1e9)
    }

    /// Split-KV chunk sizes against Auto's (at least 1024 positions, at most
    /// 64 chunks) on both tensor-core kernels (4 and 8 warps a block), GQA
    /// 32:4, page 16, at the goal cells: what a GPU run needs to tune
    /// `MIN_CHUNK` / `AUTO_MAX_SPLITS` for either. A kernel the device
    /// refuses prints one line instead of its row.
    fn chunk_sweep(dev: &CudaDevice, copy: f64) -> R<()> {
        const CHUNKS: [usize; 7] = [64, 128, 256, 512, 1024, 2048, 4096];
        let g = KvGeometry {
            n_layers: 1,
            n_kv_heads: 4,
            head_dim: 128,
            dtype: KvDtype::BF16,
        };
        println!(
            "\n## Decode chunking (tensor cores, GQA 32:4, page 16): share of copy (chunks per \
             sequence)\n"
        );
        let heads: Vec<String> = CHUNKS.iter().map(|c| format!("chunk {c}")).collect();
        println!(
            "| batch | context | kernel | Auto | {} |",
            heads.join(" | ")
        );
        println!("|---|---|---|---|{}", "---|".repeat(CHUNKS.len()));
        for (batch, ctx) in [
            (1usize, 8192usize),
            (1, 32768),
            (1, 131072),
            (8, 8192),
            (64, 8192),
        ] {
            let mut cell = match DecodeCell::new(dev, g, 32, 16, batch, ctx) {
                Ok(c) => c,
                Err(e) => {
                    println!("| {batch} | {ctx} | skipped: {e} |");
                    continue;
                }
            };
            for kernel in [DecodeKernel::TensorCore, DecodeKernel::TensorCoreWide] {
                let mut row = vec![];
                for split in std::iter::once(Split::Auto).chain(CHUNKS.map(Split::ChunkTokens)) {
                    match cell.gbps(dev, split, kernel) {
                        Ok((gbps, splits)) => row.push(format!("{:.2} ({splits})", gbps / copy)),
                        Err(e) if kernel == DecodeKernel::TensorCoreWide => {
                            row = vec![format!("FAILED: {e}")];
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
                println!("| {batch} | {ctx} | {kernel:?} | {} |", row.join(" | "));
            }
        }
        Ok(())
    }

    /// What one decode call costs however little it reads: device µs per
    /// call (events around back-to-back calls) and the host's µs to queue
    /// one, at batch 1 (GQA 32:4, bf16, page 16). Where the host's figure
    /// is the larger, the device waits on the host between calls.
    fn call_floor(dev: &CudaDevice) -> R<()> {
        const CALLS: usize = 200;
        let g = KvGeometry {
            n_layers: 1,
            n_kv_heads: 4,
            head_dim: 128,
            dtype: KvDtype::BF16,
        };
        println!("\n## Decode per-call cost, batch 1 (GQA 32:4, bf16, page 16)\n");
        println!(
            "| context | kernel | merge overlaps the split launch | chunks | device µs per call | \
             host µs to queue a call |"
        );
        println!("|---|---|---|---|---|---|");
        let overlap = dev.launch_overlap();
        for ctx in [16usize, 2048, 32768] {
            let mut cell = DecodeCell::new(dev, g, 32, 16, 1, ctx)?;
            // With and without the overlap where the device has it.
            let runs: &[(DecodeKernel, bool)] = if overlap {
                // (Compute capability 9.0: the wide kernel's shared memory
                // is there too.)
                &[
                    (DecodeKernel::TensorCore, true),
                    (DecodeKernel::TensorCore, false),
                    (DecodeKernel::TensorCoreWide, true),
                    (DecodeKernel::Scalar, true),
                ]
            } else {
                &[
                    (DecodeKernel::TensorCore, false),
                    (DecodeKernel::Scalar, false),
                ]
            };
            for &(kernel, on) in runs {
                dev.set_launch_overlap(on);
                let device_us = 1e3 * cell.call_ms(dev, CALLS, kernel)?;
                let start = std::time::Instant::now();
                let mut chunks = 0;
                for _ in 0..CALLS {
                    chunks = cell.call(dev, Split::Auto, kernel)?;
                }
                let host_us = start.elapsed().as_secs_f64() * 1e6 / CALLS as f64;
                dev.synchronize()?;
                println!(
                    "| {ctx} | {kernel:?} | {on} | {chunks} | {device_us:.1} | {host_us:.1} |"
                );
            }
        }
        dev.set_launch_overlap(true);
        Ok(())
    }

    pub fn run() -> R<()> {
        let Some(dev) = device_for_test("cuda_attention") else {
            return Ok(());
        };
        let max_gib: f64 = std::env::var("HANDOFF_BENCH_MAX_GIB")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(80.0);
        println!(
            "# cuda_attention on {} ({} SMs)\n",
            dev.name(),
            dev.sm_count()
        );
        let copy = copy_gbps(&dev)?;
        println!("device-to-device copy: {copy:.0} GB/s (read + write)\n");
        let spec = spec_gbps(dev.name());
        let h200 = spec.is_some();
        if let Some(spec) = spec {
            println!(
                "`vs FlashInfer`: GB/s over {FLASHINFER_DECODE_SPEC_SHARE} of the {spec:.0} GB/s \
                 spec bandwidth, at contexts of 8k and more (its published long-context share)\n"
            );
        }

        let hd = 128usize;
        // What Auto runs, the wide tensor-core kernel (eight warps a block,
        // not yet timed), then the scalar reference: the "vs scalar" column
        // divides by the last.
        let kernels = [
            DecodeKernel::TensorCore,
            DecodeKernel::TensorCoreWide,
            DecodeKernel::Scalar,
        ];
        let scalar = kernels.len() - 1;
        let mut shares = Vec::new();
        for (n_heads, n_kv, cells) in [
            (32usize, 4usize, DECODE_CELLS_32_4),
            (32, 8, DECODE_CELLS_32_8),
        ] {
            let g = KvGeometry {
                n_layers: 1,
                n_kv_heads: n_kv,
                head_dim: hd,
                dtype: KvDtype::BF16,
            };
            println!(
                "## Decode attention, GQA {n_heads}:{n_kv}, head_dim 128, bf16 KV: GB/s (share of \
                 copy)\n"
            );
            println!(
                "| batch | context | kernel | page 16 | page 64 | p16/p64 | vs scalar (p16) | \
                 vs FlashInfer (p16) | splits |"
            );
            println!("|---|---|---|---|---|---|---|---|---|");
            for &(batch, ctx) in cells {
                let kv_bytes = batch * ctx * g.bytes_per_token();
                if kv_bytes as f64 > max_gib * (1u64 << 30) as f64 {
                    println!(
                        "| {batch} | {ctx} | | skipped: {:.0} GiB > {max_gib} GiB | | | | | |",
                        kv_bytes as f64 / (1u64 << 30) as f64
                    );
                    continue;
                }
                // GB/s per kernel, page 16 then 64.
                // NaN where the kernel was refused (the wide one on a device
                // without its shared memory), printed as such.
                let mut gbps = [[0.0f64; 2]; 3];
                let mut refused = [None, None, None];
                let mut splits = 0;
                let mut no_memory = None;
                for (pi, ps) in [16usize, 64].into_iter().enumerate() {
                    // An allocation failure skips the cell, not the run.
                    let mut cell = match DecodeCell::new(&dev, g, n_heads, ps, batch, ctx) {
                        Ok(c) => c,
                        Err(e) => {
                            no_memory = Some(e);
                            break;
                        }
                    };
                    for (ki, &kernel) in kernels.iter().enumerate() {
                        match cell.gbps(&dev, Split::Auto, kernel) {
                            Ok((g, s)) => (gbps[ki][pi], splits) = (g, s),
                            Err(e) if kernel == DecodeKernel::TensorCoreWide => {
                                gbps[ki][pi] = f64::NAN;
                                refused[ki] = Some(e);
                            }
                            Err(e) => return Err(e),
                        }
                    }
                }
                if let Some(e) = no_memory {
                    println!("| {batch} | {ctx} | | skipped: {e} | | | | | |");
                    continue;
                }
                for (ki, kernel) in kernels.iter().enumerate() {
                    if let Some(e) = &refused[ki] {
                        println!("| {batch} | {ctx} | {kernel:?} | FAILED: {e} | | | | | |");
                        continue;
                    }
                    let [p16, p64] = gbps[ki];
                    let vs = if ki == scalar {
                        String::new()
                    } else {
                        format!("{:.2}", p16 / gbps[scalar][0])
                    };
                    let fi = match spec {
                        Some(spec) if ctx >= 8192 => {
                            format!("{:.2}", p16 / (FLASHINFER_DECODE_SPEC_SHARE * spec))
                        }
                        _ => String::new(),
                    };
                    println!(
                        "| {batch} | {ctx} | {kernel:?} | {p16:.0} ({:.2}) | {p64:.0} ({:.2}) | \
                         {:.2} | {vs} | {fi} | {splits} |",
                        p16 / copy,
                        p64 / copy,
                        p16 / p64
                    );
                }
                if n_kv == 4 && matches!((batch, ctx), (8, 8192) | (1, 32768)) {
                    // What Auto runs (tensor cores for bf16), page 16.
                    shares.push(format!(
                        "decode_copy_share_b{batch}_ctx{}k={:.3}",
                        ctx / 1024,
                        gbps[0][0] / copy
                    ));
                    // The wide kernel on the same cell, beside it (NaN if
                    // refused), and its gain over the 4-warp kernel.
                    shares.push(format!(
                        "decode_wide_copy_share_b{batch}_ctx{}k={:.3} (x{:.2} the 4-warp kernel)",
                        ctx / 1024,
                        gbps[1][0] / copy,
                        gbps[1][0] / gbps[0][0]
                    ));
                    // The same cell with the merge launched only after the
                    // split launch has ended, side by side.
                    if dev.launch_overlap() {
                        let mut cell = DecodeCell::new(&dev, g, n_heads, 16, batch, ctx)?;
                        dev.set_launch_overlap(false);
                        let off = cell.gbps(&dev, Split::Auto, DecodeKernel::TensorCore);
                        dev.set_launch_overlap(true);
                        let on = cell.gbps(&dev, Split::Auto, DecodeKernel::TensorCore)?.0;
                        shares.push(format!(
                            "(batch {batch}, {}k: merge overlapping the split launch {:.3}, \
                             after it {:.3})",
                            ctx / 1024,
                            on / copy,
                            off?.0 / copy
                        ));
                    }
                }
            }
            println!();
        }
        for line in &shares {
            println!("{line}");
        }

        // FP8 KV: half the bytes. Its tensor-core decode widens each landed
        // tile to f16 in shared memory; what counts for a step is the time
        // per call against bf16 KV on tensor cores (what Auto runs for
        // both), with FP8 on the scalar kernel beside them.
        println!(
            "\n## Decode attention, FP8 KV against bf16 KV, GQA 32:4, head_dim 128, page 16: \
             us per call\n"
        );
        println!(
            "| batch | context | bf16 (tensor cores) | FP8 (tensor cores) | FP8 GB/s (share of copy) \
             | FP8 (scalar) | FP8 / bf16 time |"
        );
        println!("|---|---|---|---|---|---|---|");
        let mut fp8_lines = Vec::new();
        for (batch, ctx) in [(1usize, 32768usize), (8, 8192), (32, 8192)] {
            let geometry = |dtype| KvGeometry {
                n_layers: 1,
                n_kv_heads: 4,
                head_dim: hd,
                dtype,
            };
            let mut bf16 = DecodeCell::new(&dev, geometry(KvDtype::BF16), 32, 16, batch, ctx)?;
            let bf16_us = bf16.call_ms(&dev, 20, DecodeKernel::TensorCore)? * 1e3;
            drop(bf16);
            let mut fp8 = DecodeCell::new(&dev, geometry(KvDtype::F8E4M3), 32, 16, batch, ctx)?;
            let tc_us = fp8.call_ms(&dev, 20, DecodeKernel::TensorCore)? * 1e3;
            let scalar_us = fp8.call_ms(&dev, 20, DecodeKernel::Scalar)? * 1e3;
            let gbps = fp8.kv_bytes as f64 / (tc_us * 1e-6) / 1e9;
            println!(
                "| {batch} | {ctx} | {bf16_us:.1} | {tc_us:.1} | {gbps:.0} ({:.2}) | {scalar_us:.1} \
                 | {:.2} |",
                gbps / copy,
                tc_us / bf16_us
            );
            fp8_lines.push(format!(
                "decode_fp8_time_vs_bf16_b{batch}_ctx{}k={:.3}",
                ctx / 1024,
                tc_us / bf16_us
            ));
        }
        for line in &fp8_lines {
            println!("{line}");
        }

        println!("\n## Prefill attention, causal, 32:8 heads, head_dim 128, bf16 KV, page 16\n");
        println!(
            "| prompt | kernel | ms | TFLOP/s | share of 989 TFLOP/s bf16 peak | vs FA2 ({FA2_TFLOPS}) \
             | vs FA3 ({FA3_TFLOPS}) |"
        );
        println!("|---|---|---|---|---|---|---|");
        let n_heads = 32;
        let g = KvGeometry {
            n_layers: 1,
            n_kv_heads: 8,
            head_dim: hd,
            dtype: KvDtype::BF16,
        };
        let (mut tc_8k, mut wide_8k, mut tc_8k_ms) = (None, None, None);
        for len in [1024usize, 4096, 8192] {
            // Random finite inputs (zeros would let the GPU clock higher).
            let mut rng = 0x1234_5678_u64 + len as u64;
            let (arena, pt) = prompt_arena(&dev, g, len, &mut rng, random_bf16_bytes)?;
            let q_host: Vec<f32> = (0..len * n_heads * hd)
                .map(|_| (next(&mut rng) >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
                .collect();
            let q = dev.upload(&q_host)?;
            let mut out = dev.zeros::<f32>(len * n_heads * hd)?;
            for kernel in [
                PrefillKernel::TensorCore,
                PrefillKernel::TensorCoreWide,
                PrefillKernel::Scalar,
            ] {
                let ms = time_ms(&dev, 3, || {
                    dev.prefill_attention(
                        AttnKv {
                            arena: &arena,
                            tables: &pt,
                            layer: 0,
                            n_heads,
                        },
                        &q,
                        &mut out,
                        kernel,
                    )
                    .map(drop)
                })?;
                // QK^T and PV over the causal triangle: 2 * 2 * heads * hd * L(L+1)/2.
                let flops = 4.0 * n_heads as f64 * hd as f64 * (len * (len + 1) / 2) as f64;
                let tflops = flops / (ms * 1e-3) / 1e12;
                // FlashAttention's published figures are for long causal
                // prompts at head_dim 128 on Hopper: the 8k row, on an H200.
                let (fa2, fa3) = if h200 && len == 8192 {
                    (
                        format!("{:.2}", tflops / FA2_TFLOPS),
                        format!("{:.2}", tflops / FA3_TFLOPS),
                    )
                } else {
                    (String::new(), String::new())
                };
                println!(
                    "| {len} | {kernel:?} | {ms:.2} | {tflops:.1} | {:.3} | {fa2} | {fa3} |",
                    tflops / 989.0
                );
                if len == 8192 && kernel == PrefillKernel::TensorCore {
                    tc_8k = Some(tflops);
                    tc_8k_ms = Some(ms);
                }
                if len == 8192 && kernel == PrefillKernel::TensorCoreWide {
                    wide_8k = Some(tflops);
                }
            }
        }
        // FP8 KV: the 8k prompt on tensor cores, each landed tile widened to
        // f16, against bf16 KV's time above.
        {
            let len = 8192usize;
            let g8 = KvGeometry {
                dtype: KvDtype::F8E4M3,
                ..g
            };
            let mut rng = 0x5eed_u64;
            let (arena, pt) = prompt_arena(&dev, g8, len, &mut rng, random_fp8_bytes)?;
            let q = dev.upload(&vec![0.25f32; len * n_heads * hd])?;
            let mut out = dev.zeros::<f32>(len * n_heads * hd)?;
            let ms = time_ms(&dev, 3, || {
                dev.prefill_attention(
                    AttnKv {
                        arena: &arena,
                        tables: &pt,
                        layer: 0,
                        n_heads,
                    },
                    &q,
                    &mut out,
                    PrefillKernel::TensorCore,
                )
                .map(drop)
            })?;
            let flops = 4.0 * n_heads as f64 * hd as f64 * (len * (len + 1) / 2) as f64;
            let tflops = flops / (ms * 1e-3) / 1e12;
            println!(
                "| {len} | TensorCore, FP8 KV | {ms:.2} | {tflops:.1} | {:.3} | | |",
                tflops / 989.0
            );
            if let Some(bf16_ms) = tc_8k_ms {
                println!("\nprefill_fp8_time_vs_bf16_8k={:.3}", ms / bf16_ms);
            }
        }
        // Read by gpu-bundle/cublas_reference.py: the kernel Auto runs, and
        // the wide one (same bits), which Auto takes once it has won here.
        if let Some(t) = tc_8k {
            println!("\nprefill_tc_tflops_8k={t:.3}");
        }
        if let Some(t) = wide_8k {
            println!("prefill_tc_wide_tflops_8k={t:.3}");
        }
        dense(&dev, copy)?;
        dense_f32(&dev, copy)?;
        // Last: tuning data, the first thing to lose if the run is cut short.
        call_floor(&dev)?;
        chunk_sweep(&dev, copy)
    }
}
