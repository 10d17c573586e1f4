#!/usr/bin/env bash
# Token files read in place: peak resident memory of `anneal train` on a generated nanoGPT
# `train.bin` of SIZE_GB (default 5) against the same run on a 5 MB one, and the files' size.
# The target: the big run's peak within a few MB of the small one's (memory flat in the corpus
# size; the page cache is not the process's), and tokens/s alike.
#   bash bench/token_files_memory.sh [SIZE_GB] [DIR]   # DIR: where to write (default target/tmp/token_files)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
SIZE_GB="${1:-5}"
DIR="${2:-$REPO/target/tmp/token_files}"
cargo build --release --quiet -p anneal -p anneal-plugin-llama -p anneal-plugin-adamw
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
mkdir -p "$DIR"
# A tokenizer of the built-in corpus (vocab 8192), trained once by a one-step run.
if [ ! -f "$DIR/tokenizer.json" ]; then
  "$BIN" train configs/llama3_debug.toml --run-dir "$DIR/tok" --set training.steps=1 \
    --set metrics.eval_freq=0 --set metrics.progress_bar=false >/dev/null
  cp "$DIR/tok/tokenizer.json" "$DIR/tokenizer.json"
fi
# Ids below 8192 as little-endian u16, written in 64 MiB blocks (no Python needed).
gen() { # gen FOLDER BYTES
  mkdir -p "$1"
  if [ "$(stat -c %s "$1/train.bin" 2>/dev/null || echo 0)" != "$2" ]; then
    # Random bytes with the high bits of each u16 masked off.
    head -c "$2" /dev/urandom | perl -e 'binmode STDIN; binmode STDOUT; while (read(STDIN, my $b, 1<<20)) { my @v = unpack("v*", $b); print pack("v*", map { $_ & 8191 } @v) }' > "$1/train.bin"
  fi
}
run() { # run NAME FOLDER
  /usr/bin/time -f "%M" -o "$DIR/$1.rss" "$BIN" train configs/llama3_debug.toml --run-dir "$DIR/run-$1" \
    --set data.path="\"$2\"" --set data.tokenizer="\"$DIR/tokenizer.json\"" --set training.steps=100 \
    --set metrics.eval_freq=0 --set metrics.log_freq=100 \
    --set metrics.progress_bar=false 2>&1 | grep -E "^step +100" || true
  rm -rf "$DIR/run-$1"
}
gen "$DIR/small" $((5 * 1000 * 1000))
gen "$DIR/big" $((SIZE_GB * 1000 * 1000 * 1000))
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores"
for name in small big; do
  run "$name" "$DIR/$name"
  awk -v n="$name" -v b="$(stat -c %s "$DIR/$name/train.bin")" -v r="$(cat "$DIR/$name.rss")" \
    'BEGIN { printf "%-6s train.bin %9.1f MB   peak RSS %7.1f MB\n", n, b / 1e6, r / 1024 }'
done
awk -v a="$(cat "$DIR/big.rss")" -v b="$(cat "$DIR/small.rss")" \
  'BEGIN { printf "peak RSS big / small: %.3f\n", a / b }'
