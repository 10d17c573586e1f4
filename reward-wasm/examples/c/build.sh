#!/usr/bin/env bash
# Builds the C example: freestanding clang + lld, no libc, no imports.
set -euo pipefail
cd "$(dirname "$0")"
out="${1:-../../out}"
mkdir -p "$out"
clang --target=wasm32 -O2 -nostdlib -ffreestanding -Wall -Werror \
  -Wl,--no-entry -Wl,--export-dynamic -Wl,--strip-all \
  -o "$out/c.wasm" reward.c
