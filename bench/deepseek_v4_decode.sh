#!/usr/bin/env bash
# DeepSeek-V4 decode speed with the per-layer caches (plugins/deepseek-v4/src/decode.rs) against
# the recompute it replaced (each step ran the training forward over the whole prefix): `anneal
# generate` (batch-invariant, one row) on a four-block model (sliding, CSA, HCA, CSA; the widths
# of bench/deepseek_v4_attention.py: hidden 512, HEADS heads of 128, window 128, CSA blocks of
# 4 with top 512, HCA blocks of 128) after random prompts of each length in PREFIXES, NEW tokens
# each; prints decode tokens/s. OLD_PLUGIN_DIR, when set, is a folder with the deepseek_v4 plugin
# built from a commit before the caches (it is searched first), measured the same way.
# Measured (HEADS=2, 2 threads shared with other builds; the recompute plugin built from
# 37303f4, the commit before the caches):
#     prefix     cached tok/s  recompute tok/s
#        256            75.38             5.64
#       2048            79.54             0.56
# A cached step's cost follows the window and the compressed blocks (a quarter of the prefix
# for CSA, scored and masked), not the prefix: flat here, where the weights dominate.
#   bash bench/deepseek_v4_decode.sh      # PREFIXES="256 2048" NEW=16 HEADS=2 THREADS=2
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
THREADS="${THREADS:-2}" NEW="${NEW:-16}" HEADS="${HEADS:-2}" PREFIXES="${PREFIXES:-256 2048}"
. "$REPO/bench/peer_env.sh"
need_venv torch transformers
cargo build --release --quiet -p anneal-plugin-deepseek-v4 -p anneal
TARGET="${CARGO_TARGET_DIR:-$REPO/target}/release"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
PY="$VENV/bin/python"
"$PY" bench/deepseek_v4_attention.py save "$OUT/model" --kind mix --heads "$HEADS" >/dev/null 2>&1
cpu_features
run() { # plugin dir, prompt length
    local prompt
    prompt="$("$PY" -c "import random; random.seed($2); print(','.join(str(random.randrange(256)) for _ in range($2)))")"
    ANNEAL_PLUGIN_PATH="$1" RAYON_NUM_THREADS="$THREADS" "$TARGET/anneal" generate --model-dir "$OUT/model" \
        --prompt-tokens "$prompt" --max-new-tokens "$NEW" --temperature 0 2>"$OUT/stderr" |
        "$PY" -c "import json, sys; print(f\"{json.load(sys.stdin)['decode_tokens_per_s']:.2f}\")"
}
printf '%8s %16s %16s\n' prefix "cached tok/s" "recompute tok/s"
for p in $PREFIXES; do
    new="$(run "$TARGET" "$p")"
    old="-"
    if [ -n "${OLD_PLUGIN_DIR:-}" ]; then old="$(run "$OLD_PLUGIN_DIR:$TARGET" "$p")"; fi
    printf '%8s %16s %16s\n' "$p" "$new" "$old"
done
