#!/usr/bin/env bash
# Engine benchmark: Anneal vs PyTorch CPU at 2 threads, one table.
#   bench/engine_bench.sh [row-filter]
# Uses $REPO/.venv when it has torch, else creates it (python3 -m venv + pip install torch).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
THREADS="${THREADS:-2}"
VENV="${VENV:-$REPO/.venv}"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "creating $VENV with torch (one time, a few minutes)" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet torch
fi
cargo build --release --quiet -p anneal-engine --example engine_bench
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/examples/engine_bench"
OUT="$(mktemp)"
trap 'rm -f "$OUT"' EXIT
RAYON_NUM_THREADS="$THREADS" "$BIN" "$@" >"$OUT"
OMP_NUM_THREADS="$THREADS" "$VENV/bin/python" bench/engine_bench_torch.py --anneal "$OUT" --threads "$THREADS"
