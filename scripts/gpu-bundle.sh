#!/usr/bin/env bash
# Builds the GPU checks here (no GPU needed) into gpu-bundle/ (git-ignored),
# to be carried to a GPU machine that has a driver but no Rust:
#   gpu-bundle/tests/*        release test binaries with --features cuda
#   gpu-bundle/benches/*      the kernel and end-to-end decode benchmarks
#   gpu-bundle/examples/disaggregated  the main example, run with --backend cuda
#   gpu-bundle/stories260K.bin (for the end-to-end test, when present)
#   gpu-bundle/cublas_reference.py  torch (cuBLAS) bf16 GEMMs for comparison
#   gpu-bundle/torch_decode_peer.py the end-to-end decode model in torch (peer ratio)
#   gpu-bundle/run.sh         runs them all with HANDOFF_REQUIRE_GPU=1,
#                             writing logs and figures under $OUT
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
cargo build --release --features cuda --example disaggregated
cp target/release/examples/disaggregated "$bundle/examples/disaggregated"
strip "$bundle/examples/disaggregated"

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
for f in tests/cuda benches/cuda_decode benches/cuda_attention examples/disaggregated; do
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
# issue 15's end-to-end ones, then the example; a run cut short keeps what
# came first. Budget (worst case, every step at its timeout): tests 140 s,
# kernel benchmark 120 s, cuBLAS 45 s, end-to-end decode 150 s, its torch
# peer 45 s, the example 2 x 45 s: 590 s. Give the device call 600 s.
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
  timeout 140 "$t" --test-threads=1 --skip _host:: >> "$out/tests.log" 2>&1
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
for transport in inproc tcp; do
  start=$SECONDS
  echo "#### disaggregated --backend cuda --transport $transport" >> "$out/example.log"
  timeout 45 "$here/examples/disaggregated" --backend cuda --transport "$transport" \
    >> "$out/example.log" 2>&1
  rc=$?
  note "== disaggregated --backend cuda --transport $transport: exit $rc in $((SECONDS - start))s"
  tail -3 "$out/example.log"
  [[ $rc -eq 0 ]] || status=1
done
exit $status
RUN
chmod +x "$bundle/run.sh"
du -sh "$bundle"
ls -la "$bundle" "$bundle/tests" "$bundle/benches"
