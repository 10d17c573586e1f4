#!/usr/bin/env bash
# Checkpoint saves: seconds the training thread is blocked by an asynchronous save (host-memory
# snapshot + hand-off) vs. a synchronous save (snapshot + write + fsync + publish), for the debug
# Llama and a ~134M-parameter Llama with AdamW state. Target: blocked <= 5% of sync.
#   bash bench/checkpoint_bench.sh [DIR]     # DIR: where to write (default target/tmp/checkpoint_bench)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
cargo build --release --quiet -p anneal-plugin-llama -p anneal-train --example checkpoint_bench
"${CARGO_TARGET_DIR:-$REPO/target}/release/examples/checkpoint_bench" "$@"
