#!/usr/bin/env bash
# Installs the Python packages the tests and benchmarks use into .venv at the repository root:
# the official `openai` client (tests/openai_client.py, bench/openai_bench.py) and `tensorboard`,
# whose own reader checks the run's event files (tests/tensorboard_read.py). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
OPENAI_VERSION="3.57.0"
TENSORBOARD_VERSION="2.21.0"
if [ ! -x .venv/bin/python ]; then
  if ! python3 -m venv .venv 2>/dev/null; then
    # Debian ships venv (and pip) separately from python3.
    sudo=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv
    rm -rf .venv
    python3 -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "openai==$OPENAI_VERSION"
fi
if ! .venv/bin/python -c "import tensorboard, sys; sys.exit(tensorboard.__version__ != '$TENSORBOARD_VERSION')" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "tensorboard==$TENSORBOARD_VERSION"
fi
