#!/usr/bin/env bash
# Calls per second of fresh-store reward scoring for the example modules (figures only).
# Usage: bench/reward_bench.sh [CALLS]   (build the examples first: reward-wasm/build-examples.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --quiet --release -p anneal-reward --example reward_bench -- "$@"
