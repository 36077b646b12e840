#!/usr/bin/env python3
"""The peer figure for benches/cuda_decode.rs: the same model in torch.

A plain Hugging Face-style bf16 forward of the Llama-3.2-1B shape (dim 2048,
32/8 heads of 64, SwiGLU 8192, vocab 128,256, tied embeddings, RoPE theta
500,000), random weights, a static KV cache, greedy decoding, on the same
GPU: an 8-token prompt per sequence, then 32 timed decode steps, at batch 1
and 64. `HANDOFF_BENCH_LAYERS` sets the layers (default 16, as the bench).

Two forms of the same step:
  - eager: one Python-driven forward per step (as `model.generate` without
    compilation); the best of 3 timed rounds after 3 warm-up steps, with
    each round's ms per step;
  - graph: the step over the whole static cache (a position tensor, a mask
    of the positions written, index_copy_ into the cache) captured once as
    a CUDA graph and replayed, which takes the host out of the step as
    vLLM's and SGLang's decode graphs do.
One eager step at batch 1 is also profiled (top ops by host time), to say
where an eager step's time goes.

Prints `torch_b1_tokens_per_s=X`, `torch_b64_tokens_per_s=X` (the better
of the two forms) and `torch_graph_b{1,64}_tokens_per_s=X` /
`torch_eager_b{1,64}_tokens_per_s=X`. Exits 2 (skipped, not failed) when
torch or a CUDA device is missing.
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


def rope_at(x, cos, sin):
    # x: [B, H, 1, D]; cos, sin: [1, D] of the step's position.
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def static_step(tok, pos, cache_k, cache_v):
    """One decode step over the whole static cache, with no host-side
    shapes: `tok` [B, 1] and `pos` (a 1-element tensor) in, the next token
    written to `tok` and `pos` advanced in place. Capturable."""
    b = tok.shape[0]
    group = HEADS // KV_HEADS
    x = EMB[tok]
    cos, sin = COS.index_select(0, pos), SIN.index_select(0, pos)
    visible = (torch.arange(MAX_LEN, device=DEV) <= pos).view(1, 1, 1, MAX_LEN)
    for i, lw in enumerate(LAYER_W):
        h = rms(x, lw["n1"])
        q = (h @ lw["wq"].T).view(b, 1, HEADS, HEAD_DIM).transpose(1, 2)
        k = (h @ lw["wk"].T).view(b, 1, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = (h @ lw["wv"].T).view(b, 1, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = rope_at(q, cos, sin), rope_at(k, cos, sin)
        cache_k[i].index_copy_(2, pos, k)
        cache_v[i].index_copy_(2, pos, v)
        shape = (b, KV_HEADS, group, MAX_LEN, HEAD_DIM)
        keys = cache_k[i].unsqueeze(2).expand(shape).reshape(b, HEADS, MAX_LEN, HEAD_DIM)
        values = cache_v[i].unsqueeze(2).expand(shape).reshape(b, HEADS, MAX_LEN, HEAD_DIM)
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        x = x + a.transpose(1, 2).reshape(b, 1, HEADS * HEAD_DIM) @ lw["wo"].T
        h = rms(x, lw["n2"])
        x = x + (F.silu(h @ lw["w1"].T) * (h @ lw["w3"].T)) @ lw["w2"].T
    logits = rms(x[:, -1], FINAL_NORM) @ EMB.T
    tok.copy_(logits.argmax(-1, keepdim=True))
    pos.add_(1)


def prefilled(batch):
    """Caches holding an 8-token prompt per sequence, and its next token."""
    shape = (batch, KV_HEADS, MAX_LEN, HEAD_DIM)
    cache_k = [torch.zeros(shape, device=DEV, dtype=DT) for _ in range(LAYERS)]
    cache_v = [torch.zeros(shape, device=DEV, dtype=DT) for _ in range(LAYERS)]
    prompt = (torch.arange(batch * PROMPT, device=DEV).view(batch, PROMPT) * 17 + 1) % VOCAB
    nxt = forward(prompt, 0, cache_k, cache_v).argmax(-1, keepdim=True)
    return cache_k, cache_v, nxt


def timed(run_step, steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        run_step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


@torch.inference_mode()
def eager_rate(batch, rounds=3, warmup=3):
    """Tokens/s of the best round, and each round's ms per step."""
    cache_k, cache_v, nxt = prefilled(batch)
    state = {"nxt": nxt, "pos": PROMPT}

    def step():
        state["nxt"] = forward(state["nxt"], state["pos"], cache_k, cache_v).argmax(-1, keepdim=True)
        state["pos"] += 1

    per_round = STEPS // rounds
    assert PROMPT + warmup + rounds * per_round <= MAX_LEN
    timed(step, warmup)
    secs = [timed(step, per_round) for _ in range(rounds)]
    return batch / min(secs), [1e3 * t for t in secs]


@torch.inference_mode()
def graph_rate(batch, warmup=3):
    """Tokens/s of the captured step, replayed STEPS times."""
    cache_k, cache_v, nxt = prefilled(batch)
    tok = nxt.clone()
    pos = torch.full((1,), PROMPT, device=DEV, dtype=torch.long)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):  # allocations and library handles before capture
            static_step(tok, pos, cache_k, cache_v)
    torch.cuda.current_stream().wait_stream(side)
    pos.fill_(PROMPT)  # the warm-up steps rewrite the same positions
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_step(tok, pos, cache_k, cache_v)
    pos.fill_(PROMPT)
    graph.replay()  # the first replay uploads the graph
    assert PROMPT + 1 + STEPS <= MAX_LEN
    return batch / timed(graph.replay, STEPS)


@torch.inference_mode()
def profile_eager_step():
    """The top ops of one eager batch-1 step by host time, as a table."""
    from torch.profiler import ProfilerActivity, profile

    cache_k, cache_v, nxt = prefilled(1)
    forward(nxt, PROMPT, cache_k, cache_v)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward(nxt, PROMPT + 1, cache_k, cache_v).argmax(-1)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)


def main():
    print(
        f"## torch {torch.__version__} on {torch.cuda.get_device_name()}: Llama-3.2-1B shape, "
        f"{LAYERS} layers, bf16 weights and static KV cache, greedy\n"
    )
    best = {}
    for batch in (1, 64):
        rate, rounds_ms = eager_rate(batch)
        ms = ", ".join(f"{t:.2f}" for t in rounds_ms)
        print(f"eager, batch {batch}: {rate:.1f} tokens/s (ms per step, by round: {ms})")
        print(f"torch_eager_b{batch}_tokens_per_s={rate:.1f}")
        best[batch] = rate
    for batch in (1, 64):
        try:
            rate = graph_rate(batch)
        except Exception as e:  # the eager figures stand without it
            print(f"graph, batch {batch}: failed ({type(e).__name__}: {e})")
            continue
        print(f"graph, batch {batch}: {rate:.1f} tokens/s")
        print(f"torch_graph_b{batch}_tokens_per_s={rate:.1f}")
        best[batch] = max(best[batch], rate)
    for batch in (1, 64):
        print(f"torch_b{batch}_tokens_per_s={best[batch]:.1f}")
    try:
        print("\n### One eager batch-1 step, top ops by host time\n")
        print("```")
        print(profile_eager_step())
        print("```")
    except Exception as e:
        print(f"profile failed ({type(e).__name__}: {e})")


if __name__ == "__main__":
    main()
