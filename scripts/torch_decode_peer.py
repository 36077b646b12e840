#!/usr/bin/env python3
"""The peer figure for benches/cuda_decode.rs: the same model in torch.

A plain Hugging Face-style bf16 forward of the Llama-3.2-1B shape (dim 2048,
32/8 heads of 64, SwiGLU 8192, vocab 128,256, tied embeddings, RoPE theta
500,000), random weights, a static KV cache, greedy decoding, on the same
GPU: an 8-token prompt per sequence, then 32 timed decode steps, at batch 1
and 64. `HANDOFF_BENCH_LAYERS` sets the layers (default 16, as the bench).

Prints `torch_b1_tokens_per_s=X` and `torch_b64_tokens_per_s=X`. Exits 2
(skipped, not failed) when torch or a CUDA device is missing.
"""
import os
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("SKIP torch_decode_peer: torch is not installed")
    sys.exit(2)
if not torch.cuda.is_available():
    print("SKIP torch_decode_peer: torch sees no CUDA device")
    sys.exit(2)

DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2048, 32, 8, 64, 8192, 128256
THETA, EPS = 500000.0, 1e-5
LAYERS = int(os.environ.get("HANDOFF_BENCH_LAYERS", "16"))
PROMPT, STEPS = 8, 32
DEV, DT = torch.device("cuda"), torch.bfloat16


def weight(*shape):
    return torch.randn(*shape, device=DEV, dtype=DT) * 0.02


torch.manual_seed(1)
LAYER_W = [
    {
        "wq": weight(HEADS * HEAD_DIM, DIM),
        "wk": weight(KV_HEADS * HEAD_DIM, DIM),
        "wv": weight(KV_HEADS * HEAD_DIM, DIM),
        "wo": weight(DIM, HEADS * HEAD_DIM),
        "w1": weight(FFN, DIM),
        "w3": weight(FFN, DIM),
        "w2": weight(DIM, FFN),
        "n1": torch.ones(DIM, device=DEV, dtype=DT),
        "n2": torch.ones(DIM, device=DEV, dtype=DT),
    }
    for _ in range(LAYERS)
]
EMB = weight(VOCAB, DIM)
FINAL_NORM = torch.ones(DIM, device=DEV, dtype=DT)
MAX_LEN = PROMPT + STEPS + 4
INV_FREQ = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, device=DEV).float() / HEAD_DIM))
ANGLES = torch.outer(torch.arange(MAX_LEN, device=DEV).float(), INV_FREQ)
COS = torch.cat([ANGLES.cos(), ANGLES.cos()], dim=-1).to(DT)  # [MAX_LEN, HEAD_DIM]
SIN = torch.cat([ANGLES.sin(), ANGLES.sin()], dim=-1).to(DT)


def rms(x, g):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(DT) * g


def rope(x, start):
    # x: [B, H, T, D]; rotate_half as in Hugging Face Llama.
    t = x.shape[2]
    cos, sin = COS[start : start + t], SIN[start : start + t]
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def forward(tokens, start, cache_k, cache_v):
    """Logits of the last position; appends the KV of `tokens` at `start`."""
    b, t = tokens.shape
    x = EMB[tokens]
    for i, lw in enumerate(LAYER_W):
        h = rms(x, lw["n1"])
        q = (h @ lw["wq"].T).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = (h @ lw["wk"].T).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = (h @ lw["wv"].T).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = rope(q, start), rope(k, start)
        cache_k[i][:, :, start : start + t] = k
        cache_v[i][:, :, start : start + t] = v
        keys = cache_k[i][:, :, : start + t].repeat_interleave(HEADS // KV_HEADS, dim=1)
        values = cache_v[i][:, :, : start + t].repeat_interleave(HEADS // KV_HEADS, dim=1)
        a = F.scaled_dot_product_attention(q, keys, values, is_causal=t > 1)
        x = x + a.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM) @ lw["wo"].T
        h = rms(x, lw["n2"])
        x = x + (F.silu(h @ lw["w1"].T) * (h @ lw["w3"].T)) @ lw["w2"].T
    return rms(x[:, -1], FINAL_NORM) @ EMB.T


@torch.inference_mode()
def decode_rate(batch):
    shape = (batch, KV_HEADS, MAX_LEN, HEAD_DIM)
    cache_k = [torch.zeros(shape, device=DEV, dtype=DT) for _ in range(LAYERS)]
    cache_v = [torch.zeros(shape, device=DEV, dtype=DT) for _ in range(LAYERS)]
    prompt = (torch.arange(batch * PROMPT, device=DEV).view(batch, PROMPT) * 17 + 1) % VOCAB
    nxt = forward(prompt, 0, cache_k, cache_v).argmax(-1, keepdim=True)
    pos = PROMPT
    nxt = forward(nxt, pos, cache_k, cache_v).argmax(-1, keepdim=True)  # warm-up
    pos += 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        nxt = forward(nxt, pos, cache_k, cache_v).argmax(-1, keepdim=True)
        pos += 1
    torch.cuda.synchronize()
    return batch * STEPS / (time.perf_counter() - t0)


def main():
    print(
        f"## torch {torch.__version__} on {torch.cuda.get_device_name()}: Llama-3.2-1B shape, "
        f"{LAYERS} layers, bf16 weights and static KV cache, greedy"
    )
    for batch in (1, 64):
        print(f"torch_b{batch}_tokens_per_s={decode_rate(batch):.1f}")


if __name__ == "__main__":
    main()
