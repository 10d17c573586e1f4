#!/usr/bin/env bash
# Builds the retrieval environment (cdylib for wasm32-unknown-unknown, using ../../sdk/rust)
# into OUT/env_retrieval.wasm. Usage: build.sh OUT TARGET_DIR
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
target="${2:-$out/.target}"
cargo build --quiet --release --locked --target wasm32-unknown-unknown --target-dir "$target"
cp "$target/wasm32-unknown-unknown/release/anneal_env_retrieval.wasm" "$out/env_retrieval.wasm"
