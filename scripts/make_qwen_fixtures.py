#!/usr/bin/env python3
"""Seeded random Qwen2 (GGUF) and Qwen3 (GGUF and Hugging Face folder)
checkpoints for handoff, with the logits of a float64 reference forward
pass written here from each architecture, independent of handoff:

- Qwen2: the Llama block (RMSNorm, GQA attention, SwiGLU) with biases on
  the q, k and v projections, rotate-half RoPE (llama.cpp's NEOX style: its
  converter does not permute Qwen rows), tied output.
- Qwen3: no biases; each query and key head RMS-normed by gains of
  head_dim (eps as the block norms) after its projection and before RoPE;
  head_dim 32 while hidden/heads is 16, so q is wider than the stream.

Writes:
    tests/fixtures/tiny_qwen2_gguf/{model.gguf, expected.json}
    tests/fixtures/tiny_qwen3/{model.gguf, hf/config.json,
                               hf/model.safetensors, expected.json}
The Qwen3 GGUF and HF folder hold the same weights, so one expected.json
serves both. Each expected.json has, per prompt, the reference logits at
every position and the greedy continuation (full forward per step). Seeds
are searched from 0 for one whose smallest top-2 logit gap along every
greedy path is at least MIN_GAP, so a different token means a real bug.
Every GGUF written is read back with gguf-py's reader and compared.

Usage (numpy, gguf and safetensors from PyPI):
    python3 -m venv /tmp/qvenv && /tmp/qvenv/bin/pip install numpy gguf safetensors
    /tmp/qvenv/bin/python scripts/make_qwen_fixtures.py
"""

import json
import os
import shutil
import sys

import gguf
import numpy as np
from safetensors.numpy import save_file

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
PROMPTS = [
    [1, 17, 42],
    [1, 5, 9, 101, 33, 7, 64, 90, 2, 11, 127, 56, 3, 78, 19, 44, 8, 120, 61, 25],
    [7],
]
NEW_TOKENS = 8
MIN_GAP = 0.1

SHAPES = {
    "qwen2": dict(dim=64, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=16,
                  vocab=128, ctx=128, theta=1000.0, eps=1e-6, tied=True,
                  bias=True, qk_norm=False),
    "qwen3": dict(dim=64, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                  vocab=128, ctx=128, theta=1000.0, eps=1e-6, tied=False,
                  bias=False, qk_norm=True),
}


def build(s, seed):
    """Weights by Hugging Face name, float32, nn.Linear layout [out, in]."""
    rng = np.random.default_rng(seed)
    d, h, hd = s["dim"], s["hidden"], s["head_dim"]
    qd, kvd = s["heads"] * hd, s["kv_heads"] * hd
    w = {}

    def lin(name, out, inp):
        w[name] = rng.standard_normal((out, inp)) * (1.5 / np.sqrt(inp))

    def gain(name, n):
        w[name] = 1.0 + 0.2 * rng.standard_normal(n)

    w["model.embed_tokens.weight"] = rng.standard_normal((s["vocab"], d))
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        gain(p + "input_layernorm.weight", d)
        lin(p + "self_attn.q_proj.weight", qd, d)
        lin(p + "self_attn.k_proj.weight", kvd, d)
        lin(p + "self_attn.v_proj.weight", kvd, d)
        lin(p + "self_attn.o_proj.weight", d, qd)
        if s["bias"]:
            for t, n in [("q", qd), ("k", kvd), ("v", kvd)]:
                w[p + f"self_attn.{t}_proj.bias"] = 0.5 * rng.standard_normal(n)
        if s["qk_norm"]:
            gain(p + "self_attn.q_norm.weight", hd)
            gain(p + "self_attn.k_norm.weight", hd)
        gain(p + "post_attention_layernorm.weight", d)
        lin(p + "mlp.gate_proj.weight", h, d)
        lin(p + "mlp.up_proj.weight", h, d)
        lin(p + "mlp.down_proj.weight", d, h)
    gain("model.norm.weight", d)
    if not s["tied"]:
        lin("lm_head.weight", s["vocab"], d)
    # The checkpoint stores float32: the reference computes on exactly those.
    return {k: v.astype(np.float32) for k, v in w.items()}


