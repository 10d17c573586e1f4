#!/usr/bin/env bash
# Builds the Zig calculator environment (on the Zig SDK, ../../sdk/zig/anneal_env.zig) with
# `ziglang` from PyPI (installed by scripts/setup-reward.sh) into OUT/env_calculator_zig.wasm.
# Usage: build.sh OUT
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
tools="${REWARD_TOOLS:-$(cd ../.. && pwd)/.tools}"
mod=(-target wasm32-freestanding -O ReleaseSmall)
"$tools/venv/bin/python" -m ziglang build-exe -fno-entry -rdynamic \
  "${mod[@]}" --dep anneal_env -Mroot=calculator.zig "${mod[@]}" -Manneal_env=../../sdk/zig/anneal_env.zig \
  --cache-dir "$out/.zig-cache" --global-cache-dir "$out/.zig-cache" \
  --name env_calculator_zig -femit-bin="$out/env_calculator_zig.wasm"
