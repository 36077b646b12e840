//! The plans' unit tests (sizes only, no device).

use super::*;

fn attn(dtype: KvDtype, head_dim: usize, n_kv_heads: usize, n_heads: usize) -> Attn {
    let g = KvGeometry {
        n_layers: 2,
        n_kv_heads,
        head_dim,
        dtype,
    };
    Attn::new(&g, 16, 16 * 2 * 2 * n_kv_heads * head_dim, 1, n_heads).unwrap()
}

fn batch(batch: usize, max_kv_len: usize) -> Batch {
    Batch {
        batch,
        total_q: batch,
        max_q_len: 1,
        max_kv_len,
    }
}

/// Plans decode with q and out of the right size, on the scalar kernel
/// (which every dtype and head dim has).
fn plan_decode(a: &Attn, b: &Batch, split: Split) -> Result<DecodePlan, CudaError> {
    plan_decode_on(a, b, split, DecodeKernel::Scalar).map(|(_, p)| p)
}

fn plan_decode_on(
    a: &Attn,
    b: &Batch,
    split: Split,
    kernel: DecodeKernel,
) -> Result<(DecodeKernel, DecodePlan), CudaError> {
    let rows = b.batch * a.n_heads * a.head_dim;
    decode(a, b, rows, rows, split, kernel)
}

fn decode_params(p: &DecodePlan) -> &DecodeParams {
    match p {
        DecodePlan::Whole(s) | DecodePlan::Split { attn: s, .. } => &s.params,
        DecodePlan::Empty => panic!("nothing planned"),
    }
}

#[test]
fn auto_split_cuts_by_the_longest_length_into_at_most_64_chunks_of_1024_or_more() {
    let a = attn(KvDtype::F16, 64, 2, 8);
    for (max_len, splits) in [
        (1, 1),
        (1024, 1),
        (1025, 2),
        (8191, 8),
        (32_768, 32),
        (65_536, 64),
        (65_537, 64),
        (131_072, 64),
        (1 << 20, 64),
    ] {
        let p = plan_decode(&a, &batch(3, max_len), Split::Auto).unwrap();
        assert_eq!(p.splits(), splits, "max_len {max_len}");
        let params = decode_params(&p);
        assert_eq!((params.chunk_tokens, params.auto_max_splits), (1024, 64));
        assert_eq!(params.num_splits as usize, splits);
        assert_eq!(matches!(p, DecodePlan::Whole(_)), splits == 1);
    }
}

#[test]
fn a_sequence_s_auto_chunks_do_not_depend_on_its_batch_mates() {
    // What a sequence computes depends on chunk_tokens and
    // auto_max_splits (the kernel cuts its own length with them); a
    // longer mate only adds blocks that find no positions.
    let a = attn(KvDtype::BF16, 128, 8, 32);
    let alone = plan_decode(&a, &batch(1, 5000), Split::Auto).unwrap();
    let with_mate = plan_decode(&a, &batch(2, 100_000), Split::Auto).unwrap();
    let (p1, p2) = (decode_params(&alone), decode_params(&with_mate));
    assert_eq!(p1.chunk_tokens, p2.chunk_tokens);
    assert_eq!(p1.auto_max_splits, p2.auto_max_splits);
    assert!(p2.num_splits >= p1.num_splits);
}

#[test]
fn fixed_chunks_cover_the_longest_sequence() {
    let a = attn(KvDtype::F32, 32, 1, 1);
    for (chunk, max_len, want_chunk, splits) in [
        (128, 1000, 128, 8),
        (1000, 1000, 1000, 1),
        (5000, 1000, 1000, 1),
        (1, 7, 1, 7),
    ] {
        let p = plan_decode(&a, &batch(2, max_len), Split::ChunkTokens(chunk)).unwrap();
        let params = decode_params(&p);
        assert_eq!(
            params.chunk_tokens as usize, want_chunk,
            "{chunk} over {max_len}"
        );
        assert_eq!(params.auto_max_splits, 0);
        assert_eq!(p.splits(), splits, "{chunk} over {max_len}");
    }
}

