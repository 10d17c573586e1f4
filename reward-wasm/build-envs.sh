#!/usr/bin/env bash
# Builds every example environment (reward-wasm/envs/<name>) into reward-wasm/out/env_<name>.wasm
# (gitignored); see ENVIRONMENTS.md. Usage: reward-wasm/build-envs.sh [NAME...]   (default: all)
# Toolchains come from scripts/setup-reward.sh (reward-wasm/.tools). Build caches go under
# out/ (out/.target for cargo, out/.zig-cache for Zig). An environment that fails to build is
# reported and its output removed; tests/env_examples.rs then fails in CI (CI=true) and skips it
# locally. Exits 1 if any failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/out"
mkdir -p "$out"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  names=(calculator calculator_c calculator_zig calculator_py code retrieval)
fi
failed=()
for name in "${names[@]}"; do
  start=$(date +%s)
  rm -f "$out/env_$name.wasm"
  if bash "$here/envs/$name/build.sh" "$out" >"$out/env_$name.log" 2>&1; then
    echo "environment $name: built in $(( $(date +%s) - start )) s ($(wc -c <"$out/env_$name.wasm") bytes)"
  else
    echo "environment $name: FAILED (log: $out/env_$name.log)" >&2
    tail -n 20 "$out/env_$name.log" >&2
    rm -f "$out/env_$name.wasm"
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "environments that failed to build: ${failed[*]}" >&2
  exit 1
fi
