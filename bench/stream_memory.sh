#!/usr/bin/env bash
# A text corpus larger than memory, streamed (`data.streaming = true`): peak resident memory of
# `anneal train` on SIZE_GB (default 5) of generated text against the same run on 5 MB, the
# seconds the trainer waited on the background tokenization, and a resume check on the big
# corpus: a run stopped at step 50 (its step-100 checkpoint removed) continues bit for bit.
# The targets: peak RSS under 2 GB and flat in the corpus size, data_wait_s near zero.
#   bash bench/stream_memory.sh [SIZE_GB] [DIR]   # DIR: where to write (default target/tmp/stream)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
SIZE_GB="${1:-5}"
DIR="${2:-$REPO/target/tmp/stream}"
cargo build --release --quiet -p anneal -p anneal-plugin-llama -p anneal-plugin-adamw
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/anneal"
mkdir -p "$DIR"
# A tokenizer of the built-in corpus (vocab 8192), trained once by a one-step run.
if [ ! -f "$DIR/tokenizer.json" ]; then
  "$BIN" train configs/llama3_debug.toml --run-dir "$DIR/tok" --set training.steps=1 \
    --set metrics.eval_freq=0 --set metrics.progress_bar=false >/dev/null
  cp "$DIR/tok/tokenizer.json" "$DIR/tokenizer.json"
fi
# Text files of 250 MB (the last one shorter): lines of words drawn from the built-in corpus,
# seeded, so the corpus is the same on every machine.
gen() { # gen FOLDER BYTES
  mkdir -p "$1"
  if [ "$(cat "$1/.bytes" 2>/dev/null || echo 0)" != "$2" ]; then
    rm -f "$1"/*.txt
    perl -e '
      my ($dir, $total) = @ARGV; srand(7);
      open(my $in, "<", "data/shakespeare/hamlet.txt") or die; local $/; my %seen;
      my @w = grep { !$seen{$_}++ } split(/\s+/, <$in>); close $in;
      my ($file, $left) = (0, $total);
      while ($left > 0) {
        my $size = $left < 250e6 ? $left : 250e6; $left -= $size;
        open(my $out, ">", sprintf("%s/part-%03d.txt", $dir, $file++)) or die;
        my $buf = "";
        while ($size > 0) {
          my $line = join(" ", map { $w[int(rand(@w))] } 1 .. 8 + int(rand(12))) . "\n";
          $line = substr($line, 0, $size) if length($line) > $size;
          $buf .= $line; $size -= length($line);
          if (length($buf) > 1 << 20) { print $out $buf; $buf = "" }
        }
        print $out $buf; close $out;
      }' "$1" "$2"
    echo "$2" > "$1/.bytes"
  fi
}
run() { # run NAME FOLDER RUN_DIR [--set ...]
  local name="$1" folder="$2" run_dir="$3"; shift 3
  /usr/bin/time -f "%M" -o "$DIR/$name.rss" "$BIN" train configs/llama3_debug.toml --run-dir "$run_dir" \
    --set data.path="\"$folder\"" --set data.tokenizer="\"$DIR/tokenizer.json\"" \
    --set data.streaming=true --set training.steps=100 --set metrics.eval_freq=0 \
    --set metrics.log_freq=10 --set metrics.progress_bar=false "$@" 2>&1 | grep -E "^step +100|resuming" || true
}
gen "$DIR/small" $((5 * 1000 * 1000))
gen "$DIR/big" "$(awk -v g="$SIZE_GB" 'BEGIN { printf "%.0f", g * 1e9 }')"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores"
for name in small big; do
  rm -rf "$DIR/run-$name"
  run "$name" "$DIR/$name" "$DIR/run-$name" --set checkpoint.interval=50
  bytes=$(du -sb "$DIR/$name" | cut -f1)
  wait_s=$(tail -1 "$DIR/run-$name/metrics.jsonl" | python3 -c 'import json,sys; print(json.load(sys.stdin).get("data_wait_s", 0))')
  awk -v n="$name" -v b="$bytes" -v r="$(cat "$DIR/$name.rss")" -v w="$wait_s" \
    'BEGIN { printf "%-6s text %9.1f MB   peak RSS %7.1f MB   waited on tokenization %.2f s\n", n, b / 1e6, r / 1024, w }'
done
awk -v a="$(cat "$DIR/big.rss")" -v b="$(cat "$DIR/small.rss")" \
  'BEGIN { printf "peak RSS big / small: %.3f\n", a / b }'
# Resume on the big corpus: drop the step-100 checkpoint, run again from step 50.
grep -o '"loss":[^,]*' "$DIR/run-big/metrics.jsonl" > "$DIR/want.loss"
rm -rf "$DIR/run-big/checkpoints/step-100"
run resumed "$DIR/big" "$DIR/run-big" --set checkpoint.interval=50
grep -o '"loss":[^,]*' "$DIR/run-big/metrics.jsonl" > "$DIR/got.loss"
if cmp -s "$DIR/want.loss" "$DIR/got.loss"; then
  echo "resumed from step 50: the same $(wc -l < "$DIR/got.loss") logged losses bit for bit"
else
  echo "resumed from step 50: the losses DIFFER"; diff "$DIR/want.loss" "$DIR/got.loss" | head; exit 1
fi
rm -rf "$DIR/run-small" "$DIR/run-big"
