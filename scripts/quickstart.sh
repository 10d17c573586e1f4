#!/usr/bin/env bash
# The main job on a fresh machine: fetch the built-in corpus, install MPI, build the workspace (the anneal
# binary and the plugins), and train the debug Llama on it. Extra arguments go to `anneal train`:
#   bash scripts/quickstart.sh --set training.steps=50 --run-dir runs/first
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-corpus.sh
# The build links MPI (multi-process training) and generates its bindings with libclang.
bash scripts/setup-mpi.sh
cargo build --release --workspace
exec "${CARGO_TARGET_DIR:-target}/release/anneal" train configs/llama3_debug.toml "$@"