#[test]
fn the_workspace_holds_every_chunk_of_every_head_and_the_merge_reads_it() {
    let a = attn(KvDtype::F16, 64, 2, 8);
    let p = plan_decode(&a, &batch(3, 1000), Split::ChunkTokens(100)).unwrap();
    let DecodePlan::Split {
        attn,
        merge,
        workspace,
    } = p
    else {
        panic!("ten chunks need a merge: {p:?}");
    };
    assert_eq!(attn.grid, (10, 2, 3));
    assert_eq!(merge.grid, (8, 3, 1));
    assert_eq!(
        workspace,
        Workspace {
            part_o: 3 * 8 * 10 * 64,
            part_lse: 3 * 8 * 10
        }
    );
    let m = merge.params;
    assert_eq!(
        (m.batch, m.n_heads, m.head_dim, m.num_splits),
        (3, 8, 64, 10)
    );
}

#[test]
fn decode_takes_the_smallest_compiled_group_that_holds_the_ratio() {
    for (n_heads, want) in [
        (2, "g1"),
        (4, "g2"),
        (6, "g4"),
        (8, "g4"),
        (10, "g8"),
        (16, "g8"),
        // Ratios of 16 and more: the largest group, in head slices.
        (32, "g8"),
        (36, "g8"),
    ] {
        let a = attn(KvDtype::F16, 64, 2, n_heads);
        let p = plan_decode(&a, &batch(1, 10), Split::Auto).unwrap();
        let DecodePlan::Whole(step) = p else {
            panic!("{p:?}")
        };
        let symbol = step.kernel.id().spec().symbol;
        assert_eq!(symbol, format!("decode_attention_f16_d64_{want}"));
        assert_eq!(step.params.group as usize, n_heads / 2);
        let slices = (n_heads / 2).div_ceil(8).max(1) as u32;
        assert_eq!(step.grid.1, 2 * slices, "grid.y: KV heads x slices");
    }
}

#[test]
fn auto_decodes_f16_bf16_and_fp8_kv_on_tensor_cores_in_octets_of_heads() {
    for (dtype, head_dim, n_heads, want) in [
        (KvDtype::F8E4M3, 128, 16, Some("decode_mma_fp8_d128_g8")),
        (KvDtype::F8E4M3, 64, 32, Some("decode_mma_fp8_d64_g16")),
        (KvDtype::BF16, 128, 64, Some("decode_mma_bf16_d128_g16")),
        (KvDtype::BF16, 128, 16, Some("decode_mma_bf16_d128_g8")),
        (KvDtype::F16, 64, 2, Some("decode_mma_f16_d64_g8")),
        (KvDtype::F16, 64, 18, Some("decode_mma_f16_d64_g16")),
        // Ratios past 16: slices of 16 heads.
        (KvDtype::BF16, 64, 64, Some("decode_mma_bf16_d64_g16")),
        // No tensor-core kernel: the scalar one.
        (KvDtype::F32, 128, 16, None),
        (KvDtype::BF16, 32, 16, None),
        (KvDtype::F8E4M3, 256, 8, None),
    ] {
        let a = attn(dtype, head_dim, 2, n_heads);
        let (chosen, p) =
            plan_decode_on(&a, &batch(1, 10), Split::Auto, DecodeKernel::Auto).unwrap();
        let DecodePlan::Whole(step) = p else {
            panic!("{p:?}")
        };
        let symbol = step.kernel.id().spec().symbol;
        match want {
            Some(want) => {
                assert_eq!(chosen, DecodeKernel::TensorCore);
                assert_eq!(symbol, want);
                let slices = (n_heads / 2).div_ceil(16).max(1) as u32;
                assert_eq!(step.grid.1, 2 * slices, "grid.y: KV heads x slices");
                // The wide kernel only when asked for, on the same grid.
                let (chosen, wide) =
                    plan_decode_on(&a, &batch(1, 10), Split::Auto, DecodeKernel::TensorCoreWide)
                        .unwrap();
                let DecodePlan::Whole(wide) = wide else {
                    panic!("{wide:?}")
                };
                assert_eq!(chosen, DecodeKernel::TensorCoreWide);
                let wide_symbol = want.replace("decode_mma_", "decode_mma_wide_");
                assert_eq!(wide.kernel.id().spec().symbol, wide_symbol);
                assert_eq!(wide.grid, step.grid);
                assert_eq!(wide.kernel.id().spec().threads, 256);
            }
            None => {
                assert_eq!(chosen, DecodeKernel::Scalar);
                assert!(symbol.starts_with("decode_attention_"), "{symbol}");
                for k in [DecodeKernel::TensorCore, DecodeKernel::TensorCoreWide] {
                    let forced = plan_decode_on(&a, &batch(1, 10), Split::Auto, k);
                    assert!(
                        matches!(forced, Err(CudaError::Unsupported { .. })),
                        "{dtype:?} d{head_dim} {k:?}: {forced:?}"
                    );
                }
            }
        }
        // The scalar kernel is there whatever Auto picks.
        let (chosen, _) =
            plan_decode_on(&a, &batch(1, 10), Split::Auto, DecodeKernel::Scalar).unwrap();
        assert_eq!(chosen, DecodeKernel::Scalar);
    }
}

