#!/usr/bin/env bash
# Builds the Zig example with `ziglang` from PyPI (installed by scripts/setup-reward.sh).
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
tools="${REWARD_TOOLS:-$(cd ../.. && pwd)/.tools}"
"$tools/venv/bin/python" -m ziglang build-exe reward.zig -target wasm32-freestanding -fno-entry -O ReleaseSmall \
  --export=alloc --export=score --export=details_ptr --export=details_len \
  --export=anneal_reward_abi --cache-dir "$tools/zig-cache" --global-cache-dir "$tools/zig-cache" \
  -femit-bin="$out/zig.wasm"
