#!/usr/bin/env bash
# Builds the Python calculator environment as a component of anneal:environment/environment with
# `componentize-py` from PyPI (installed by scripts/setup-reward.sh) into
# OUT/env_calculator_py.wasm. The component imports WASI preview 2 (deny-all stubs in the host).
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
tools="${REWARD_TOOLS:-$(cd ../.. && pwd)/.tools}"
"$tools/venv/bin/componentize-py" -d ../../wit/environment -w environment componentize app \
  -o "$out/env_calculator_py.wasm"
