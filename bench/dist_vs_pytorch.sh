#!/usr/bin/env bash
# Sharded data parallelism: Anneal FSDP vs PyTorch FSDP2 (`fully_shard`, gloo) on the debug
# Llama (hidden 256, 4 layers, FFN 1024, vocab 8192), 2 ranks with one compute thread each, a
# global batch of 8 x 256 (4 sequences per rank), AdamW and clipping, f32. Runs alternate
# (Anneal, PyTorch) for ROUNDS rounds in one invocation, so a busy machine slows both alike.
# Prints the median global tokens/s over the steps after WARMUP, each side's peak resident memory
# per rank (maximum RSS: what the OS charged the process, libraries included) and Anneal's own
# figures from metrics.jsonl: tensor peak, comm_bytes per step against the theoretical FSDP volume
# (each rank sends (N-1)/N of the parameters in the all-gather before the forward, of the blocks'
# again before their backward and of the gradients in the reduce-scatter), and the per-rank
# parameter + gradient + optimizer bytes.
#   bash bench/dist_vs_pytorch.sh            # STEPS=20 WARMUP=5 ROUNDS=2
# Needs the corpus of configs/llama3_debug.toml (bash scripts/setup.sh), MPI
# (scripts/setup-mpi.sh) and torch + transformers in $VENV (default .venv, made once).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
STEPS="${STEPS:-20}" WARMUP="${WARMUP:-5}" ROUNDS="${ROUNDS:-2}" NPROC=2
. "$REPO/bench/peer_env.sh"
need_venv torch transformers
cargo build --release --quiet --workspace
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
cpu_features
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
anneal_run() { # round
    # /usr/bin/time reports each rank's maximum RSS (in KiB) on that rank's stderr.
    mpiexec -n "$NPROC" /usr/bin/time -f "maxrss_kib %M" "$BIN" train configs/llama3_debug.toml \
        --run-dir "$OUT/anneal-$1" --set parallelism.dp_shard="$NPROC" \
        --set training.threads=1 --set training.micro_batch_size=4 \
        --set training.steps="$STEPS" --set metrics.log_freq=1 --set metrics.eval_freq=0 \
        --set checkpoint.interval=0 --set metrics.progress_bar=false \
        >"$OUT/anneal-$1.log" 2>"$OUT/anneal-$1.err" \
        || { echo "anneal failed:"; tail -5 "$OUT/anneal-$1.err"; exit 1; }
}
torch_run() { # round
    OMP_NUM_THREADS=1 "$VENV/bin/torchrun" --nproc_per_node "$NPROC" bench/dist_vs_pytorch.py \
        --steps "$STEPS" >"$OUT/torch-$1.json" 2>"$OUT/torch-$1.err" \
        || { echo "torch failed:"; tail -5 "$OUT/torch-$1.err"; exit 1; }
}
for r in $(seq 1 "$ROUNDS"); do
    anneal_run "$r"
    torch_run "$r"
    echo "round $r done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$VENV/bin/python" - "$OUT" "$ROUNDS" "$WARMUP" "$NPROC" <<'PY'
import json, re, statistics, sys
out, rounds, warmup, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def med(xs): return statistics.median(xs[warmup:]) if len(xs) > warmup else float("nan")
print(f"{'round':>5} {'anneal tok/s':>13} {'torch tok/s':>12} {'ratio':>6} {'anneal RSS MiB':>15} {'torch RSS MiB':>14}")
ratios, mems = [], []
for r in range(1, rounds + 1):
    rows = [json.loads(l) for l in open(f"{out}/anneal-{r}/metrics.jsonl")]
    a = med([x["tokens_per_s"] for x in rows])
    rss_a = max(int(m) * 1024 for m in re.findall(r"maxrss_kib (\d+)", open(f"{out}/anneal-{r}.err").read()))
    t = json.loads(open(f"{out}/torch-{r}.json").read().strip().splitlines()[-1])
    p = med(t["tokens_per_s"])
    rss_t = max(t["peak_rss_bytes"])
    ratios.append(a / p)
    mems.append(rss_a / rss_t)
    print(f"{r:>5} {a:>13.0f} {p:>12.0f} {a / p:>5.2f}x {rss_a / 2**20:>15.0f} {rss_t / 2**20:>14.0f}")
last = rows[-1]
log = open(f"{out}/anneal-{rounds}.log").read()
params = int(re.search(r"\((\d+) parameters", log).group(1))
# Per block units (reshard after forward): every parameter is all-gathered before its forward
# and reduce-scattered, and the blocks' are all-gathered again before their backward.
units = re.search(r"fsdp: (\d+) block units \(largest (\d+) bytes", log)
regather = int(units.group(1)) * int(units.group(2)) if units else 0
theory = (n - 1) / n * (2 * params * 4 + regather)
print(f"median: tokens/s {statistics.median(ratios):.2f}x PyTorch (> 1: Anneal faster); "
      f"peak RSS {statistics.median(mems):.2f}x PyTorch's (< 1: Anneal smaller)")
print(f"anneal per rank: tensor peak {last['mem_peak_bytes'] / 2**20:.0f} MiB, parameter + gradient + "
      f"optimizer bytes {last['state_bytes'] / 2**20:.1f} MiB, comm_bytes {last['comm_bytes'] / 1e6:.1f} MB "
      f"per step (send buffers) vs the ring volume of FSDP {theory / 1e6:.1f} MB per rank")
PY
