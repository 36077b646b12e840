#!/usr/bin/env bash
# Installs nvcc (CUDA 13.0) from PyPI into a venv so that `--features cuda`
# builds on machines without a CUDA toolkit (CI, developers without a GPU).
#
# Usage: eval "$(scripts/install-nvcc.sh)"     # exports NVCC
#        scripts/install-nvcc.sh               # prints the export lines
#
# All five packages are pinned: unpinned nvidia-nvvm / nvidia-cuda-crt pull
# 13.5, whose ptxas-facing output fails with "Unsupported .version 9.5".
# Idempotent: when the venv already holds these versions it only prints.
# Progress goes to stderr, the export lines to stdout.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HANDOFF_NVCC_VENV:-$root/.venv-nvcc}"
pins=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
)
stamp="$venv/.handoff-nvcc-pins"
want="${pins[*]}"

find_cu13() {
  # nvidia/cu13 inside the venv's site-packages (python version varies).
  local d
  for d in "$venv"/lib/python*/site-packages/nvidia/cu13; do
    [[ -d "$d" ]] && { echo "$d"; return 0; }
  done
  return 1
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && cu13="$(find_cu13)" && [[ -x "$cu13/bin/nvcc" ]]; then
  echo "install-nvcc: already installed in $venv" >&2
else
  py="${PYTHON:-python3}"
  command -v "$py" >/dev/null || { echo "install-nvcc: $py not found; install python3 (with venv)" >&2; exit 1; }
  echo "install-nvcc: installing ${pins[*]} into $venv" >&2
  [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}" >&2
  cu13="$(find_cu13)" || { echo "install-nvcc: nvidia/cu13 not found under $venv" >&2; exit 1; }
  [[ -x "$cu13/bin/nvcc" ]] || { echo "install-nvcc: $cu13/bin/nvcc missing after install" >&2; exit 1; }
  echo "$want" > "$stamp"
fi

# nvcc finds its include dir (crt, cccl headers) and nvvm relative to its
# own bin/; the PATH entry lets it find ptxas/fatbinary/cicc siblings.
echo "export NVCC='$cu13/bin/nvcc'"
echo "export PATH='$cu13/bin':\"\$PATH\""
