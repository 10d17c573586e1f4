#!/usr/bin/env bash
# Builds the Zig calculator environment with `ziglang` from PyPI (installed by
# scripts/setup-reward.sh) into OUT/env_calculator_zig.wasm. Usage: build.sh OUT
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
tools="${REWARD_TOOLS:-$(cd ../.. && pwd)/.tools}"
"$tools/venv/bin/python" -m ziglang build-exe calculator.zig -target wasm32-freestanding -fno-entry \
  -O ReleaseSmall --export=alloc --export=env_init --export=env_step --export=env_close \
  --export=output_ptr --export=output_len --export=anneal_env_abi \
  --cache-dir "$out/.zig-cache" --global-cache-dir "$out/.zig-cache" \
  -femit-bin="$out/env_calculator_zig.wasm"
