#!/usr/bin/env bash
# Builds every example reward module into reward-wasm/out/<language>.wasm (gitignored), and
# exact_match.wat and position_match.wat, the rewards of the RL demo (configs/rl_digits.toml).
# Usage: reward-wasm/build-examples.sh [LANGUAGE...]   (default: all)
# Toolchains come from scripts/setup-reward.sh (reward-wasm/.tools). A language that fails to
# build is reported and its output removed; the parity test then fails in CI (CI=true) and
# skips it locally. Exits 1 if any language failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/out"
mkdir -p "$out"
langs=("$@")
if [ ${#langs[@]} -eq 0 ]; then
  langs=(wat exact_match position_match rust c zig assemblyscript go js python)
fi
failed=()
for lang in "${langs[@]}"; do
  start=$(date +%s)
  ext=wasm
  case "$lang" in wat | exact_match | position_match) ext=wat ;; esac
  rm -f "$out/$lang.$ext"
  if bash "$here/examples/$lang/build.sh" "$out" >"$out/$lang.log" 2>&1; then
    echo "reward example $lang: built in $(( $(date +%s) - start )) s ($(wc -c <"$out/$lang.$ext") bytes)"
  else
    echo "reward example $lang: FAILED (log: $out/$lang.log)" >&2
    tail -n 20 "$out/$lang.log" >&2
    rm -f "$out/$lang.$ext"
    failed+=("$lang")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "reward examples that failed to build: ${failed[*]}" >&2
  exit 1
fi
