#!/usr/bin/env bash
# Builds the C calculator environment: freestanding clang + lld, no libc, no imports, into
# OUT/env_calculator_c.wasm. Usage: build.sh OUT
set -euo pipefail
cd "$(dirname "$0")"
out="${1:-../../out}"
mkdir -p "$out"
clang --target=wasm32 -O2 -nostdlib -ffreestanding -Wall -Werror \
  -Wl,--no-entry -Wl,--export-dynamic -Wl,--strip-all \
  -o "$out/env_calculator_c.wasm" calculator.c