#[test]
fn both_decode_kernels_split_a_sequence_the_same_way() {
    // The chunking is the plan's, not the kernel's: the tensor-core
    // kernel merges the same chunks through the same workspace.
    let a = attn(KvDtype::BF16, 128, 4, 32);
    for split in [Split::Auto, Split::ChunkTokens(100)] {
        let (_, scalar) = plan_decode_on(&a, &batch(3, 9000), split, DecodeKernel::Scalar).unwrap();
        let (_, mma) =
            plan_decode_on(&a, &batch(3, 9000), split, DecodeKernel::TensorCore).unwrap();
        let (
            DecodePlan::Split {
                attn: s,
                workspace: ws,
                ..
            },
            DecodePlan::Split {
                attn: m,
                workspace: wm,
                ..
            },
        ) = (&scalar, &mma)
        else {
            panic!("9000 positions split: {scalar:?} {mma:?}");
        };
        assert_eq!(ws, wm);
        assert_eq!(s.grid, m.grid, "GQA 8:1 is one slice of 8 heads on both");
        let key = |p: &DecodeParams| (p.num_splits, p.chunk_tokens, p.auto_max_splits);
        assert_eq!(key(&s.params), key(&m.params));
    }
}

#[test]
fn decode_refuses_what_no_kernel_can_do_before_anything_is_sized() {
    // A ratio past the largest group is served in slices, not refused.
    let a = attn(KvDtype::F16, 64, 2, 18);
    assert!(plan_decode(&a, &batch(1, 10), Split::Auto).is_ok());
    let a = attn(KvDtype::F16, 64, 2, 4);
    let two_queries = Batch {
        max_q_len: 2,
        ..batch(1, 10)
    };
    assert!(matches!(
        plan_decode(&a, &two_queries, Split::Auto),
        Err(CudaError::Unsupported { .. })
    ));
    assert!(matches!(
        decode(
            &a,
            &batch(1, 10),
            4 * 64,
            2 * 64,
            Split::Auto,
            DecodeKernel::Auto
        ),
        Err(CudaError::Shape { .. })
    ));
    assert!(matches!(
        plan_decode(&a, &batch(1, 0), Split::Auto),
        Err(CudaError::Shape { .. })
    ));
    assert!(matches!(
        plan_decode(&a, &batch(1, 10), Split::ChunkTokens(0)),
        Err(CudaError::Unsupported { .. })
    ));
    assert!(matches!(
        plan_decode(&a, &batch(0, 0), Split::ChunkTokens(0)),
        Ok(DecodePlan::Empty)
    ));
    assert!(matches!(
        plan_decode(&a, &batch(65_536, 10), Split::Auto),
        Err(CudaError::Unsupported { .. })
    ));
}

