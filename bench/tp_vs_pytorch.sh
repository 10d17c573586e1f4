#!/usr/bin/env bash
# Tensor parallelism: Anneal TP(2) (and with sequence parallelism, SP=1) vs PyTorch DTensor TP
# (`parallelize_module` with TorchTitan's Llama plan, gloo) on the debug Llama (hidden 256, 4
# layers, 4 heads, FFN 1024, vocab 8192), 2 ranks with one compute thread each, a global batch
# of 8 x 256 in micro-batches of 1 (every rank of the group runs all of them), AdamW and
# clipping, f32. Runs alternate (Anneal, PyTorch) for ROUNDS rounds, so a busy machine slows
# both alike. Prints the median tokens/s after WARMUP steps, each side's peak resident memory
# per rank, and Anneal's comm_bytes per step.
#   bash bench/tp_vs_pytorch.sh            # STEPS=12 WARMUP=4 ROUNDS=2 SP=0
# Needs the corpus of configs/llama3_debug.toml (bash scripts/setup.sh), MPI
# (scripts/setup-mpi.sh) and torch + transformers in $VENV (default .venv, made once).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
STEPS="${STEPS:-12}" WARMUP="${WARMUP:-4}" ROUNDS="${ROUNDS:-2}" SP="${SP:-0}" NPROC=2
. "$REPO/bench/peer_env.sh"
need_venv torch transformers
cargo build --release --quiet -p anneal -p anneal-plugin-llama -p anneal-plugin-adamw
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
cpu_features
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
SP_SET=() SP_ARG=()
if [ "$SP" = 1 ]; then SP_SET=(--set parallelism.tp_sequence=true); SP_ARG=(--sp); fi
anneal_run() { # round
    mpiexec -n "$NPROC" /usr/bin/time -f "maxrss_kib %M" "$BIN" train configs/llama3_debug.toml \
        --run-dir "$OUT/anneal-$1" --set parallelism.tp="$NPROC" "${SP_SET[@]}" \
        --set training.threads=1 --set training.micro_batch_size=1 \
        --set training.steps="$STEPS" --set metrics.log_freq=1 --set metrics.eval_freq=0 \
        --set checkpoint.interval=0 --set metrics.progress_bar=false \
        >"$OUT/anneal-$1.log" 2>"$OUT/anneal-$1.err" \
        || { echo "anneal failed:"; tail -5 "$OUT/anneal-$1.err"; exit 1; }
}
torch_run() { # round
    OMP_NUM_THREADS=1 "$VENV/bin/torchrun" --nproc_per_node "$NPROC" bench/tp_vs_pytorch.py \
        --steps "$STEPS" "${SP_ARG[@]}" >"$OUT/torch-$1.json" 2>"$OUT/torch-$1.err" \
        || { echo "torch failed:"; tail -5 "$OUT/torch-$1.err"; exit 1; }
}
for r in $(seq 1 "$ROUNDS"); do
    anneal_run "$r"
    torch_run "$r"
    echo "round $r done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$VENV/bin/python" - "$OUT" "$ROUNDS" "$WARMUP" <<'PY'
import json, re, statistics, sys
out, rounds, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def med(xs): return statistics.median(xs[warmup:]) if len(xs) > warmup else float("nan")
print(f"{'round':>5} {'anneal tok/s':>13} {'torch tok/s':>12} {'ratio':>6} {'anneal RSS MiB':>15} {'torch RSS MiB':>14} {'anneal MB/step':>15}")
ratios = []
for r in range(1, rounds + 1):
    rows = [json.loads(l) for l in open(f"{out}/anneal-{r}/metrics.jsonl")]
    a = med([x["tokens_per_s"] for x in rows])
    comm = med([x.get("comm_bytes") or 0 for x in rows]) / 1e6
    rss_a = max(int(m) * 1024 for m in re.findall(r"maxrss_kib (\d+)", open(f"{out}/anneal-{r}.err").read()))
    t = json.loads(open(f"{out}/torch-{r}.json").read().strip().splitlines()[-1])
    p = med(t["tokens_per_s"])
    rss_t = max(t["peak_rss_bytes"])
    ratios.append(a / p)
    print(f"{r:>5} {a:>13.0f} {p:>12.0f} {a / p:>5.2f}x {rss_a / 2**20:>15.0f} {rss_t / 2**20:>14.0f} {comm:>15.1f}")
print(f"median: tokens/s {statistics.median(ratios):.2f}x PyTorch (> 1: Anneal faster)")
PY
