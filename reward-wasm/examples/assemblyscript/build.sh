#!/usr/bin/env bash
# Builds the AssemblyScript example with `assemblyscript` from npm (installed by
# scripts/setup-reward.sh): stub runtime, no abort import.
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
tools="${REWARD_TOOLS:-$(cd ../.. && pwd)/.tools}"
"$tools/node/node_modules/.bin/asc" reward.ts -O3 --runtime stub --use abort= \
  --outFile "$out/assemblyscript.wasm"
