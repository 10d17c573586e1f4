#!/usr/bin/env bash
# Decode throughput: `anneal generate` vs Hugging Face transformers `generate` on the same model
# (the debug Llama shape with random weights, saved once by bench/generate_vs_hf.py), greedy with
# a KV cache, at batch 1 and batch 32; Anneal in its default batch-invariant mode and with
# --fast. Runs alternate for ROUNDS rounds; prints decode tokens/s, Anneal / HF, and the cost of
# batch invariance (fast / invariant), with the CPU's features and the load.
#   bash bench/generate_vs_hf.sh          # NEW=64 PROMPT=16 ROUNDS=2 THREADS=2 BATCHES="1 32"
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
THREADS="${THREADS:-2}" NEW="${NEW:-64}" PROMPT="${PROMPT:-16}" ROUNDS="${ROUNDS:-2}"
BATCHES="${BATCHES:-1 32}"
. "$REPO/bench/peer_env.sh"
need_venv torch transformers
cargo build --release --quiet --workspace
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
"$VENV/bin/python" bench/generate_vs_hf.py save "$OUT/model"
PROMPT_IDS="$(seq -s, 11 $((10 + PROMPT)))"
cpu_features
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
    for b in $BATCHES; do
        for mode in invariant fast; do
            RAYON_NUM_THREADS="$THREADS" "$BIN" generate --model-dir "$OUT/model" --prompt-tokens "$PROMPT_IDS" \
                --max-new-tokens "$NEW" --temperature 0 --batch "$b" $([ $mode = fast ] && echo --fast) \
                >"$OUT/anneal-$mode-$b-$r.json"
        done
        OMP_NUM_THREADS="$THREADS" "$VENV/bin/python" bench/generate_vs_hf.py run "$OUT/model" --batch "$b" \
            --new "$NEW" --prompt "$PROMPT" --threads "$THREADS" >"$OUT/hf-$b-$r.json" 2>"$OUT/hf-$b-$r.err" \
            || { echo "HF batch $b failed:"; tail -5 "$OUT/hf-$b-$r.err"; exit 1; }
    done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$VENV/bin/python" - "$OUT" "$ROUNDS" "$BATCHES" <<'PY'
import json, statistics, sys
out, rounds, batches = sys.argv[1], int(sys.argv[2]), [int(b) for b in sys.argv[3].split()]
tps = lambda f: json.load(open(f))["decode_tokens_per_s"]
med = lambda xs: statistics.median(xs)
print(f"{'batch':>5} {'anneal inv':>11} {'anneal fast':>12} {'HF':>9} {'inv/HF':>7} {'fast/HF':>8} {'inv cost':>9}   (decode tokens/s)")
for b in batches:
    inv = med([tps(f"{out}/anneal-invariant-{b}-{r}.json") for r in range(1, rounds + 1)])
    fast = med([tps(f"{out}/anneal-fast-{b}-{r}.json") for r in range(1, rounds + 1)])
    hf = med([tps(f"{out}/hf-{b}-{r}.json") for r in range(1, rounds + 1)])
    print(f"{b:>5} {inv:>11.0f} {fast:>12.0f} {hf:>9.0f} {inv / hf:>6.2f}x {fast / hf:>7.2f}x {fast / inv:>8.2f}x")
print("inv cost = fast / batch-invariant decode speed (1.00x: invariance is free)")
PY
