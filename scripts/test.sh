#!/usr/bin/env bash
# The test command: installs what the tests need (scripts/setup.sh: reward toolchains and
# examples, the corpus, the web UI's packages and headless Chromium; idempotent, so later runs
# skip what is there), then runs every crate's unit and integration tests and the end-to-end
# tests in release mode (numeric code is slow unoptimized, and one profile means heavy
# dependencies compile once). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The CUDA kernels' compile test finds NVRTC and ptxas here, and must really compile (no SKIP).
source scripts/cuda-tools-env.sh
export ANNEAL_REQUIRE_CUDA_TOOLS=1
cargo test --workspace --release "$@"
