#!/usr/bin/env bash
# Builds the GPU checks here (no GPU needed) into gpu-bundle/ (git-ignored),
# to be carried to a GPU machine that has a driver but no Rust:
#   gpu-bundle/tests/*        release test binaries with --features cuda
#   gpu-bundle/benches/*      the kernel and end-to-end decode benchmarks
#   gpu-bundle/examples/disaggregated  the main example, run with --backend cuda
#   gpu-bundle/examples/generate       a Hugging Face checkpoint (the test
#                             fixture) generated on the GPU; generate.cpu
#                             holds what the CPU printed for it here
#   gpu-bundle/stories260K.bin (for the end-to-end test, when present)
#   gpu-bundle/cublas_reference.py  torch (cuBLAS) bf16 GEMMs for comparison
#   gpu-bundle/torch_decode_peer.py the end-to-end decode model in torch (peer ratio)
#   gpu-bundle/run.sh         runs them all with HANDOFF_REQUIRE_GPU=1,
#                             writing logs and figures under $OUT
#   gpu-bundle/profile.sh     Nsight Compute on single attention launches
# Binaries are stripped; the whole folder stays well under 64 MiB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Assigned first: `eval "$(...)"` alone would hide an install failure.
nvcc_env="$(scripts/install-nvcc.sh)"
eval "$nvcc_env"
bundle=gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/benches" "$bundle/examples" target

# Test binaries that exercise the GPU: the `cuda` test binary
# (tests/cuda/main.rs, one module per story). A missing binary fails here,
# not on the GPU machine.
cargo test --release --features cuda --no-run --message-format=json --test cuda \
  > target/gpu-bundle-tests.json
cargo bench --features cuda --no-run --message-format=json --bench cuda_attention --bench cuda_decode \
  > target/gpu-bundle-benches.json
cargo build --release --features cuda --example disaggregated --example generate
for ex in disaggregated generate; do
  cp "target/release/examples/$ex" "$bundle/examples/$ex"
  strip "$bundle/examples/$ex"
done
# The Hugging Face fixture (tests/fixtures/hf_tiny_llama, f32, 360 KB) and
# its transformers prompts: the GPU must print, greedy, the ids the CPU
# prints here (the CPU's are transformers' own; tests check that).
mkdir -p "$bundle/hf_tiny_llama"
cp tests/fixtures/hf_tiny_llama/config.json tests/fixtures/hf_tiny_llama/model.safetensors "$bundle/hf_tiny_llama/"
python3 - tests/fixtures/hf_tiny_llama/expected.json > "$bundle/generate.args" <<'PY'
import json, sys
cases = json.load(open(sys.argv[1]))["cases"]
args = []
for c in cases:
    args += ["--prompt-ids", ",".join(map(str, c["prompt"]))]
args += ["--max-new-tokens", str(len(cases[0]["greedy_new_tokens"])), "--temperature", "0"]
print(" ".join(args))
PY
# shellcheck disable=SC2046 # the ids and flags split on spaces
"$bundle/examples/generate" --backend cpu --model "$bundle/hf_tiny_llama" $(cat "$bundle/generate.args") \
  > "$bundle/generate.cpu"

pick() { # json file, destination dir
  python3 - "$1" "$2" <<'PY'
import json, shutil, sys, os
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe:
        dst = os.path.join(sys.argv[2], m["target"]["name"])
        shutil.copy(exe, dst)
        print(dst)
PY
}
for f in $(pick target/gpu-bundle-tests.json "$bundle/tests") $(pick target/gpu-bundle-benches.json "$bundle/benches"); do
  strip "$f"
done
for f in tests/cuda benches/cuda_decode benches/cuda_attention examples/disaggregated examples/generate; do
  [[ -x "$bundle/$f" ]] || { echo "gpu-bundle: $f was not built" >&2; exit 1; }
done
model=../shared/models/stories260K.bin
[[ -f "$model" ]] && cp "$model" "$bundle/stories260K.bin"
cp scripts/cublas_reference.py "$bundle/cublas_reference.py"
cp scripts/torch_decode_peer.py "$bundle/torch_decode_peer.py"

