#!/usr/bin/env bash
# Instruction counts of a kernel's loops in its sm_90 SASS, without a GPU:
# the proxy for a latency-bound kernel's speed between GPU runs (an H200's
# Nsight Compute said the attention kernels are bound by instruction
# latency, not memory). Compiles one cuda/*.cu with the pinned nvcc
# (scripts/install-nvcc.sh), disassembles it with cuobjdump and nvdisasm
# from PyPI (into .venv-sass; nvdisasm 13.5 reads 13.0 cubins), and prints,
# for every backward branch whose body holds HMMA, its start, end,
# instruction count and the most frequent opcodes. Static counts: a body
# with a rarely taken branch (a rescale, a fallback path) counts both sides.
#
# Usage: scripts/sass-loops.sh decode_mma.cu decode_mma_bf16_d128_g8
#        (run `cargo build --features cuda` once first: the kernel
#        table's generated headers live under target/)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="${1:?usage: sass-loops.sh <file.cu in cuda/> <kernel symbol>}"
fun="${2:?usage: sass-loops.sh <file.cu in cuda/> <kernel symbol>}"
eval "$(bash "$root/scripts/install-nvcc.sh")"

venv="$root/.venv-sass"
pins=(nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.5.37)
if [[ "$(cat "$venv/.pins" 2>/dev/null)" != "${pins[*]}" ]]; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet "${pins[@]}" >&2
  echo "${pins[*]}" > "$venv/.pins"
fi
bin="$(echo "$venv"/lib/python*/site-packages/nvidia/cu13/bin)"
chmod +x "$bin"/* 2>/dev/null || true

# The newest generated headers (several builds leave several out/ dirs).
gen="$(dirname "$(find "$root/target" -path '*cuda-gen*' -name "${src%.cu}_kernels.cuh" -printf '%T@ %p\n' |
  sort -rn | head -1 | cut -d' ' -f2-)")"
[[ -d "$gen" ]] || { echo "sass-loops: no generated headers; run cargo build --features cuda" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$root/cuda" && "$NVCC" -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -Xptxas -v \
  -cubin "$src" -o "$tmp/k.cubin" -I. -I"$gen" 2>&1 | grep -A3 "Compiling entry function '$fun'" | grep -E "Used|spill" >&2 || true)
PATH="$bin:$PATH" cuobjdump -sass -fun "$fun" "$tmp/k.cubin" > "$tmp/k.sass"
python3 - "$tmp/k.sass" <<'EOF'
import re, sys
from collections import Counter
ins = []
for line in open(sys.argv[1]):
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
print(f"{len(ins)} instructions")
for at, text in ins:
    b = re.search(r"BRA\s+(?:!?P\d, )?(?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
    if not b or int(b.group(1), 16) >= at:
        continue
    start = int(b.group(1), 16)
    ops = Counter()
    for a, t in ins:
        if start <= a <= at:
            words = t.split()
            op = words[1] if words[0].startswith("@") else words[0]
            ops[op.split(".")[0]] += 1
    if ops["HMMA"]:
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
        print(f"loop {start:#x}..{at:#x}: {sum(ops.values())} instructions ({top})")
EOF
