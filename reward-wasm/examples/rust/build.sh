#!/usr/bin/env bash
# Builds the Rust example (cdylib for wasm32-unknown-unknown, using the SDK in ../../sdk/rust).
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
tools="${REWARD_TOOLS:-$(cd ../.. && pwd)/.tools}"
cargo build --quiet --release --locked --target wasm32-unknown-unknown --target-dir "$tools/target"
cp "$tools/target/wasm32-unknown-unknown/release/anneal_reward_example.wasm" "$out/rust.wasm"