cat > "$bundle/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the GPU checks; results under $OUT (default: ./out next to this file).
# The device tool brings back at most 8 files, so everything goes into 7:
# env.txt (nvidia-smi, timings, every bench's stderr), tests.log,
# cuda_attention.md, cublas.md, cuda_decode.md, torch_decode_peer.md and
# example.log. Order: correctness, then issue 16's kernel figures, then
# issue 15's end-to-end ones, then the examples; a run cut short keeps what
# came first. Budget (worst case, every step at its timeout): tests 135 s,
# kernel benchmark 120 s, cuBLAS 45 s, end-to-end decode 150 s, its torch
# peer 45 s, the main example 2 x 40 s, generate 20 s: 595 s. Give the
# device call 600 s.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${OUT:-$here/out}"
mkdir -p "$out"
env_log="$out/env.txt"
export HANDOFF_REQUIRE_GPU=1
[[ -f "$here/stories260K.bin" ]] && export HANDOFF_STORIES260K="$here/stories260K.bin"
(nvidia-smi || true) > "$env_log" 2>&1
# The kernels are built by CUDA 13.0, which needs driver 580 or newer: on an
# older driver every module load fails, so say so at once rather than spend
# the machine's time on failing tests.
driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
if [[ -n "$driver" && "${driver%%.*}" =~ ^[0-9]+$ && "${driver%%.*}" -lt 580 ]]; then
  echo "== driver $driver is older than 580, which CUDA 13.0 kernels need: nothing run" | tee -a "$env_log"
  exit 3
