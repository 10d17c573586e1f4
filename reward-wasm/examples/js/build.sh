#!/usr/bin/env bash
# Builds the JavaScript example as a component with `@bytecodealliance/componentize-js` from npm
# (installed by scripts/setup-reward.sh). The component imports WASI preview 2 (deny-all stubs
# in the host); `wasi:http` is disabled, since the sandbox links no HTTP.
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
tools="${REWARD_TOOLS:-$(cd ../.. && pwd)/.tools}"
"$tools/node/node_modules/.bin/componentize-js" reward.js --wit ../../wit --world-name reward \
  --disable http fetch-event -o "$out/js.wasm"
