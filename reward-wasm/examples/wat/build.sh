#!/usr/bin/env bash
# The WAT example needs no build: the host loads `.wat` text directly. Copied for uniformity.
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
cp reward.wat "$out/wat.wat"
