#!/usr/bin/env bash
# Builds the Python example as a component with `componentize-py` from PyPI (installed by
# scripts/setup-reward.sh). The component imports WASI preview 2 (deny-all stubs in the host).
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
tools="${REWARD_TOOLS:-$(cd ../.. && pwd)/.tools}"
"$tools/venv/bin/componentize-py" -d ../../wit -w reward componentize app -o "$out/python.wasm"
