#!/usr/bin/env bash
# Linear attention (Qwen3.5's Gated DeltaNet) against transformers' PyTorch implementation on CPU.
#
# 1. Layer: one Qwen3.5 block whose mixer is a Gated DeltaNet (hidden 1024, 8 key / 16 value
#    heads of 128, short conv 4; a small MLP and a 256-token vocabulary so the mixer dominates),
#    forward + cross-entropy + backward at each length in SEQS, f32: Anneal (the qwen3_5 plugin,
#    host/runtime/examples/model_step_bench.rs) vs transformers (torch_chunk_gated_delta_rule
#    under autograd) on the same weights. Runs alternate for ROUNDS rounds in one invocation; each
#    figure is the median seconds per step over the iterations after WARMUP; ratio torch / Anneal
#    (> 1x: Anneal faster).
# 2. Decode: `anneal generate` tokens/s after a CONTEXT-token prompt on a 4-block hybrid Qwen3.5
#    (three Gated DeltaNet blocks, one full attention) against the same model with full attention
#    in every block (the point of linear attention: the per-token cost stays flat), both in the
#    default batch-invariant mode, with transformers' `generate` on the hybrid as the peer; and the
#    fixed state bytes per sequence next to the KV-cache bytes per token.
#   bash bench/linear_attention.sh      # SEQS="2048 8192" ITERS=3 WARMUP=1 ROUNDS=2 CONTEXT=8192 NEW=32
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
THREADS="${THREADS:-2}" ITERS="${ITERS:-3}" WARMUP="${WARMUP:-1}" ROUNDS="${ROUNDS:-2}"
SEQS="${SEQS:-2048 8192}" CONTEXT="${CONTEXT:-8192}" NEW="${NEW:-32}"
. "$REPO/bench/peer_env.sh"
need_venv torch transformers
cargo build --release --quiet --workspace
cargo build --release --quiet -p anneal-runtime --example model_step_bench
TARGET="${CARGO_TARGET_DIR:-$REPO/target}/release"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
PY="$VENV/bin/python"
for kind in layer hybrid full; do
    echo "$kind: $("$PY" bench/linear_attention.py save "$OUT/$kind" --kind "$kind")"
done
cpu_features
echo "torch: $("$PY" -c 'import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())')"
echo "threads $THREADS; layer at seq $SEQS; decode after $CONTEXT tokens, $NEW new"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
PROMPT_IDS="$("$PY" -c "import random; random.seed(0); print(','.join(str(random.randrange(1, 8192)) for _ in range($CONTEXT)))")"
for r in $(seq 1 "$ROUNDS"); do
    for t in $SEQS; do
        RAYON_NUM_THREADS="$THREADS" "$TARGET/examples/model_step_bench" --model-dir "$OUT/layer" \
            --plugin-dir "$TARGET" --seq "$t" --iters "$ITERS" >"$OUT/anneal-$t-$r.json"
        OMP_NUM_THREADS="$THREADS" "$PY" bench/linear_attention.py step "$OUT/layer" --seq "$t" --iters "$ITERS" \
            --threads "$THREADS" >"$OUT/torch-$t-$r.json" 2>"$OUT/torch-$t-$r.err" \
            || { echo "torch failed:"; tail -5 "$OUT/torch-$t-$r.err"; exit 1; }
    done
    for kind in hybrid full; do
        RAYON_NUM_THREADS="$THREADS" "$TARGET/anneal" generate --model-dir "$OUT/$kind" \
            --prompt-tokens "$PROMPT_IDS" --max-new-tokens "$NEW" --temperature 0 >"$OUT/gen-$kind-$r.json"
    done
    OMP_NUM_THREADS="$THREADS" "$PY" bench/linear_attention.py decode "$OUT/hybrid" --prompt "$CONTEXT" --new "$NEW" \
        --threads "$THREADS" >"$OUT/hf-$r.json" 2>"$OUT/hf-$r.err" \
        || { echo "transformers decode failed:"; tail -5 "$OUT/hf-$r.err"; exit 1; }
    echo "round $r done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" - "$OUT" "$ROUNDS" "$WARMUP" "$SEQS" <<'PY'
import json, statistics, sys
out, rounds, warmup, seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
load = lambda f: json.load(open(f))
def med(name, t, r, key="seconds"):
    s = load(f"{out}/{name}-{t}-{r}.json")[key]
    return statistics.median(s[warmup:] if len(s) > warmup else s)
print("Gated DeltaNet block, forward + backward (seconds per step)")
print(f"{'seq':>6} {'round':>5} {'anneal':>8} {'torch':>8} {'torch/anneal':>13}   forward only: {'anneal':>7} {'torch':>7} {'ratio':>6}")
for t in seqs:
    rows = [(med("anneal", t, r), med("torch", t, r), med("anneal", t, r, "forward"), med("torch", t, r, "forward"))
            for r in range(1, rounds + 1)]
    for r, (a, p, af, pf) in enumerate(rows, 1):
        print(f"{t:>6} {r:>5} {a:>8.3f} {p:>8.3f} {p / a:>12.2f}x                 {af:>7.3f} {pf:>7.3f} {pf / af:>5.2f}x")
    a, p = statistics.median(x[0] for x in rows), statistics.median(x[1] for x in rows)
    print(f"{t:>6} {'all':>5} {a:>8.3f} {p:>8.3f} {p / a:>12.2f}x   (median of rounds; > 1x: Anneal faster)")
tps = lambda kind: statistics.median(load(f"{out}/gen-{kind}-{r}.json")["decode_tokens_per_s"] for r in range(1, rounds + 1))
hf = statistics.median(load(f"{out}/hf-{r}.json")["decode_tokens_per_s"] for r in range(1, rounds + 1))
g = load(f"{out}/gen-hybrid-1.json"); f = load(f"{out}/gen-full-1.json")
print("decode after the prompt (tokens/s, batch 1, batch-invariant)")
print(f"  hybrid 3:1 {tps('hybrid'):8.1f}   full attention {tps('full'):8.1f}   hybrid/full {tps('hybrid') / tps('full'):5.2f}x")
print(f"  transformers hybrid {hf:8.1f}   anneal/transformers {tps('hybrid') / hf:5.2f}x")
print(f"  hybrid: {g['cache_bytes_per_token']} KV bytes/token + {g['state_bytes_per_sequence']} state bytes/sequence;"
      f" full: {f['cache_bytes_per_token']} KV bytes/token")
PY
