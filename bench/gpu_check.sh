#!/usr/bin/env bash
# The CUDA backend's check on one GPU, as one script that builds nothing where it runs (the GPU
# machine reaches no registry and has ~15 minutes): anneal info, the kernels' NVRTC/ptxas compile,
# every CUDA op against the CPU backend (host/engine/tests/cuda_ops.rs), bf16 GEMM TFLOP/s of the
# engine against PyTorch's cuBLAS on 8192³, then the training comparisons, which print
# "not yet: ..." until the trainer runs on CUDA. Ends with a short table; exits 1 when a step fails.
#
#   bash bench/gpu_check.sh build   # where cargo is: builds the binaries, stripped, into
#                                   # bench/gpu_carry/ (gitignored; carry that folder to the GPU)
#   bash bench/gpu_check.sh         # runs the check with bench/gpu_carry/ (building it first
#                                   # when it is missing and cargo is there)
#
# Without a GPU (any developer machine) the same run compiles the kernels and prints each GPU
# test's SKIP reason. Libraries: on the GPU machine cuBLAS/NVRTC come from the nvidia-* packages of
# its PyTorch install (their lib folders go on LD_LIBRARY_PATH, plus a libnccl.so link); here
# NVRTC and ptxas come from scripts/setup-cuda-tools.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=bench/gpu_carry
STEP_TIMEOUT=${STEP_TIMEOUT:-240}

build() {
  set -e
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
  cargo build --release -p anneal
  local json
  json=$(mktemp)
  cargo test --release -p anneal-engine --test cuda_ops --test cuda_kernels_compile --no-run \
    --message-format=json >"$json"
  mkdir -p "$CARRY"
  python3 - "$json" "$CARRY" <<'PY'
import json, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
for line in open(src):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("cuda_ops", "cuda_kernels_compile"):
        shutil.copy(m["executable"], f"{dst}/{m['target']['name']}")
PY
  rm -f "$json"
  cp "$CARGO_TARGET_DIR/release/anneal" "$CARRY/anneal"
  strip "$CARRY"/anneal "$CARRY"/cuda_ops "$CARRY"/cuda_kernels_compile
  du -sh "$CARRY"
  set +e
}

if [ "${1:-}" = build ]; then
  build
  exit $?
fi
if [ ! -x "$CARRY/cuda_ops" ]; then
  if command -v cargo >/dev/null; then build || exit 1; else
    echo "gpu_check: $CARRY/ is missing: run 'bash bench/gpu_check.sh build' where cargo is, and carry it" >&2
    exit 2
  fi
fi

# Libraries: PyTorch's nvidia-* packages (the GPU machine), else the NVRTC/ptxas of
# scripts/setup-cuda-tools.sh (a developer machine or CI).
if python3 -c "import nvidia" 2>/dev/null; then
  site=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))")
  for d in $(find "$site/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null); do
    LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  nccl=$(find "$site/nvidia" -name 'libnccl.so.2' 2>/dev/null | head -1)
  if [ -n "$nccl" ]; then
    links=$(mktemp -d)
    ln -sf "$nccl" "$links/libnccl.so"
    LD_LIBRARY_PATH="$links:$LD_LIBRARY_PATH"
  fi
  export LD_LIBRARY_PATH
fi
[ -f scripts/cuda-tools-env.sh ] && source scripts/cuda-tools-env.sh
if [ -z "${ANNEAL_PTXAS:-}" ] && ! command -v ptxas >/dev/null && [ -x /usr/local/cuda/bin/ptxas ]; then
  export ANNEAL_PTXAS=/usr/local/cuda/bin/ptxas
fi

declare -a ROWS
row() { ROWS+=("$(printf '%-34s %-8s %s' "$1" "$2" "$3")"); }
failed=0
log=$(mktemp -d)

run_step() { # name, command...: runs it with a timeout, keeps its output
  local name=$1; shift
  echo "== $name"
  timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$log/$name.out"
  return "${PIPESTATUS[0]}"
}

run_step info "$CARRY/anneal" info
row "anneal info" "ok" "$(grep '^cuda backend' "$log/info.out" | cut -c1-80)"

if run_step kernels "$CARRY/cuda_kernels_compile" --nocapture; then
  if grep -q 'SKIP ' "$log/kernels.out"; then row "kernels -> PTX (sm_80, sm_90)" "SKIP" "no NVRTC"; else
    row "kernels -> PTX (sm_80, sm_90)" "ok" "$(grep -c '^compiled' "$log/kernels.out") sources$( [ -n "${ANNEAL_PTXAS:-}" ] || command -v ptxas >/dev/null && echo ', assembled by ptxas')"; fi
else
  row "kernels -> PTX (sm_80, sm_90)" "FAILED" "see above"; failed=1
fi

if run_step ops "$CARRY/cuda_ops" --nocapture --test-threads 1; then
  skips=$(grep -c 'SKIP ' "$log/ops.out")
  if [ "$skips" -gt 0 ]; then
    row "CUDA ops vs CPU" "SKIP" "$(grep -m1 -o 'SKIP .*' "$log/ops.out" | cut -d: -f2- | cut -c1-70)"
  else
    row "CUDA ops vs CPU" "ok" "$(grep -o '[0-9]* passed' "$log/ops.out" | head -1)"
  fi
else
  row "CUDA ops vs CPU" "FAILED" "see above"; failed=1
fi

gpu_ok=0
grep -q 'SKIP ' "$log/ops.out" || gpu_ok=1
if [ "$gpu_ok" = 1 ]; then
  if run_step gemm "$CARRY/cuda_ops" --ignored --nocapture gemm_tflops; then
    row "GEMM bf16 8192^3, engine" "ok" "$(grep -o 'BF16.*TFLOP/s' "$log/gemm.out" | head -1)"
  else
    row "GEMM bf16 8192^3, engine" "FAILED" "see above"; failed=1
  fi
  if run_step torch_gemm python3 - <<'PY'
import torch
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize()
start.record()
for _ in range(20):
    a @ b
end.record()
torch.cuda.synchronize()
s = start.elapsed_time(end) / 1e3 / 20
print(f"GEMM bf16 {n}^3 PyTorch (cuBLASLt): {2 * n**3 / s / 1e12:.1f} TFLOP/s")
PY
  then
    row "GEMM bf16 8192^3, PyTorch" "ok" "$(grep -o '[0-9.]* TFLOP/s' "$log/torch_gemm.out" | head -1)"
  else
    row "GEMM bf16 8192^3, PyTorch" "SKIP" "no PyTorch with CUDA here"
  fi
else
  row "GEMM bf16 8192^3" "SKIP" "no GPU"
fi

# The issue's training comparisons need the trainer on CUDA (job.device = "cuda"): the engine
# has CUDA kernels for its ops (the gated delta rule excepted), but the trainer's
# device placement and CPU-side steps do not run on CUDA yet. They are listed so the table shows
# what is left.
for t in "train debug Llama 30 steps, f32|CPU vs GPU losses within 1e-4" \
         "train debug Llama 30 steps, bf16|CPU vs GPU losses within 2%" \
         "llama3_1b 20 steps bf16|tokens/s and MFU vs 989 TFLOP/s"; do
  echo "not yet: ${t%%|*} (${t#*|}): the trainer does not run on CUDA yet"
  row "${t%%|*}" "not yet" "trainer not on CUDA"
done

echo
echo "== gpu_check summary"
printf '%-34s %-8s %s\n' step status result
printf '%s\n' "${ROWS[@]}"
rm -rf "$log"
exit $failed