fi
echo "== driver ${driver:-unknown}" | tee -a "$env_log"
status=0
note() { echo "$1" | tee -a "$env_log"; }
for t in "$here"/tests/*; do
  name="$(basename "$t")"
  start=$SECONDS
  echo "#### $name" >> "$out/tests.log"
  # The SIMT-emulator stories (`*_host::`) check kernel bodies on the CPU;
  # CI runs them, and here they would only spend device time.
  timeout 135 "$t" --test-threads=1 --skip _host:: >> "$out/tests.log" 2>&1
  rc=$?
  note "== $name: exit $rc in $((SECONDS - start))s"
  grep -E "^test .* (FAILED|ok)$|panicked|test result" "$out/tests.log" | tail -60
  [[ $rc -eq 0 ]] || status=1
done
start=$SECONDS
echo "#### cuda_attention stderr" >> "$env_log"
timeout 120 "$here/benches/cuda_attention" > "$out/cuda_attention.md" 2>> "$env_log"
rc=$?
note "== cuda_attention: exit $rc in $((SECONDS - start))s"
cat "$out/cuda_attention.md"
[[ $rc -eq 0 ]] || status=1
# cuBLAS (through torch) on the same GPU right after the kernel bench; its
# table gives the tensor-core prefill figure as a share of cuBLAS bf16 GEMMs.
start=$SECONDS
PYTHONUNBUFFERED=1 timeout 45 python3 "$here/cublas_reference.py" "$out/cuda_attention.md" > "$out/cublas.md" 2>&1
rc=$?
note "== cublas_reference: exit $rc in $((SECONDS - start))s"
cat "$out/cublas.md"
# 2: skipped (no torch or no CUDA device for it), not a failure of ours.
[[ $rc -eq 0 || $rc -eq 2 ]] || status=1
start=$SECONDS
echo "#### cuda_decode stderr" >> "$env_log"
timeout 150 "$here/benches/cuda_decode" > "$out/cuda_decode.md" 2>> "$env_log"
rc=$?
note "== cuda_decode: exit $rc in $((SECONDS - start))s"
cat "$out/cuda_decode.md"
[[ $rc -eq 0 ]] || status=1
# The same model in torch on the same GPU: the peer of cuda_decode's figures.
start=$SECONDS
PYTHONUNBUFFERED=1 timeout 45 python3 "$here/torch_decode_peer.py" > "$out/torch_decode_peer.md" 2>&1
rc=$?
note "== torch_decode_peer: exit $rc in $((SECONDS - start))s"
cat "$out/torch_decode_peer.md"
[[ $rc -eq 0 || $rc -eq 2 ]] || status=1
# The main example on the GPU: both workers and the colocated reference on
# device 0 with device-resident KV, in one process (KV copied device to
# device) and as two processes over authenticated TCP; the audit line must
# show nothing leaked, held or read across requests.
# In process on f32 KV (the scalar kernels), over TCP on bf16 KV (the
# tensor-core ones).
for run in "inproc f32" "tcp bf16"; do
  read -r transport kv <<< "$run"
  start=$SECONDS
  echo "#### disaggregated --backend cuda --transport $transport --kv-dtype $kv" >> "$out/example.log"
  timeout 40 "$here/examples/disaggregated" --backend cuda --transport "$transport" --kv-dtype "$kv" \
    >> "$out/example.log" 2>&1
  rc=$?
  note "== disaggregated --backend cuda --transport $transport --kv-dtype $kv: exit $rc in $((SECONDS - start))s"
  tail -3 "$out/example.log"
  [[ $rc -eq 0 ]] || status=1
done
# A Hugging Face checkpoint on the GPU (KV pages in device memory, sampling
# on the device): greedy, the ids the CPU printed when the bundle was built.
start=$SECONDS
echo "#### generate --backend cuda" >> "$out/example.log"
# shellcheck disable=SC2046 # the ids and flags split on spaces
timeout 20 "$here/examples/generate" --backend cuda --model "$here/hf_tiny_llama" \
  $(cat "$here/generate.args") > /tmp/generate.gpu 2>> "$out/example.log"
rc=$?
cat /tmp/generate.gpu >> "$out/example.log"
if [[ $rc -eq 0 ]] && cmp -s /tmp/generate.gpu "$here/generate.cpu"; then
  note "== generate --backend cuda: the CPU's greedy ids (exit 0 in $((SECONDS - start))s)"
else
  note "== generate --backend cuda: exit $rc, ids $(cmp -s /tmp/generate.gpu "$here/generate.cpu" && echo equal || echo DIFFERENT) to the CPU's"
  status=1
fi
exit $status
RUN
chmod +x "$bundle/run.sh"
# Nsight Compute on single launches of the attention kernels (a second,
# optional device call after run.sh): details and per-instruction SASS
# counters as text (the .ncu-rep itself is dropped: 8 files come back).
cat > "$bundle/profile.sh" <<'PROF'
#!/usr/bin/env bash
# Profiles one launch each of the tensor-core decode (batch 1 and batch 8
# cells) and prefill (8k; the 64-row and the wide kernel) in
# benches/cuda_attention, then stops the bench.
# Launch indices follow the bench's order: each decode cell runs the
# tensor-core kernel 3 + 20 times per page size (16, then 64), cells in
# DECODE_CELLS_32_4 order; the prefill runs 3 + 3 times per prompt length
# (1k, 4k, 8k). Change the bench's cells and these move.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${OUT:-$here/out}"; mkdir -p "$out"
export HANDOFF_REQUIRE_GPU=1 HANDOFF_BENCH_MAX_GIB=4
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[[ -x "$NCU" ]] || { echo "no ncu on this machine"; exit 2; }
prof() { # name, kernel regex, launches to skip
  local start=$SECONDS
  timeout 150 "$NCU" --clock-control none --set full -k "regex:$2" --launch-skip "$3" \
    --launch-count 1 --kill yes -f -o "$out/$1" "$here/benches/cuda_attention" > /dev/null 2>&1
  echo "== $1: exit $? in $((SECONDS - start))s"
  "$NCU" -i "$out/$1.ncu-rep" --page details > "$out/$1.details.txt" 2>&1
  "$NCU" -i "$out/$1.ncu-rep" --page source --print-source sass --csv > "$out/$1.sass.csv" 2>&1
  rm -f "$out/$1.ncu-rep"
}
prof dec_b1 'decode_mma_bf16_d128_g8' 3     # batch 1, 1k: its 4th launch
prof dec_b8 'decode_mma_bf16_d128_g8' 233   # batch 8, 8k (5 cells x 2 pages x 23 before it)
prof dec_b1_wide 'decode_mma_wide_bf16_d128_g8' 3    # the 8-warp kernel, likewise
prof dec_b8_wide 'decode_mma_wide_bf16_d128_g8' 233
prof pre_8k 'prefill_mma_bf16_d128' 12      # 8k, after 1k and 4k
prof pre_8k_wide 'prefill_mma_wide_bf16_d128' 12  # the wide kernel, likewise
grep -E "Duration|Achieved Occupancy|Registers Per|DRAM Throughput|Warp Cycles Per Issued|Issued Ipc" \
  "$out"/*.details.txt
PROF
chmod +x "$bundle/profile.sh"
du -sh "$bundle"
ls -la "$bundle" "$bundle/tests" "$bundle/benches"
