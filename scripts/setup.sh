#!/usr/bin/env bash
# Installs the toolchain pieces Anneal's builds and tests need. Idempotent.
set -euo pipefail
rustup component add rustfmt clippy >/dev/null 2>&1 || true
bash "$(dirname "$0")/setup-reward.sh"
