#!/usr/bin/env python3
"""The peer figure for benches/cuda_decode.rs: the same model in torch.

A plain Hugging Face-style bf16 forward of the Llama-3.2-1B shape (dim 2048,
32/8 heads of 64, SwiGLU 8192, vocab 128,256, tied embeddings, RoPE theta
500,000), random weights, a static preallocated KV cache, greedy argmax on the
device, on the same GPU: an 8-token prompt per sequence, then decode steps at
batch 1 and 64. `HANDOFF_BENCH_LAYERS` sets the layers (default 16, as the
bench).

Three forms of the same step:
  - eager: one Python-driven forward per step (as `model.generate` without
    compilation), attention over the filled prefix of the cache only
    (`scaled_dot_product_attention(..., enable_gqa=True)` over
    `cache[:, :, :pos + 1]`); 8 warm-up steps, then 4 timed rounds of 8
    steps, the best round reported beside each round's ms per step;
  - graph: the step over the whole static cache (a position tensor, a mask
    of the positions written, index_copy_ into the cache) captured once as
    a CUDA graph and replayed, which takes the host out of the step as
    vLLM's and SGLang's decode graphs do;
  - compiled: that static-cache step under `torch.compile(mode=
    "reduce-overhead")` (Inductor's fusions plus CUDA graphs, as
    gpt-fast and Hugging Face's static cache do), in a child process under
    what is left of a 45 s budget, so a slow compile costs only its lines.

The SDPA backend is pinned away from cuDNN attention. On an sm90/sm100 GPU
with the cuDNN that torch 2.11 ships (>= 9.15.1), torch's SDPA tries cuDNN
first, and cuDNN builds (and caches) an execution plan per problem shape,
key length included: a decode step over the filled prefix has a new key
length every step, so every step pays a plan build, tens of ms of host time,
whatever the batch. That is the likely cause of the first run's 12 tokens/s
at batch 1 (83 ms a step) and 915 at 64 (70 ms a step), with one warm-up
step leaving other first-call costs in the timed loop. One short line
(`torch_eager_sdpa_default_b1_tokens_per_s`) still times batch 1 the way
the first run called SDPA (K/V expanded, cuDNN allowed) to check that.

A correctness line: the first decode steps of batch row 0 at batch 1 and at
batch 64 (row 0 teacher-forced with batch 1's tokens), compared by argmax and
by the largest logit difference.

Prints `torch_b1_tokens_per_s=X`, `torch_b64_tokens_per_s=X` (the better of
eager and graph), `torch_eager_b{1,64}_tokens_per_s=X`,
`torch_graph_b{1,64}_tokens_per_s=X`, `torch_compiled_b{1,64}_tokens_per_s=X`,
`torch_eager_sdpa_default_b1_tokens_per_s=X`,
`torch_peer_b1_equals_b64_row0=true|false`,
`torch_peer_b1_b64_row0_argmax_agree=K/N`,
`torch_peer_b1_b64_row0_max_logit_diff=X` and
`torch_peer_row0_logit_rms=X`. Exits 2 (skipped, not failed) when torch or a
CUDA device is missing.

Hidden options for a check without a GPU: `TORCH_PEER_DEVICE=cpu`,
`TORCH_PEER_TINY=1` (dim 256, 8/2 heads of 32, FFN 512, vocab 1,024),
`TORCH_PEER_LAYERS=N`, `TORCH_PEER_COMPILE=0|1` (default 1 on CUDA, 0 on the
CPU), `TORCH_PEER_BUDGET_S` (default 45) and `TORCH_PEER_PROFILE=1` (a
profile of one eager batch-1 step, off by default).
"""
import os
import subprocess
import sys
import threading
import time

T_START = time.monotonic()
BUDGET_S = float(os.environ.get("TORCH_PEER_BUDGET_S", "45"))
CHILD = os.environ.get("TORCH_PEER_CHILD", "")

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("SKIP torch_decode_peer: torch is not installed")
    sys.exit(2)

DEV = torch.device(os.environ.get("TORCH_PEER_DEVICE", "cuda"))
CUDA = DEV.type == "cuda"
if CUDA and not torch.cuda.is_available():
    print("SKIP torch_decode_peer: torch sees no CUDA device")
    sys.exit(2)

TINY = os.environ.get("TORCH_PEER_TINY", "0") == "1"
if TINY:
    DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 8, 2, 32, 512, 1024
else:
    DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2048, 32, 8, 64, 8192, 128256
