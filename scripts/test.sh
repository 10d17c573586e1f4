#!/usr/bin/env bash
# The test command: every crate's unit and integration tests, in release mode (numeric code is
# slow unoptimized, and one profile means heavy dependencies compile once).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --release "$@"
