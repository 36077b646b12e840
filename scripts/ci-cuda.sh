#!/usr/bin/env bash
# CI for the `cuda` feature on a machine without a GPU: installs nvcc from
# PyPI, compiles every kernel (build.rs), lints, and runs the tests (the GPU
# ones print SKIP lines and pass; set HANDOFF_REQUIRE_GPU=1 on a GPU host).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS
# Two steps, so that a failed install stops CI here with its own message
# (inside `eval "$(...)"` its exit status would be lost).
exports="$(scripts/install-nvcc.sh)"
eval "$exports"
echo "ci-cuda: nvcc ready after $((SECONDS - start))s ($NVCC)"
# No separate `cargo build --all-targets`: clippy checks every target
# (benches included) and `cargo test` compiles the kernels (build.rs), the
# library, the tests and the examples; a dev build of them all besides
# cost CI about 4.5 minutes and checked nothing more.
cargo clippy --all-targets --features cuda -- -D warnings
echo "ci-cuda: clippy done after $((SECONDS - start))s"
cargo test --features cuda
echo "ci-cuda: passed in $((SECONDS - start))s"