THETA, EPS = 500000.0, 1e-5
LAYERS = int(os.environ.get("TORCH_PEER_LAYERS", os.environ.get("HANDOFF_BENCH_LAYERS", "16")))
COMPILE = os.environ.get("TORCH_PEER_COMPILE", "1" if CUDA else "0") == "1"
PROFILE = os.environ.get("TORCH_PEER_PROFILE", "0") == "1"
PROMPT, WARMUP, ROUNDS, PER_ROUND = 8, 8, 4, 8
STEPS = ROUNDS * PER_ROUND  # timed steps of each eager run; graph and compiled replay as many
CHECK_STEPS = 8  # decode steps of the row-0 check, after the prompt's
MAX_LEN = 64  # >= PROMPT + WARMUP + STEPS: the eager runs' last position is 47
DT = torch.bfloat16
assert PROMPT + WARMUP + STEPS <= MAX_LEN


def sync():
    if CUDA:
        torch.cuda.synchronize()


def allow_cudnn_sdpa(allowed):
    """cuDNN attention on or off (a process-wide flag read at each SDPA call)."""
    if CUDA and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(allowed)


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
INV_FREQ = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, device=DEV).float() / HEAD_DIM))
ANGLES = torch.outer(torch.arange(MAX_LEN, device=DEV).float(), INV_FREQ)
COS = torch.cat([ANGLES.cos(), ANGLES.cos()], dim=-1).to(DT)  # [MAX_LEN, HEAD_DIM]
SIN = torch.cat([ANGLES.sin(), ANGLES.sin()], dim=-1).to(DT)


def _gqa_supported():
    q = torch.zeros(1, HEADS, 1, HEAD_DIM, device=DEV, dtype=DT)
    kv = torch.zeros(1, KV_HEADS, 2, HEAD_DIM, device=DEV, dtype=DT)
    try:
        with torch.inference_mode():
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


allow_cudnn_sdpa(False)
GQA = _gqa_supported()
ATTN = {"gqa": GQA}  # False: K/V expanded before SDPA, as the first run's repeat_interleave


def rms(x, g):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(DT) * g


def rotate(x, cos, sin):
    # rotate_half as in Hugging Face Llama.
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def expand_kv(x):
    # [B, KV, L, D] -> [B, HEADS, L, D], as Hugging Face's repeat_kv.
    b, _, length, _ = x.shape
    group = HEADS // KV_HEADS
    return x.unsqueeze(2).expand(b, KV_HEADS, group, length, HEAD_DIM).reshape(b, HEADS, length, HEAD_DIM)


def attend(q, keys, values, causal=False):
    if ATTN["gqa"]:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, expand_kv(keys), expand_kv(values), is_causal=causal)


def forward(tokens, start, cache_k, cache_v):
    """Logits of the last position; appends the KV of `tokens` at `start` and
    attends over the filled prefix, positions 0 .. start + t - 1."""
    b, t = tokens.shape
    assert t == 1 or start == 0  # a causal mask with t > 1 is only right from position 0
    x = EMB[tokens]
    cos, sin = COS[start : start + t], SIN[start : start + t]
    for i, lw in enumerate(LAYER_W):
        h = rms(x, lw["n1"])
        q = (h @ lw["wq"].T).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = (h @ lw["wk"].T).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = (h @ lw["wv"].T).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        cache_k[i][:, :, start : start + t] = k
        cache_v[i][:, :, start : start + t] = v
        a = attend(q, cache_k[i][:, :, : start + t], cache_v[i][:, :, : start + t], causal=t > 1)
        x = x + a.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM) @ lw["wo"].T
        h = rms(x, lw["n2"])
        x = x + (F.silu(h @ lw["w1"].T) * (h @ lw["w3"].T)) @ lw["w2"].T
    return rms(x[:, -1], FINAL_NORM) @ EMB.T


