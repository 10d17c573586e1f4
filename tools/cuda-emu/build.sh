#!/usr/bin/env bash
# Builds the CUDA emulation library (runtime.cpp: driver API and NVRTC; cublas.cpp; nccl.cpp
# and nccl_ops.cpp: NCCL between processes) into DIR (default $CARGO_TARGET_DIR/cuda-emu, else
# target/cuda-emu), links it under the names cudarc opens (libcuda.so, libcublas.so,
# libnvrtc.so, libnccl.so), copies the kernel prelude and the CUDA headers kernels may include
# (include/) beside it, and prints DIR.
# Rebuilds only when a source changed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dir="${1:-${CARGO_TARGET_DIR:-$root/target}/cuda-emu}"
mkdir -p "$dir"
cxx="${ANNEAL_CUDA_EMU_CXX:-c++}"
if ! command -v "$cxx" >/dev/null; then
  # The library and every kernel module are compiled by the host's C++ compiler.
  sudo=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq g++; } >&2
fi
lib="$dir/libanneal_cuda_emu.so"
sources=("$here/runtime.cpp" "$here/cublas.cpp" "$here/nccl.cpp" "$here/nccl_ops.cpp")
stale=0
[ -f "$lib" ] || stale=1
for f in "${sources[@]}" "$here"/*.h; do
  [ "$f" -nt "$lib" ] && stale=1
done
if [ "$stale" = 1 ]; then
  "$cxx" -std=c++17 -O2 -fPIC -shared -Wall -Wno-unused-function -o "$lib.tmp" "${sources[@]}" -ldl -lrt -pthread
  mv "$lib.tmp" "$lib"
fi
cp "$here/emu_kernel.h" "$dir/emu_kernel.h"
mkdir -p "$dir/include"
cp "$here"/include/*.h "$dir/include/"
for name in libcuda.so libcuda.so.1 libcublas.so libnvrtc.so libnccl.so libnccl.so.2; do
  ln -sf libanneal_cuda_emu.so "$dir/$name"
done
echo "$dir"
