#!/usr/bin/env bash
# One Gated DeltaNet mixer (the gated delta rule with l2-normalized q and k, per-head decay),
# forward + backward: Anneal's engine (ops::gated_delta_rule, run by
# host/engine/examples/delta_rule_bench.rs) vs transformers' torch_chunk_gated_delta_rule
# (Qwen3.5's PyTorch path) under autograd. Shape: batch 1, 16 key heads, 16 value heads, head
# dim 128 (Qwen3.5's linear-attention head dim), f32, 2 threads, at each length in SEQS.
# Runs alternate (anneal, torch) for ROUNDS rounds in one invocation, so a busy machine slows
# both alike; each figure is the median seconds per step over the iterations after WARMUP, and
# the ratio is torch / Anneal (> 1x: Anneal faster). Prints the CPU's features and the load.
#   bash bench/delta_rule_vs_pytorch.sh       # SEQS="2048 8192" ITERS=4 WARMUP=1 ROUNDS=3
#   SEQS=4096 KHEADS=8 VHEADS=16 bash bench/delta_rule_vs_pytorch.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
THREADS="${THREADS:-2}" ITERS="${ITERS:-4}" WARMUP="${WARMUP:-1}" ROUNDS="${ROUNDS:-3}"
SEQS="${SEQS:-2048 8192}"
SHAPE=(--batch "${BATCH:-1}" --k-heads "${KHEADS:-16}" --v-heads "${VHEADS:-16}"
       --head-dim "${HEAD_DIM:-128}" --iters "$ITERS")
. "$REPO/bench/peer_env.sh"
need_venv torch transformers
cargo build --release --quiet -p anneal-engine --example delta_rule_bench
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/examples/delta_rule_bench"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
cpu_features
echo "torch: $("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())')"
echo "shape: ${SHAPE[*]} threads $THREADS, seq in $SEQS"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
    for t in $SEQS; do
        RAYON_NUM_THREADS="$THREADS" "$BIN" --seq "$t" "${SHAPE[@]}" >"$OUT/anneal-$t-$r.json"
        OMP_NUM_THREADS="$THREADS" "$VENV/bin/python" bench/delta_rule_vs_pytorch.py --seq "$t" \
            --threads "$THREADS" "${SHAPE[@]}" >"$OUT/torch-$t-$r.json" 2>"$OUT/torch-$t-$r.err" \
            || { echo "torch failed:"; tail -5 "$OUT/torch-$t-$r.err"; exit 1; }
    done
    echo "round $r done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "anneal kernels: $("$VENV/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["kernels"])' "$OUT/anneal-$(echo $SEQS | cut -d' ' -f1)-1.json")"
"$VENV/bin/python" - "$OUT" "$ROUNDS" "$WARMUP" "$SEQS" <<'PY'
import json, statistics, sys
out, rounds, warmup, seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
def med(name, t, r, key="seconds"):
    s = json.load(open(f"{out}/{name}-{t}-{r}.json"))[key]
    return statistics.median(s[warmup:] if len(s) > warmup else s)
print(f"{'seq':>6} {'round':>5} {'anneal s/step':>14} {'torch s/step':>13} {'torch/anneal':>13}"
      f"   forward only: {'anneal':>7} {'torch':>7} {'ratio':>6}")
for t in seqs:
    rows = [(med("anneal", t, r), med("torch", t, r), med("anneal", t, r, "forward"),
             med("torch", t, r, "forward")) for r in range(1, rounds + 1)]
    for r, (a, p, af, pf) in enumerate(rows, 1):
        print(f"{t:>6} {r:>5} {a:>14.3f} {p:>13.3f} {p / a:>12.2f}x"
              f"                 {af:>7.3f} {pf:>7.3f} {pf / af:>5.2f}x")
    a, p = statistics.median(x[0] for x in rows), statistics.median(x[1] for x in rows)
    print(f"{t:>6} {'all':>5} {a:>14.3f} {p:>13.3f} {p / a:>12.2f}x   (median of rounds; > 1x: Anneal faster)")
PY
