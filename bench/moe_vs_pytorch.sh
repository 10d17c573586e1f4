#!/usr/bin/env bash
# One MoE feed-forward layer, forward + backward: Anneal's engine (ops::moe_ffn, run by
# host/engine/examples/moe_bench.rs) vs PyTorch eager, with the usual loop over experts and with
# torch._grouped_mm where this torch has it. Shape: 4096 tokens, hidden 512, 16 experts, top-2,
# expert FFN 1024, f32, softmax router with renormalised top-k weights, 2 threads.
# Runs alternate (anneal, loop, grouped) for ROUNDS rounds in one invocation, so a busy machine
# slows all of them alike; each figure is the median seconds per layer step over the iterations
# after WARMUP, and the ratios are peer / Anneal (> 1x: Anneal faster). Prints the CPU's
# features and the load average next to the table.
#   bash bench/moe_vs_pytorch.sh        # ITERS=8 WARMUP=2 ROUNDS=3 THREADS=2
#   TOKENS=8192 EXPERTS=64 TOPK=8 FFN=256 bash bench/moe_vs_pytorch.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
THREADS="${THREADS:-2}" ITERS="${ITERS:-8}" WARMUP="${WARMUP:-2}" ROUNDS="${ROUNDS:-3}"
SHAPE=(--tokens "${TOKENS:-4096}" --hidden "${HIDDEN:-512}" --experts "${EXPERTS:-16}"
       --topk "${TOPK:-2}" --ffn "${FFN:-1024}" --iters "$ITERS")
. "$REPO/bench/peer_env.sh"
need_venv torch
cargo build --release --quiet -p anneal-engine --example moe_bench
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/examples/moe_bench"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
MODES="loop"
if "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if hasattr(torch, '_grouped_mm') else 1)"; then
    MODES="loop grouped"
fi
cpu_features
echo "torch: $("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())')"
echo "shape: ${SHAPE[*]} threads $THREADS"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
    RAYON_NUM_THREADS="$THREADS" "$BIN" "${SHAPE[@]}" >"$OUT/anneal-$r.json"
    for m in $MODES; do
        OMP_NUM_THREADS="$THREADS" "$VENV/bin/python" bench/moe_vs_pytorch.py --mode "$m" \
            --threads "$THREADS" "${SHAPE[@]}" >"$OUT/$m-$r.json" 2>"$OUT/$m-$r.err" \
            || { echo "torch $m failed:"; tail -5 "$OUT/$m-$r.err"; exit 1; }
    done
    echo "round $r done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "anneal kernels: $("$VENV/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["kernels"])' "$OUT/anneal-1.json")"
"$VENV/bin/python" - "$OUT" "$ROUNDS" "$WARMUP" "$MODES" <<'PY'
import json, statistics, sys
out, rounds, warmup, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
def med(name, r):
    s = json.load(open(f"{out}/{name}-{r}.json"))["seconds"]
    return statistics.median(s[warmup:] if len(s) > warmup else s)
rows = [(r, med("anneal", r), [(m, med(m, r)) for m in modes]) for r in range(1, rounds + 1)]
print(f"{'round':>5} {'anneal s/step':>14}  peers (s/step, peer / Anneal)")
for r, a, ps in rows:
    print(f"{r:>5} {a:>14.3f}  " + "  ".join(f"torch {m}: {v:.3f} ({v / a:.2f}x)" for m, v in ps))
a = statistics.median(x[1] for x in rows)
peers = {m: statistics.median(dict(x[2])[m] for x in rows) for m in modes}
print(f"{'all':>5} {a:>14.3f}  " + "  ".join(f"torch {m}: {v:.3f} ({v / a:.2f}x)" for m, v in peers.items())
      + "   (median of rounds; > 1x: Anneal faster)")
PY
