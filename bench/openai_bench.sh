#!/usr/bin/env bash
# The OpenAI-compatible endpoint under load: total generated tokens/s of 16 concurrent clients
# (decoded together by continuous batching) vs the same 16 requests one after the other, on the
# debug Llama of configs/llama3_debug.toml (8.4M parameters; a few training steps, since speed
# does not depend on the weights), greedy, 64 new tokens each.
#   bash bench/openai_bench.sh            # CLIENTS=16 MAX_TOKENS=64 STEPS=5 THREADS=(all)
# Needs the corpus (scripts/fetch-corpus.sh) and .venv with openai (scripts/setup-python.sh).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
CLIENTS="${CLIENTS:-16}" MAX_TOKENS="${MAX_TOKENS:-64}" STEPS="${STEPS:-5}"
[ -n "${THREADS:-}" ] && export RAYON_NUM_THREADS="$THREADS"
[ -x .venv/bin/python ] || bash scripts/setup-python.sh
cargo build --release --quiet -p anneal -p anneal-plugin-llama -p anneal-plugin-adamw
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
OUT="$(mktemp -d)"
SERVER=""
trap '[ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; rm -rf "$OUT"' EXIT
"$BIN" train configs/llama3_debug.toml --run-dir "$OUT/bench" --set training.steps="$STEPS" \
    --set checkpoint.interval="$STEPS" --set metrics.eval_freq=0 --set metrics.progress_bar=false \
    >"$OUT/train.log"
"$BIN" serve --addr 127.0.0.1:0 --home "$OUT/home" --model "$OUT/bench/checkpoints/step-$STEPS" \
    >"$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do grep -q "listening on" "$OUT/serve.log" && break; sleep 0.1; done
URL="$(grep -o 'http://[0-9.:]*' "$OUT/serve.log" | head -1)"
[ -n "$URL" ] || { cat "$OUT/serve.log"; exit 1; }
.venv/bin/python bench/openai_bench.py "$URL" "bench-step-$STEPS" --clients "$CLIENTS" --max-tokens "$MAX_TOKENS"