def static_next(tok, pos, cache_k, cache_v):
    """One decode step over the whole static cache, with no host-side
    shapes: `tok` [B, 1] and `pos` (a 1-element tensor) in, the next tokens
    [B, 1] out; writes the step's KV at `pos`. Capturable and compilable."""
    b = tok.shape[0]
    x = EMB[tok]
    cos, sin = COS.index_select(0, pos), SIN.index_select(0, pos)
    visible = (torch.arange(MAX_LEN, device=DEV) <= pos).view(1, 1, 1, MAX_LEN)
    for i, lw in enumerate(LAYER_W):
        h = rms(x, lw["n1"])
        q = (h @ lw["wq"].T).view(b, 1, HEADS, HEAD_DIM).transpose(1, 2)
        k = (h @ lw["wk"].T).view(b, 1, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = (h @ lw["wv"].T).view(b, 1, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        cache_k[i].index_copy_(2, pos, k)
        cache_v[i].index_copy_(2, pos, v)
        keys, values = expand_kv(cache_k[i]), expand_kv(cache_v[i])
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        x = x + a.transpose(1, 2).reshape(b, 1, HEADS * HEAD_DIM) @ lw["wo"].T
        h = rms(x, lw["n2"])
        x = x + (F.silu(h @ lw["w1"].T) * (h @ lw["w3"].T)) @ lw["w2"].T
    logits = rms(x[:, -1], FINAL_NORM) @ EMB.T
    return logits.argmax(-1, keepdim=True)


def static_step(tok, pos, cache_k, cache_v):
    """static_next with the next token written to `tok` and `pos` advanced
    in place, for a CUDA graph with fixed input addresses."""
    tok.copy_(static_next(tok, pos, cache_k, cache_v))
    pos.add_(1)


def prefilled(batch):
    """Caches holding an 8-token prompt per sequence (row r's prompt does not
    depend on the batch), and the prompt's last logits."""
    shape = (batch, KV_HEADS, MAX_LEN, HEAD_DIM)
    cache_k = [torch.zeros(shape, device=DEV, dtype=DT) for _ in range(LAYERS)]
    cache_v = [torch.zeros(shape, device=DEV, dtype=DT) for _ in range(LAYERS)]
    prompt = (torch.arange(batch * PROMPT, device=DEV).view(batch, PROMPT) * 17 + 1) % VOCAB
    return cache_k, cache_v, forward(prompt, 0, cache_k, cache_v)


def timed(run_step, steps):
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        run_step()
    sync()
    return (time.perf_counter() - t0) / steps


def sdpa_choice(batch, length, mask=False, gqa=GQA):
    """The backend torch's SDPA picks for a decode call of this shape now."""
    try:
        from torch.nn.attention import SDPBackend

        q = torch.zeros(batch, 1, HEADS, HEAD_DIM, device=DEV, dtype=DT).transpose(1, 2)
        cache = torch.zeros(batch, KV_HEADS, MAX_LEN, HEAD_DIM, device=DEV, dtype=DT)
        if mask:  # as static_next: the whole cache, expanded, and a mask
            kv = expand_kv(cache)
            m = torch.ones(1, 1, 1, MAX_LEN, device=DEV, dtype=torch.bool)
            choice = torch._fused_sdp_choice(q, kv, kv, m)
        elif gqa:  # as forward: the filled prefix
            choice = torch._fused_sdp_choice(q, cache[:, :, :length], cache[:, :, :length], enable_gqa=True)
        else:
            kv = expand_kv(cache[:, :, :length])
            choice = torch._fused_sdp_choice(q, kv, kv)
        for name, member in SDPBackend.__members__.items():
            if int(member) == int(choice):
                return name.lower()
        return f"backend {int(choice)}"
    except Exception as e:  # a diagnostic only
        return f"unknown ({type(e).__name__})"


@torch.inference_mode()
def eager_run(batch, warmup=WARMUP, rounds=ROUNDS, per_round=PER_ROUND):
    """Tokens/s of the best round, each round's ms per step, and batch row
    0's greedy tokens (the prompt's next token, then one per step)."""
    cache_k, cache_v, logits = prefilled(batch)
    state = {"nxt": logits.argmax(-1, keepdim=True), "pos": PROMPT}
    row0 = [state["nxt"][:1]]

    def step():
        state["nxt"] = forward(state["nxt"], state["pos"], cache_k, cache_v).argmax(-1, keepdim=True)
        state["pos"] += 1
        row0.append(state["nxt"][:1])

    assert PROMPT + warmup + rounds * per_round <= MAX_LEN
    timed(step, warmup)
    secs = [timed(step, per_round) for _ in range(rounds)]
    tokens = torch.cat(row0).flatten().tolist()
    return batch / min(secs), [1e3 * t for t in secs], tokens


@torch.inference_mode()
def graph_rate(batch, warmup=3):
    """Tokens/s of the captured step, replayed STEPS times."""
    cache_k, cache_v, logits = prefilled(batch)
    tok = logits.argmax(-1, keepdim=True)
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
def row0_check(steps=CHECK_STEPS):
    """Batch row 0 at batch 1 and at batch 64, the same prompt; row 0 of the
    batch-64 run is fed batch 1's greedy tokens (the other rows their own),
    so one near-tie cannot send the two runs down different paths. Returns
    the steps whose argmax agrees, the steps, the largest |logit difference|
    and the RMS of batch 1's logits."""
    ck1, cv1, l1 = prefilled(1)
    ck64, cv64, l64 = prefilled(64)
    ref, got = [l1[0].float()], [l64[0].float()]
    tok1, tok64 = l1.argmax(-1, keepdim=True), l64.argmax(-1, keepdim=True)
    for s in range(steps):
        tok64 = tok64.clone()
        tok64[0] = tok1[0]
        l1 = forward(tok1, PROMPT + s, ck1, cv1)
        l64 = forward(tok64, PROMPT + s, ck64, cv64)
        ref.append(l1[0].float())
        got.append(l64[0].float())
        tok1, tok64 = l1.argmax(-1, keepdim=True), l64.argmax(-1, keepdim=True)
    ref, got = torch.stack(ref), torch.stack(got)
    agree = int((ref.argmax(-1) == got.argmax(-1)).sum())
    diff = float((ref - got).abs().max())
    scale = float(ref.pow(2).mean().sqrt())
    return agree, steps + 1, diff, scale


@torch.inference_mode()
def profile_eager_step():
    """The top ops of one eager batch-1 step by host time, as a table."""
    from torch.profiler import ProfilerActivity, profile

    cache_k, cache_v, logits = prefilled(1)
    nxt = logits.argmax(-1, keepdim=True)
    forward(nxt, PROMPT, cache_k, cache_v)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        forward(nxt, PROMPT + 1, cache_k, cache_v).argmax(-1)
        sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)


def compiled_child():
    """In the child process: the static-cache step under torch.compile
    (reduce-overhead: CUDA graphs) at batch 1 and then 64, each line printed
    as soon as it is measured."""
    step = torch.compile(static_next, mode="reduce-overhead", fullgraph=True, dynamic=False)
    mark = getattr(torch._dynamo, "mark_static_address", None)
    step_begin = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    if mark is not None:  # weights and caches at fixed addresses, as HF's StaticCache marks them
        for lw in LAYER_W:
            for t in lw.values():
                mark(t)
        for t in (EMB, FINAL_NORM, COS, SIN):
            mark(t)
    for batch in (1, 64):
        with torch.no_grad():
            cache_k, cache_v, logits = prefilled(batch)
            if mark is not None:
                for t in cache_k + cache_v:
                    mark(t)
            state = {"tok": logits.argmax(-1, keepdim=True)}
            pos = torch.full((1,), PROMPT, device=DEV, dtype=torch.long)

            def run():
                if step_begin is not None:
                    step_begin()
                state["tok"] = step(state["tok"], pos, cache_k, cache_v).clone()
                pos.add_(1)

            t0 = time.perf_counter()
            for _ in range(3):  # compile, record the graph, replay
                run()
            sync()
            warm_s = time.perf_counter() - t0
            pos.fill_(PROMPT)  # the timed steps rewrite the warm-up's positions
            rate = batch / timed(run, STEPS)
        note = ""
        try:  # Inductor counts the graphs it declined to capture (a mutated input, a CPU op, ...)
            from torch._dynamo.utils import counters

            skips = counters["inductor"]["cudagraph_skips"]
            if CUDA and skips:
                note = f"; CUDA graphs skipped {skips} times, TORCH_LOGS=cudagraphs says why"
        except Exception:
            pass
        print(f"compiled (reduce-overhead), batch {batch}: {rate:.1f} tokens/s "
              f"({warm_s:.1f} s to compile and warm up{note})", flush=True)
        print(f"torch_compiled_b{batch}_tokens_per_s={rate:.1f}", flush=True)


def run_compiled_child(seconds):
    """Runs compiled_child in a child process for at most `seconds`, passing
    its lines through as they come; a child past its time is killed."""
    env = dict(os.environ, TORCH_PEER_CHILD="compile", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err = []

    def pass_out():
        for line in proc.stdout:
            print(line, end="", flush=True)

    def keep_err():
        for line in proc.stderr:
            err.append(line.rstrip())
            del err[:-8]

    readers = [threading.Thread(target=pass_out, daemon=True), threading.Thread(target=keep_err, daemon=True)]
    for r in readers:
        r.start()
    try:
        rc = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    for r in readers:
        r.join(timeout=2)
    if rc is None:
        print(f"compiled: stopped at the time budget ({seconds:.0f} s for the child)", flush=True)
    elif rc != 0:
        print(f"compiled: failed (child exit {rc}); its last stderr lines:", flush=True)
        for line in err[-4:]:
            print(f"    {line}", flush=True)


def main():
    where = torch.cuda.get_device_name() if CUDA else "cpu"
    shape = "tiny shape (smoke test)" if TINY else "Llama-3.2-1B shape"
    print(
        f"## torch {torch.__version__} on {where}: {shape}, {LAYERS} layers, "
        f"bf16 weights and static KV cache, greedy\n",
        flush=True,
    )
    allow_cudnn_sdpa(True)
    default_choice = sdpa_choice(1, PROMPT + 1, gqa=False)  # the first run's call
    allow_cudnn_sdpa(False)
    print(
        f"SDPA backend for an eager decode step: {sdpa_choice(1, PROMPT + 1)}, "
        f"GQA {'in SDPA (enable_gqa)' if GQA else 'by expanded K/V'}; for the masked static-cache "
        f"step: {sdpa_choice(1, MAX_LEN, mask=True)}. cuDNN attention is switched off (see the "
        f"script's note); with it on, the first run's call (K/V expanded) gets {default_choice}\n",
        flush=True,
    )
    best, row0 = {}, {}
    for batch in (1, 64):
        rate, rounds_ms, row0[batch] = eager_run(batch)
        ms = ", ".join(f"{t:.2f}" for t in rounds_ms)
        print(f"eager, batch {batch}: {rate:.1f} tokens/s (ms per step, by round: {ms})", flush=True)
        print(f"torch_eager_b{batch}_tokens_per_s={rate:.1f}", flush=True)
        best[batch] = rate
    for batch in (1, 64):
        if not CUDA:
            break
        try:
            rate = graph_rate(batch)
        except Exception as e:  # the eager figures stand without it
            print(f"graph, batch {batch}: failed ({type(e).__name__}: {e})", flush=True)
            continue
        print(f"graph, batch {batch}: {rate:.1f} tokens/s", flush=True)
        print(f"torch_graph_b{batch}_tokens_per_s={rate:.1f}", flush=True)
        best[batch] = max(best[batch], rate)
    for batch in (1, 64):
        print(f"torch_b{batch}_tokens_per_s={best[batch]:.1f}", flush=True)

    agree, total, diff, scale = row0_check()
    same = 0
    while same < len(row0[1]) and row0[1][same] == row0[64][same]:
        same += 1
    print(
        f"\nrow 0 at batch 1 and 64 (teacher-forced, {total} steps): argmax agrees at {agree}/{total}, "
        f"largest |logit difference| {diff:.4f} against a logit RMS of {scale:.4f} (bf16 rounding "
        f"leaves it a small fraction of the RMS, a batching error makes it about the RMS); free-running, the "
        f"timed runs' row-0 tokens agree for the first {same} of {len(row0[1])}",
        flush=True,
    )
    print(f"torch_peer_b1_equals_b64_row0={'true' if agree == total else 'false'}", flush=True)
    print(f"torch_peer_b1_b64_row0_argmax_agree={agree}/{total}", flush=True)
    print(f"torch_peer_b1_b64_row0_max_logit_diff={diff:.4f}", flush=True)
    print(f"torch_peer_row0_logit_rms={scale:.4f}", flush=True)

    # The first run's figure, for the record: cuDNN plans each new key length.
    allow_cudnn_sdpa(True)
    ATTN["gqa"] = False
    try:
        rate, rounds_ms, _ = eager_run(1, warmup=2, rounds=1, per_round=8)
        print(
            f"\neager, batch 1, as the first run called SDPA (K/V expanded, cuDNN allowed: "
            f"{default_choice}): {rate:.1f} tokens/s ({rounds_ms[0]:.2f} ms per step; "
            f"each step attends over a new key length)",
            flush=True,
        )
        print(f"torch_eager_sdpa_default_b1_tokens_per_s={rate:.1f}", flush=True)
    except Exception as e:
        print(f"eager with the default SDPA choice: failed ({type(e).__name__}: {e})", flush=True)
    finally:
        allow_cudnn_sdpa(False)
        ATTN["gqa"] = GQA

    if PROFILE:
        try:
            print("\n### One eager batch-1 step, top ops by host time\n")
            print("```")
            print(profile_eager_step())
            print("```", flush=True)
        except Exception as e:
            print(f"profile failed ({type(e).__name__}: {e})", flush=True)

    if COMPILE:
        left = BUDGET_S - (time.monotonic() - T_START) - 3.0
        print("", flush=True)
        if left < 15:
            print(f"compiled: skipped, {left:.0f} s left of the {BUDGET_S:.0f} s budget", flush=True)
        else:
            run_compiled_child(left)


if __name__ == "__main__":
    if CHILD == "compile":
        compiled_child()
    else:
        main()