def forward(s, w, tokens):
    """Float64 logits at every position of `tokens` (causal, no cache)."""
    W = {k: v.astype(np.float64) for k, v in w.items()}
    nh, nkv, hd, eps = s["heads"], s["kv_heads"], s["head_dim"], s["eps"]
    T = len(tokens)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    inv = s["theta"] ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(T)[:, None] * inv[None, :]  # [T, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # x: [T, heads, hd]; rotate-half: element i pairs with i + hd/2
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    x = W["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        hn = rms(x, W[p + "input_layernorm.weight"])
        proj = {}
        for t in "qkv":
            y = hn @ W[p + f"self_attn.{t}_proj.weight"].T
            if s["bias"]:
                y = y + W[p + f"self_attn.{t}_proj.bias"]
            proj[t] = y.reshape(T, -1, hd)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if s["qk_norm"]:
            q = rms(q, W[p + "self_attn.q_norm.weight"])
            k = rms(k, W[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        o = np.empty((T, nh, hd))
        for i in range(nh):
            g = i // (nh // nkv)
            sc = q[:, i, :] @ k[:, g, :].T / np.sqrt(hd) + mask
            sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
            o[:, i, :] = (sc / sc.sum(axis=-1, keepdims=True)) @ v[:, g, :]
        x = x + o.reshape(T, -1) @ W[p + "self_attn.o_proj.weight"].T
        hn = rms(x, W[p + "post_attention_layernorm.weight"])
        gate = hn @ W[p + "mlp.gate_proj.weight"].T
        up = hn @ W[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T
    out = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return rms(x, W["model.norm.weight"]) @ out.T


def record(s, w):
    cases, min_gap = [], np.inf
    for prompt in PROMPTS:
        logits = forward(s, w, prompt)
        seq, gaps = list(prompt), []
        for _ in range(NEW_TOKENS):
            last = forward(s, w, seq)[-1]
            top = np.sort(last)[-2:]
            gaps.append(float(top[1] - top[0]))
            seq.append(int(np.argmax(last)))
        min_gap = min(min_gap, *gaps)
        cases.append({
            "prompt": prompt,
            "logits": [[float(x) for x in row] for row in logits],
            "greedy_new_tokens": seq[len(prompt):],
            "greedy_top2_gaps": gaps,
        })
    return cases, min_gap


# Hugging Face name (after "model.layers.N.") -> GGUF name (after "blk.N.").
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, l, rest = hf.split(".", 3)
    return f"blk.{l}.{GGUF_NAMES[rest]}"


def write_gguf(arch, s, w, path):
    g = gguf.GGUFWriter(path, arch)
    g.add_block_count(s["layers"])
    g.add_context_length(s["ctx"])
    g.add_embedding_length(s["dim"])
    g.add_feed_forward_length(s["hidden"])
    g.add_head_count(s["heads"])
    g.add_head_count_kv(s["kv_heads"])
    if s["head_dim"] != s["dim"] // s["heads"]:
        g.add_key_length(s["head_dim"])
        g.add_value_length(s["head_dim"])
    g.add_rope_freq_base(s["theta"])
    g.add_layer_norm_rms_eps(s["eps"])
    g.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = {}
    for k, v in w.items():
        names[gguf_name(k)] = k
        g.add_tensor(gguf_name(k), v)
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    # Read back: every tensor holds exactly the reference's values.
    r = gguf.GGUFReader(path)
    assert len(r.tensors) == len(w)
    for t in r.tensors:
        want = w[names[t.name]]
        got = np.asarray(t.data).reshape(want.shape)
        assert np.array_equal(got, want), t.name


def write_hf(s, w, out):
    os.makedirs(out)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "hidden_size": s["dim"],
        "intermediate_size": s["hidden"],
        "max_position_embeddings": s["ctx"],
        "num_attention_heads": s["heads"],
        "num_hidden_layers": s["layers"],
        "num_key_value_heads": s["kv_heads"],
        "rms_norm_eps": s["eps"],
        "rope_theta": s["theta"],
        "rope_scaling": None,
        "tie_word_embeddings": s["tied"],
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": "float32",
        "vocab_size": s["vocab"],
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
    save_file(w, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def main():
    for arch, s in SHAPES.items():
        for seed in range(200):
            w = build(s, seed)
            cases, min_gap = record(s, w)
            if min_gap >= MIN_GAP:
                break
        else:
            sys.exit(f"{arch}: no seed below 200 gives a comfortable greedy gap")
        print(f"{arch}: seed {seed}, smallest top-2 gap along the greedy paths {min_gap:.4f}")
        out = os.path.join(FIXTURES, "tiny_qwen2_gguf" if arch == "qwen2" else "tiny_qwen3")
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(out)
        write_gguf(arch, s, w, os.path.join(out, "model.gguf"))
        if arch == "qwen3":
            write_hf(s, w, os.path.join(out, "hf"))
        expected = {
            "generator": "scripts/make_qwen_fixtures.py",
            "architecture": arch,
            "seed": seed,
            "dtype": "float64 reference over float32 weights",
            "min_greedy_top2_gap": min_gap,
            "cases": cases,
        }
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump(expected, f, indent=1)
            f.write("\n")
        total = sum(os.path.getsize(os.path.join(r, x)) for r, _, fs in os.walk(out) for x in fs)
        print(f"  {out}: {total} bytes")


if __name__ == "__main__":
    main()
