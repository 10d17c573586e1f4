#!/usr/bin/env bash
# mdBook, which builds the manual (docs/, `mdbook build docs`). Idempotent: a matching version
# already on PATH or in ~/.cargo/bin is kept.
set -euo pipefail
MDBOOK_VERSION="0.5.4"
have=$(command -v mdbook >/dev/null && mdbook --version 2>/dev/null || true)
if [ "$have" != "mdbook v$MDBOOK_VERSION" ]; then
  cargo install mdbook --version "$MDBOOK_VERSION" --locked --no-default-features --features search --quiet
fi
