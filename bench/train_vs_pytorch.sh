#!/usr/bin/env bash
# Training throughput: Anneal vs PyTorch eager and torch.compile on the same Llama shape
# (hidden 256, 4 layers, 4 heads, FFN 1024, vocab 8192, batch 8 x 256, fp32 AdamW, 2 threads).
# Runs alternate (Anneal, eager, compile) for ROUNDS rounds in one invocation; each figure is the
# median tokens/s over the steps after WARMUP, and the ratios are Anneal / peer.
#   bash bench/train_vs_pytorch.sh            # STEPS=20 WARMUP=5 ROUNDS=2 THREADS=2
# Needs the corpus and tokenizer of configs/llama3_debug.toml (bash scripts/setup.sh).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
THREADS="${THREADS:-2}" STEPS="${STEPS:-20}" WARMUP="${WARMUP:-5}" ROUNDS="${ROUNDS:-2}"
VENV="${VENV:-$REPO/.venv}"
if ! "$VENV/bin/python" -c "import torch, transformers" 2>/dev/null; then
    echo "creating $VENV with torch and transformers (one time, a few minutes)" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet torch transformers
fi
cargo build --release --quiet --workspace
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
for r in $(seq 1 "$ROUNDS"); do
    RAYON_NUM_THREADS="$THREADS" "$BIN" train configs/llama3_debug.toml --run-dir "$OUT/anneal-$r" \
        --set training.steps="$STEPS" --set metrics.log_freq=1 --set metrics.eval_freq=0 \
        --set checkpoint.interval=0 --set metrics.progress_bar=false >"$OUT/anneal-$r.log"
    for mode in eager compile; do
        OMP_NUM_THREADS="$THREADS" "$VENV/bin/python" bench/train_vs_pytorch.py --mode "$mode" \
            --steps "$STEPS" --threads "$THREADS" >"$OUT/$mode-$r.json" 2>"$OUT/$mode-$r.err" \
            || { echo "torch $mode failed:"; tail -5 "$OUT/$mode-$r.err"; exit 1; }
    done
done
"$VENV/bin/python" - "$OUT" "$ROUNDS" "$WARMUP" <<'PY'
import json, statistics, sys
out, rounds, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def med(xs): return statistics.median(xs[warmup:]) if len(xs) > warmup else float("nan")
rows = {"anneal": [], "eager": [], "compile": []}
for r in range(1, rounds + 1):
    steps = [json.loads(l) for l in open(f"{out}/anneal-{r}/metrics.jsonl")]
    rows["anneal"].append(med([s["tokens_per_s"] for s in steps if "tokens_per_s" in s]))
    for m in ("eager", "compile"):
        rows[m].append(med(json.load(open(f"{out}/{m}-{r}.json"))["tokens_per_s"]))
print(f"{'round':>5} {'anneal tok/s':>13} {'eager tok/s':>12} {'compile tok/s':>14} {'vs eager':>9} {'vs compile':>11}")
for i in range(rounds):
    a, e, c = rows["anneal"][i], rows["eager"][i], rows["compile"][i]
    print(f"{i + 1:>5} {a:>13.0f} {e:>12.0f} {c:>14.0f} {a / e:>9.2f} {a / c:>11.2f}")
a, e, c = (statistics.median(rows[k]) for k in ("anneal", "eager", "compile"))
print(f"{'all':>5} {a:>13.0f} {e:>12.0f} {c:>14.0f} {a / e:>9.2f} {a / c:>11.2f}   (median of rounds; ratio > 1: Anneal faster)")
PY
