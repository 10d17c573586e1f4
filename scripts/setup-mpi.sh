#!/usr/bin/env bash
# Installs MPI for multi-process training and its build: MPICH (`mpiexec`, and libmpich-dev,
# which the `mpi` crate finds through pkg-config) and libclang (its build generates the MPI
# bindings with bindgen). Idempotent: does nothing when they are there.
set -euo pipefail
sudo=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"
if ! command -v mpiexec >/dev/null || ! pkg-config --exists mpich 2>/dev/null \
  || ! compgen -G "/usr/lib/llvm-*/lib/libclang*.so*" >/dev/null; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq mpich libmpich-dev libclang-dev pkgconf
fi