#[test]
fn the_attention_shape_is_checked_against_the_arena_and_the_compiled_head_dims() {
    let g = |head_dim| KvGeometry {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim,
        dtype: KvDtype::F32,
    };
    assert!(matches!(
        Attn::new(&g(64), 16, 4096, 2, 4),
        Err(CudaError::Shape { .. })
    ));
    assert!(matches!(
        Attn::new(&g(96), 16, 4096, 0, 4),
        Err(CudaError::Unsupported {
            what: "head_dim",
            ..
        })
    ));
    for n_heads in [0, 3] {
        assert!(matches!(
            Attn::new(&g(64), 16, 4096, 0, n_heads),
            Err(CudaError::Unsupported {
                what: "head counts",
                ..
            })
        ));
    }
    let a = Attn::new(&g(64), 16, 4096, 1, 6).unwrap();
    assert_eq!((a.group, a.page_size_log2, a.page_stride), (3, 4, 4096));
}

fn plan_prefill(
    a: &Attn,
    q_lens: &[usize],
    choice: PrefillKernel,
) -> Result<PrefillPlan, CudaError> {
    let total_q: usize = q_lens.iter().sum();
    let b = Batch {
        batch: q_lens.len(),
        total_q,
        max_q_len: q_lens.iter().copied().max().unwrap_or(0),
        max_kv_len: 1000,
    };
    let rows = total_q * a.n_heads * a.head_dim;
    prefill(a, &b, rows, rows, choice)
}

#[test]
fn auto_prefill_takes_tensor_cores_where_compiled_and_the_scalar_kernel_elsewhere() {
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
        for hd in HEAD_DIMS {
            for (n_kv, n_heads) in [(2, 2), (1, 32), (1, 64)] {
                let a = attn(dtype, hd, n_kv, n_heads);
                let compiled = dtype != KvDtype::F32 && PREFILL_MMA_HEAD_DIMS.contains(&hd);
                let what = format!("{dtype:?} d{hd} group {}", a.group);
                let auto = plan_prefill(&a, &[5, 3], PrefillKernel::Auto);
                let auto = auto.as_ref().map(|p| p.chosen);
                let forced = plan_prefill(&a, &[5, 3], PrefillKernel::TensorCore);
                let wide = plan_prefill(&a, &[5, 3], PrefillKernel::TensorCoreWide);
                let scalar = plan_prefill(&a, &[5, 3], PrefillKernel::Scalar);
                let scalar_fits = a.group <= PREFILL_MAX_GROUP;
                if compiled {
                    assert_eq!(auto, Ok(PrefillKernel::TensorCore), "{what}");
                    assert!(
                        forced.as_ref().is_ok_and(|p| p.needs_aligned_rows),
                        "{what}"
                    );
                    let w = wide.as_ref().unwrap();
                    assert_eq!(w.chosen, PrefillKernel::TensorCoreWide, "{what}");
                    assert!(w.needs_aligned_rows, "{what}");
                } else if scalar_fits {
                    assert_eq!(auto, Ok(PrefillKernel::Scalar), "{what}");
                } else {
                    assert!(matches!(auto, Err(CudaError::Unsupported { .. })), "{what}");
                }
                if !compiled {
                    assert!(
                        matches!(forced, Err(CudaError::Unsupported { .. })),
                        "{what}"
                    );
                    assert!(matches!(wide, Err(CudaError::Unsupported { .. })), "{what}");
                }
                if scalar_fits {
                    let s = scalar.unwrap();
                    assert_eq!(s.chosen, PrefillKernel::Scalar, "{what}");
                    assert!(!s.needs_aligned_rows);
                } else {
                    assert!(
                        matches!(scalar, Err(CudaError::Unsupported { .. })),
                        "{what}"
                    );
                }
            }
        }
    }
    // 65 query heads per KV head: more than the scalar and the 64-row
    // kernels' row tiles; the wide kernel's 128 rows hold them.
    let a = attn(KvDtype::BF16, 64, 1, 65);
    assert!(matches!(
        plan_prefill(&a, &[3], PrefillKernel::Auto),
        Err(CudaError::Unsupported { .. })
    ));
    let wide = plan_prefill(&a, &[3], PrefillKernel::TensorCoreWide).unwrap();
    assert_eq!(wide.step.map(|s| s.grid), Some((3, 1, 1))); // 1 position a block
    // 129: more than every row tile.
    let a = attn(KvDtype::BF16, 64, 1, 129);
    assert!(matches!(
        plan_prefill(&a, &[3], PrefillKernel::TensorCoreWide),
        Err(CudaError::Unsupported { .. })
    ));
}

