#!/usr/bin/env bash
# Installs the toolchain pieces Anneal's builds and tests need. Idempotent.
set -euo pipefail
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# MPI and libclang: the workspace builds against libmpich (host/dist), and the tests run ranks.
bash "$(dirname "$0")/setup-mpi.sh"
bash "$(dirname "$0")/setup-reward.sh"
# The built-in corpus (data/shakespeare); no default test needs it, so a failed download only warns.
bash "$(dirname "$0")/fetch-corpus.sh" || echo "setup: cannot fetch the Shakespeare corpus (data/shakespeare)" >&2
# The official openai Python client (.venv), for the OpenAI-compatible endpoint's test.
bash "$(dirname "$0")/setup-python.sh"
# The browser UI's packages and the headless Chromium of its tests.
bash "$(dirname "$0")/setup-web.sh"
# NVRTC and ptxas (PyPI wheels, cached under ~/.cache): CUDA kernels compile to PTX without a GPU.
bash "$(dirname "$0")/setup-cuda-tools.sh"
# mdBook for the manual (docs/ as a book; scripts/test.sh builds it).
bash "$(dirname "$0")/setup-book.sh"
