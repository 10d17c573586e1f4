#!/usr/bin/env bash
# Builds the Rust code-execution environment (cdylib for wasm32-unknown-unknown, using ../../sdk/rust)
# into OUT/env_code.wasm. Usage: build.sh OUT TARGET_DIR
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
target="${2:-$out/.target}"
cargo build --quiet --release --locked --target wasm32-unknown-unknown --target-dir "$target"
cp "$target/wasm32-unknown-unknown/release/anneal_env_code.wasm" "$out/env_code.wasm"
