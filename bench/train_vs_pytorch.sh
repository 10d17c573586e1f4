#!/usr/bin/env bash
# Training throughput: Anneal vs PyTorch on the same Llama shape (hidden 256, 4 layers, 4 heads,
# FFN 1024, vocab 8192, batch 8 x 256, AdamW, clipping, 2 threads), in f32 and in bf16 mixed
# precision:
#   f32:  Anneal (training.dtype = "float32")   vs PyTorch eager and torch.compile
#   bf16: Anneal (training.dtype = "bfloat16")  vs PyTorch eager under CPU bf16 autocast
# Runs alternate (Anneal f32, Anneal bf16, eager, compile, eager bf16) for ROUNDS rounds in one
# invocation, so a busy machine slows all of them alike; each figure is the median tokens/s over
# the steps after WARMUP, and the ratios are Anneal / peer. Prints the CPU's features and the
# load average next to the table.
#   bash bench/train_vs_pytorch.sh            # STEPS=20 WARMUP=5 ROUNDS=2 THREADS=2
#   MODES="f32" bash bench/train_vs_pytorch.sh   # only the f32 half
#   MODEL=moe MODES=f32 bash bench/train_vs_pytorch.sh   # the debug Qwen3-MoE
#     (configs/qwen3_moe_debug.toml) vs HF Qwen3MoeForCausalLM, PyTorch eager only
# Needs the corpus and tokenizer of configs/llama3_debug.toml (bash scripts/setup.sh).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
THREADS="${THREADS:-2}" STEPS="${STEPS:-20}" WARMUP="${WARMUP:-5}" ROUNDS="${ROUNDS:-2}"
MODES="${MODES:-f32 bf16}"
MODEL="${MODEL:-llama}"
CONFIG="$([ "$MODEL" = moe ] && echo configs/qwen3_moe_debug.toml || echo configs/llama3_debug.toml)"
. "$REPO/bench/peer_env.sh"
need_venv torch transformers
cargo build --release --quiet --workspace
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
cpu_features
echo "anneal: $("$BIN" info 2>/dev/null | grep -iE "simd|matmul" | tr "\n" " " || true)"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
anneal_run() { # dtype round
    RAYON_NUM_THREADS="$THREADS" "$BIN" train "$CONFIG" --run-dir "$OUT/anneal-$1-$2" \
        --set training.steps="$STEPS" --set metrics.log_freq=1 --set metrics.eval_freq=0 \
        --set checkpoint.interval=0 --set metrics.progress_bar=false \
        --set training.dtype="\"$([ "$1" = bf16 ] && echo bfloat16 || echo float32)\"" >"$OUT/anneal-$1-$2.log"
}
torch_run() { # mode dtype round
    OMP_NUM_THREADS="$THREADS" "$VENV/bin/python" bench/train_vs_pytorch.py --mode "$1" --dtype "$2" --model "$MODEL" \
        --steps "$STEPS" --threads "$THREADS" >"$OUT/$1-$2-$3.json" 2>"$OUT/$1-$2-$3.err" \
        || { echo "torch $1 $2 failed:"; tail -5 "$OUT/$1-$2-$3.err"; exit 1; }
}
for r in $(seq 1 "$ROUNDS"); do
    for d in $MODES; do anneal_run "$d" "$r"; done
    for d in $MODES; do
        torch_run eager "$d" "$r"
        if [ "$d" = f32 ] && [ "$MODEL" != moe ]; then torch_run compile f32 "$r"; fi
    done
    echo "round $r done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$VENV/bin/python" - "$OUT" "$ROUNDS" "$WARMUP" "$MODES" "$MODEL" <<'PY'
import json, statistics, sys
out, rounds, warmup, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
moe = sys.argv[5] == "moe"
def med(xs): return statistics.median(xs[warmup:]) if len(xs) > warmup else float("nan")
def anneal(d, r):
    steps = [json.loads(l) for l in open(f"{out}/anneal-{d}-{r}/metrics.jsonl")]
    return med([s["tokens_per_s"] for s in steps if "tokens_per_s" in s])
def torch(m, d, r): return med(json.load(open(f"{out}/{m}-{d}-{r}.json"))["tokens_per_s"])
rows = []
for d in modes:
    peers = [("eager", "f32"), ("compile", "f32")] if d == "f32" else [("eager", "bf16")]
    if moe:
        peers = [("eager", d)]
    for r in range(1, rounds + 1):
        a = anneal(d, r)
        rows.append((d, str(r), a, [(f"{m} {pd}", torch(m, pd, r)) for m, pd in peers]))
print(f"{'dtype':>5} {'round':>5} {'anneal tok/s':>13}  peers (tok/s, Anneal / peer)")
for d, r, a, ps in rows:
    print(f"{d:>5} {r:>5} {a:>13.0f}  " + "  ".join(f"{n}: {v:.0f} ({a / v:.2f}x)" for n, v in ps))
for d in modes:
    rs = [x for x in rows if x[0] == d]
    a = statistics.median(x[2] for x in rs)
    names = [n for n, _ in rs[0][3]]
    peers = {n: statistics.median(dict(x[3])[n] for x in rs) for n in names}
    print(f"{d:>5} {'all':>5} {a:>13.0f}  " + "  ".join(f"{n}: {v:.0f} ({a / v:.2f}x)" for n, v in peers.items())
          + "   (median of rounds; > 1x: Anneal faster)")
PY
