#!/usr/bin/env bash
# Installs NVRTC (libnvrtc) and ptxas from PyPI into a cached venv, so the CUDA kernels compile to
# PTX and assemble for sm_80/sm_90 on machines without a GPU (host/engine/tests/
# cuda_kernels_compile.rs). CUDA 13.0, the version of the GPU machine's driver (580). Idempotent.
# `source scripts/cuda-tools-env.sh` afterwards puts them on LD_LIBRARY_PATH and ANNEAL_PTXAS.
set -euo pipefail
TOOLS="${ANNEAL_CUDA_TOOLS:-$HOME/.cache/anneal-cuda-tools}"
NVRTC_VERSION="13.0.*"
NVCC_VERSION="13.0.*"
if [ ! -x "$TOOLS/bin/python" ]; then
  if ! python3 -m venv "$TOOLS" 2>/dev/null; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv
    rm -rf "$TOOLS"
    python3 -m venv "$TOOLS"
  fi
fi
site=$("$TOOLS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! ls "$site"/nvidia/cu13/lib/libnvrtc.so.13 >/dev/null 2>&1 || ! [ -x "$site/nvidia/cu13/bin/ptxas" ]; then
  "$TOOLS/bin/pip" install -q --disable-pip-version-check \
    "nvidia-cuda-nvrtc==$NVRTC_VERSION" "nvidia-cuda-nvcc==$NVCC_VERSION"
fi
