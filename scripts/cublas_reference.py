#!/usr/bin/env python3
"""cuBLAS reference for the prefill benchmark, run by gpu-bundle/run.sh.

The crate does not link cuBLAS (the GPU machine has libcublas only inside
its torch install). This script times torch's bf16 GEMMs, which run on
cuBLAS, on the same GPU in the same run as benches/cuda_attention.rs, and
prints the tensor-core prefill figure as a share of them:

  - attention-shaped: 32 heads of [8192 x 128] x [128 x 8192] (Q K^T of
    the benchmarked 8k prefill, batched), f32 accumulate, bf16 out;
  - square: [8192 x 8192] x [8192 x 8192], cuBLAS near its peak;
  - the dense layers the bench printed `linear_tflops_...` lines for.

Timing: CUDA events around 10 calls after 3 warm-up calls.

Usage: cublas_reference.py BENCH_OUTPUT   (the bench's stdout; the line
`prefill_tc_tflops_8k=<x>` is read from it). Prints markdown.
"""
import re
import sys


def tflops(fn, flops, iters=10, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / iters
    return ms, flops / (ms * 1e-3) / 1e12


def main():
    bench = open(sys.argv[1]).read() if len(sys.argv) > 1 else ""
    m = re.search(r"^prefill_tc_tflops_8k=([0-9.]+)$", bench, re.M)
    prefill = float(m.group(1)) if m else None
    m = re.search(r"^prefill_tc_wide_tflops_8k=([0-9.]+)$", bench, re.M)
    wide = float(m.group(1)) if m else None
    try:
        import torch
    except ImportError as e:
        print(f"cuBLAS reference skipped: torch not importable ({e})")
        return 2
    if not torch.cuda.is_available():
        print("cuBLAS reference skipped: torch sees no CUDA device")
        return 2
    torch.manual_seed(0)
    dev = "cuda"
    print(f"## cuBLAS (torch {torch.__version__}, {torch.cuda.get_device_name(0)}) bf16 GEMM\n")
    print("| shape | ms | TFLOP/s | tensor-core prefill 8k as a share |")
    print("|---|---|---|---|")
    h, l, d = 32, 8192, 128
    q = torch.randn(h, l, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(h, d, l, device=dev, dtype=torch.bfloat16)
    out = torch.empty(h, l, l, device=dev, dtype=torch.bfloat16)
    cases = [
        ("32 x [8192x128]·[128x8192] (QKᵀ of the 8k prefill)",
         lambda: torch.bmm(q, k, out=out), 2.0 * h * l * l * d),
    ]
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    cases.append(("[8192x8192]·[8192x8192]", lambda: torch.mm(a, b, out=c), 2.0 * n * n * n))
    qk = None
    for name, fn, flops in cases:
        ms, t = tflops(fn, flops)
        qk = t if qk is None else qk
        share = f"{prefill / t:.3f}" if prefill else "n/a (no prefill figure)"
        print(f"| {name} | {ms:.3f} | {t:.1f} | {share} |")
    if prefill is None:
        print("\nthe bench printed no prefill_tc_tflops_8k line")
    else:
        print(f"\ntensor-core prefill, causal 8k, head_dim 128: {prefill:.1f} TFLOP/s"
              f" ({prefill / 989.0:.3f} of the 989 TFLOP/s bf16 peak)")
        # Issue 16's figure: the share of cuBLAS on the QK^T shape of the same prefill.
        print(f"prefill_cublas_share_8k={prefill / qk:.3f}")
    if wide is not None:
        # The wide kernel (128 rows a block, the same bits), not yet Auto's choice.
        print(f"prefill_wide_cublas_share_8k={wide / qk:.3f}"
              f" ({wide:.1f} TFLOP/s, {wide / 989.0:.3f} of the bf16 peak)")
    dense_against_cublas(bench, dev)
    return 0 if prefill is not None else 1


def dense_against_cublas(bench, dev):
    """The bench's `linear_tflops_m<m>_n<n>_k<k>=X` lines (the crate's bf16
    tensor-core matmul, f32 activations split into two bf16 parts) beside
    torch's bf16 x · wᵀ on the same shapes (bf16 activations, one pass)."""
    import torch

    rows = [(int(m), int(n), int(k), float(t)) for m, n, k, t in re.findall(
        r"^linear_tflops_m(\d+)_n(\d+)_k(\d+)=([0-9.]+)$", bench, re.M)]
    if not rows:
        print("\nthe bench printed no linear_tflops lines")
        return
    print("\n## Dense layers against cuBLAS (torch bf16 x · wᵀ, same shapes)\n")
    print("| rows (m) | [n x k] | cuBLAS ms | cuBLAS TFLOP/s | handoff TFLOP/s | share |")
    print("|---|---|---|---|---|---|")
    for m, n, k, ours in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        ms, t = tflops(lambda: torch.mm(x, w.t(), out=out), 2.0 * m * n * k)
        print(f"| {m} | [{n} x {k}] | {ms:.4f} | {t:.1f} | {ours:.1f} | {ours / t:.3f} |")
        if m == 4096:
            print(f"linear_cublas_share_m4096_n{n}_k{k}={ours / t:.3f}")


if __name__ == "__main__":
    sys.exit(main())