#[test]
fn prefill_tiles_cover_every_query_row_of_the_longest_sequence() {
    // Scalar: 32 (position, head) rows per block; tensor cores: 64 (the
    // wide kernel 128).
    let a = attn(KvDtype::F16, 64, 2, 8);
    let s = plan_prefill(&a, &[17, 40], PrefillKernel::Scalar).unwrap();
    assert_eq!(s.step.map(|s| s.grid), Some((5, 2, 2))); // ceil(40 / (32 / 4))
    let t = plan_prefill(&a, &[17, 40], PrefillKernel::TensorCore).unwrap();
    let step = t.step.unwrap();
    assert_eq!(step.grid, (3, 2, 2)); // ceil(40 / (64 / 4))
    assert_eq!(step.kernel.id().spec().symbol, "prefill_mma_f16_d64");
    assert_eq!((step.params.group, step.params.n_kv_heads), (4, 2));
    // The wide kernel: 128 rows a block.
    let w = plan_prefill(&a, &[17, 40], PrefillKernel::TensorCoreWide).unwrap();
    let step = w.step.unwrap();
    assert_eq!(step.grid, (2, 2, 2)); // ceil(40 / (128 / 4))
    assert_eq!(step.kernel.id().spec().symbol, "prefill_mma_wide_f16_d64");
    // No query rows: nothing to launch, and nothing refused.
    let a = attn(KvDtype::F32, 64, 2, 8);
    let empty = plan_prefill(&a, &[0, 0], PrefillKernel::Auto).unwrap();
    assert!(empty.step.is_none());
    assert!(matches!(
        prefill(&a, &Batch::default(), 0, 8, PrefillKernel::Auto),
        Err(CudaError::Shape { .. })
    ));
}

#[test]
fn a_grid_with_nothing_to_do_launches_nothing() {
    assert!(matches!(grid("t", 0, 4, 4), Ok(None)));
    assert!(matches!(grid("t", 4, 0, 4), Ok(None)));
    assert!(matches!(grid("t", 4, 4, 0), Ok(None)));
    assert!(matches!(grid("t", 1, 1, 1), Ok(Some((1, 1, 1)))));
}

#[test]
fn a_grid_cuda_would_refuse_is_a_typed_error_before_launch() {
    assert!(matches!(grid("t", 1, 65_535, 65_535), Ok(Some(_))));
    for (x, y, z) in [(1, 65_536, 1), (1, 1, 65_536), (1usize << 31, 1, 1)] {
        assert!(
            matches!(
                grid("t", x, y, z),
                Err(CudaError::Unsupported { what: "t", .. })
            ),
            "({x}, {y}, {z})"
        );
    }
}

#[test]
fn grid_stride_launches_cover_everything_within_cuda_s_limit() {
    assert_eq!(grid_stride(0), (1, 1, 1));
    assert_eq!(grid_stride(256), (1, 1, 1));
    assert_eq!(grid_stride(257), (2, 1, 1));
    assert_eq!(grid_stride(usize::MAX / 2), (65_535, 1, 1));
}
