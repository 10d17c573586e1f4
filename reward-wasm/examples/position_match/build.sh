#!/usr/bin/env bash
# The position-match shaping reward of the RL demo: WebAssembly text, loaded directly by the host. Copied.
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
cp reward.wat "$out/position_match.wat"
