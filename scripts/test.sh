#!/usr/bin/env bash
# The test command: installs what the tests need (scripts/setup.sh: reward toolchains and
# examples, the corpus, the web UI's packages and headless Chromium; idempotent, so later runs
# skip what is there), then runs every crate's unit and integration tests and the end-to-end
# tests in release mode (numeric code is slow unoptimized, and one profile means heavy
# dependencies compile once). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The manual as a book: it must build (tests/docs_cli.rs checks its links and commands).
PATH="$HOME/.cargo/bin:$PATH" mdbook build docs >/dev/null 2>&1 || PATH="$HOME/.cargo/bin:$PATH" mdbook build docs
# The CUDA kernels' compile test finds NVRTC and ptxas here, and must really compile (no SKIP).
source scripts/cuda-tools-env.sh
export ANNEAL_REQUIRE_CUDA_TOOLS=1
cargo test --workspace --release "$@"
# The CUDA tests once more on the CPU's emulation of a GPU (tools/cuda-emu): every kernel,
# launch, device copy and cuBLAS product runs (streams are queues run only when waited for, so
# a missing event wait shows; cuda_streams: events and the allocator's record_stream), and
# `job.device = "cuda"` trains, resumes and generates, also on two GPU ranks under mpiexec (cuda_dist_cli: every layout, RL, checkpoints
# across devices, a killed rank); and NCCL between `mpiexec` ranks (each its own emulated GPU,
# the emulated libnccl.so) matches the MPI collectives bit for bit and fails mismatched calls
# instead of hanging. ANNEAL_REQUIRE_CUDA turns a missing device into a failure instead of a SKIP.
emu=$(bash tools/cuda-emu/build.sh)
LD_LIBRARY_PATH="$emu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ANNEAL_CUDA_EMU_CACHE="$emu/cache" \
  ANNEAL_REQUIRE_CUDA=1 cargo test --workspace --release --test cuda_ops --test cuda_streams \
  --test cuda_train_cli --test cuda_dist_cli --test nccl --test nccl_ranks --test nccl_emu \
  --test emu_devices "$@"
