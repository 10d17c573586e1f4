#!/usr/bin/env bash
# Scale features on FSDP(2) (2 MPI ranks, one compute thread each) with the debug Llama, global
# batch 8 x 256, f32 training: the parameter all-gathers exact (float32), in bf16 and quantized
# blockwise (int8, fp8_e4m3, one f32 scale per 128 values), and Muon's owner layout next to AdamW.
# For each run: median tokens/s over the steps after WARMUP, the bytes a rank sent per step in
# parameter all-gathers (fsdp_gather_bytes) and in all (comm_bytes), and the loss at the last step
# against the exact-gather AdamW run (the quantized goal: within 1% after 300 steps). Muon's line
# adds what rank 0 owned: matrices, estimated Newton-Schulz work and the bytes of its all-to-alls;
# `adamw4e-3` is AdamW at Muon's learning rate (the debug config's 8e-4 is AdamW's default there).
# `moe` and `ep2` are the debug Qwen3-MoE (configs/qwen3_moe_debug.toml, 8 experts) on FSDP(2)
# without and with expert parallelism (ep = 2: each rank keeps 4 experts, never gathered, and
# the MoE layers send token rows to them); their line adds the bytes rank 0 sent per step in
# the expert all-to-alls (ep_a2a_bytes). Their losses are compared with each other, not with f32.
#   bash bench/scale_features.sh          # STEPS=300 WARMUP=5 VARIANTS="f32 bf16 int8 fp8 muon moe ep2"
# Needs the corpus of configs/llama3_debug.toml (bash scripts/setup.sh) and MPI (scripts/setup-mpi.sh).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
STEPS="${STEPS:-300}" WARMUP="${WARMUP:-5}" VARIANTS="${VARIANTS:-f32 bf16 int8 fp8 muon moe ep2}"
. "$REPO/bench/peer_env.sh"
cargo build --release --quiet --workspace
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
cpu_features
echo "FSDP(2), $STEPS steps of 8 x 256 tokens; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for v in $VARIANTS; do
    case "$v" in
        f32) set -- configs/llama3_debug.toml --set parallelism.fsdp_all_gather_dtype=float32 ;;
        bf16) set -- configs/llama3_debug.toml --set parallelism.fsdp_all_gather_dtype=bfloat16 ;;
        int8) set -- configs/llama3_debug.toml --set parallelism.fsdp_all_gather_dtype=int8 ;;
        fp8) set -- configs/llama3_debug.toml --set parallelism.fsdp_all_gather_dtype=fp8_e4m3 ;;
        adamw4e-3) set -- configs/llama3_debug.toml --set optimizer.lr=4e-3 ;;
        muon) set -- configs/llama3_debug_muon.toml ;;
        moe) set -- configs/qwen3_moe_debug.toml ;;
        ep2) set -- configs/qwen3_moe_debug.toml --set parallelism.ep=2 ;;
        *) echo "unknown variant $v"; exit 2 ;;
    esac
    mpiexec -n 2 "$BIN" train "$@" --run-dir "$OUT/$v" --set parallelism.dp_shard=2 \
        --set training.threads=1 --set training.micro_batch_size=4 --set training.steps="$STEPS" \
        --set metrics.log_freq=1 --set metrics.eval_freq=0 --set checkpoint.interval=0 \
        --set metrics.progress_bar=false >"$OUT/$v.log" 2>"$OUT/$v.err" \
        || { echo "$v failed:"; tail -5 "$OUT/$v.err"; exit 1; }
    echo "$v done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" "$WARMUP" $VARIANTS <<'PY'
import json, statistics, sys
out, warmup, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def rows(v):
    return [json.loads(l) for l in open(f"{out}/{v}/metrics.jsonl") if '"loss"' in l]
ref = rows("f32")[-1]["loss"] if "f32" in variants else None
moe_ref = rows("moe")[-1]["loss"] if "moe" in variants else None
print(f"{'run':>9} {'tokens/s':>9} {'gather B/step':>14} {'comm B/step':>12} {'last loss':>10} {'vs f32':>8}")
for v in variants:
    r = rows(v)
    tps = statistics.median(x["tokens_per_s"] for x in r[warmup:] or r)
    gather = r[-1].get("fsdp_gather_bytes", 0)
    comm = statistics.median(x.get("comm_bytes", 0) for x in r)
    last = r[-1]["loss"]
    base = moe_ref if v in ("moe", "ep2") else ref
    rel = f"{(last - base) / base * 100:+7.2f}%" if base else "-"
    print(f"{v:>9} {tps:>9.0f} {gather:>14,} {comm:>12,.0f} {last:>10.4f} {rel:>8}")
    if "ep_a2a_bytes" in r[-1]:
        print(f"{'':>9} expert all-to-all bytes sent {r[-1]['ep_a2a_bytes']:,} per step (vs moe)")
    if "owner_matrices" in r[-1]:
        print(f"{'':>9} rank 0 owned {r[-1]['owner_matrices']} matrices, work {r[-1]['owner_work']:.3g}, "
              f"all-to-all bytes sent {r[-1]['owner_bytes']:,} per step")
if "bf16" in variants:
    b = rows("bf16")[-1]["fsdp_gather_bytes"]
    for v in ("int8", "fp8"):
        if v in variants:
            print(f"{v}: {rows(v)[-1]['fsdp_gather_bytes'] / b:.3f} of bf16's gather bytes "
                  f"({(1 - rows(v)[-1]['fsdp_gather_bytes'] / b) * 100:.0f}% fewer)")
PY
