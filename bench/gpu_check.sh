#!/usr/bin/env bash
# The CUDA backend's check on one GPU, as one script that builds nothing where it runs (the GPU
# machine reaches no registry and has ~15 minutes): anneal info, the kernels' NVRTC/ptxas compile,
# every CUDA op against the CPU backend (host/engine/tests/cuda_ops.rs), bf16 GEMM TFLOP/s of the
# engine against PyTorch's cuBLAS on 8192³, then training (job.device = "cuda"): the debug Llama
# 30 steps on CPU and GPU in f32 (losses within 1e-4 relative) and bf16 (within 2%), and
# llama3_1b 12 steps in bf16 on the GPU (tokens/s, MFU against the H200's 989 TFLOP/s dense
# bf16), and `anneal rl` on the GPU (the digit-sorting demo, logprob mismatch exactly 0). Ends
# with a short table; exits 1 when a step fails.
#
#   bash bench/gpu_check.sh build   # where cargo is: builds the binaries and the llama/adamw
#                                   # plugins, stripped, into bench/gpu_carry/ with the corpus
#                                   # and the MPI libraries the binary links (the GPU machine
#                                   # has none), and packs it as bench/gpu_carry.tar.xz (~21 MB;
#                                   # gitignored: carry that file to the GPU)
#   bash bench/gpu_check.sh         # runs the check with bench/gpu_carry/ (unpacked from the
#                                   # .tar.xz, or built first when cargo is there)
#   bash bench/gpu_check.sh emulated  # rehearses it on the CPU's emulation of a GPU
#                                   # (tools/cuda-emu): the benchmarks (GEMM TFLOP/s, llama3_1b)
#                                   # are skipped and the runs are 2 steps long
#
# Without a GPU (any developer machine) the same run compiles the kernels and prints each GPU
# test's SKIP reason. Libraries: on the GPU machine cuBLAS/NVRTC come from the nvidia-* packages of
# its PyTorch install (their lib folders go on LD_LIBRARY_PATH, plus a libnccl.so link); here
# NVRTC and ptxas come from scripts/setup-cuda-tools.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=bench/gpu_carry
EMULATED=0
[ "${1:-}" = emulated ] && EMULATED=1
STEP_TIMEOUT=${STEP_TIMEOUT:-$([ "$EMULATED" = 1 ] && echo 1200 || echo 240)}
DEBUG_STEPS=30 RL_STEPS=6
[ "$EMULATED" = 1 ] && DEBUG_STEPS=2 RL_STEPS=2

build() {
  set -e
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
  # The whole workspace, as CI and the test command build it: a subset would unify features
  # differently and rebuild the dependencies.
  cargo build --release --workspace
  local json
  json=$(mktemp)
  cargo test --release --workspace --test cuda_ops --test cuda_kernels_compile --no-run \
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
  mkdir -p "$CARRY/plugins" "$CARRY/lib"
  cp "$CARGO_TARGET_DIR"/release/libanneal_plugin_{llama,adamw}.so "$CARRY/plugins/"
  strip "$CARRY"/anneal "$CARRY"/cuda_ops "$CARRY"/cuda_kernels_compile "$CARRY"/plugins/*.so
  # MPICH and what it links (UCX, hwloc, numa, udev): the binary needs them to start even for
  # one process, and the GPU machine has another MPI or none. They go last on its library path.
  ldd "$CARRY/anneal" | awk '/=> \// {print $3}' |
    grep -E 'lib(mpich|hwloc|uc[pstm]|numa|udev)\.so' | xargs -r cp -L -t "$CARRY/lib/"
  # The training runs' corpus (data/ is not committed; scripts/fetch-corpus.sh fetches it).
  if [ -d data/shakespeare ]; then
    rm -rf "$CARRY/shakespeare" && cp -r data/shakespeare "$CARRY/shakespeare"
  else
    echo "gpu_check: no data/shakespeare (run scripts/fetch-corpus.sh): the training steps will fail" >&2
  fi
  tar cf - -C "$CARRY" . | xz -T0 -6 >"$CARRY.tar.xz"
  du -sh "$CARRY" "$CARRY.tar.xz"
  set +e
}

if [ "${1:-}" = build ]; then
  build
  exit $?
fi
if [ ! -x "$CARRY/cuda_ops" ] && [ -f "$CARRY.tar.xz" ]; then
  mkdir -p "$CARRY" && tar xJf "$CARRY.tar.xz" -C "$CARRY" || exit 1
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
[ -d "$CARRY/lib" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$PWD/$CARRY/lib"
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

# The kernels' compile test needs the real NVRTC and ptxas; emulation begins after it.
if [ "$EMULATED" = 1 ]; then
  emu=$(bash tools/cuda-emu/build.sh) || exit 1
  export ANNEAL_CUDA_EMU_CACHE="$emu/cache"
  EMU=(env "LD_LIBRARY_PATH=$emu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
else
  EMU=()
fi

run_step info "${EMU[@]}" "$CARRY/anneal" info
row "anneal info" "ok" "$(grep '^cuda backend' "$log/info.out" | cut -c1-80)"

if run_step kernels "$CARRY/cuda_kernels_compile" --nocapture; then
  if grep -q 'SKIP ' "$log/kernels.out"; then row "kernels -> PTX (sm_80, sm_90)" "SKIP" "no NVRTC"; else
    row "kernels -> PTX (sm_80, sm_90)" "ok" "$(grep -c '^compiled' "$log/kernels.out") sources$( [ -n "${ANNEAL_PTXAS:-}" ] || command -v ptxas >/dev/null && echo ', assembled by ptxas')"; fi
else
  row "kernels -> PTX (sm_80, sm_90)" "FAILED" "see above"; failed=1
fi

if run_step ops "${EMU[@]}" "$CARRY/cuda_ops" --nocapture --test-threads 1; then
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
if [ "$EMULATED" = 1 ]; then
  row "GEMM bf16 8192^3" "SKIP" "emulated GPU"
elif [ "$gpu_ok" = 1 ]; then
  if run_step gemm "$CARRY/cuda_ops" --ignored --nocapture gemm_tflops; then
    row "GEMM bf16 8192^3, engine" "ok" "$(grep -o 'bf16.*TFLOP/s' "$log/gemm.out" | head -1 | sed 's/.*: //')"
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

# Training on the GPU (job.device = "cuda") against the CPU: the debug Llama of
# configs/llama3_debug.toml on the carried corpus, one row per step, no evaluation.
export ANNEAL_PLUGIN_PATH="$PWD/$CARRY/plugins"
train() { # name, steps, extra --set values...: trains in $log/<name>
  local name=$1 steps=$2; shift 2
  local sets=(--set "training.steps=$steps" --set metrics.log_freq=1 --set metrics.eval_freq=0
    --set metrics.progress_bar=false --set checkpoint.interval=0
    --set "data.path=\"$PWD/$CARRY/shakespeare\"" --set "data.cache_dir=\"$log/cache\"")
  for s in "$@"; do sets+=(--set "$s"); done
  run_step "$name" "${EMU[@]}" "$CARRY/anneal" train configs/llama3_debug.toml --run-dir "$log/$name" "${sets[@]}"
}
compare() { # label, cpu run, gpu run, relative tolerance: a table row from their losses
  local verdict
  verdict=$(python3 - "$log/$2/metrics.jsonl" "$log/$3/metrics.jsonl" "$4" <<'PY'
import json, sys
def losses(p):
    return [r["loss"] for r in map(json.loads, open(p)) if "loss" in r]
cpu, gpu, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
if not cpu or len(cpu) != len(gpu):
    print(f"FAILED {len(cpu)} cpu vs {len(gpu)} gpu steps"); sys.exit()
worst = max(abs(g - c) / abs(c) for c, g in zip(cpu, gpu))
ok = "ok" if worst <= tol else "FAILED"
print(f"{ok} max rel diff {worst:.2e} (tol {tol:g}); loss {cpu[0]:.4f} -> cpu {cpu[-1]:.4f} / gpu {gpu[-1]:.4f}")
PY
)
  echo "$1: $verdict"
  row "$1" "${verdict%% *}" "${verdict#* }"
  [ "${verdict%% *}" = ok ] || failed=1
}
if [ "$gpu_ok" = 1 ]; then
  for dtype in float32 bfloat16; do
    tol=1e-4; [ "$dtype" = bfloat16 ] && tol=0.02
    label="debug Llama $DEBUG_STEPS steps, $dtype"
    if train "cpu-$dtype" "$DEBUG_STEPS" "training.dtype=\"$dtype\"" &&
       train "gpu-$dtype" "$DEBUG_STEPS" "training.dtype=\"$dtype\"" 'job.device="cuda"'; then
      compare "$label" "cpu-$dtype" "gpu-$dtype" "$tol"
    else
      row "$label" "FAILED" "see above"; failed=1
    fi
  done
  # llama3_1b on the GPU: bf16 compute, f32 master weights and AdamW state; its vocabulary
  # is larger than the corpus tokenizer's, which it only needs to hold.
  if [ "$EMULATED" = 1 ]; then
    row "llama3_1b 12 steps bf16" "SKIP" "emulated GPU"
  elif train gpu-1b 12 'model.flavor="llama3_1b"' 'training.dtype="bfloat16"' 'job.device="cuda"' \
       training.seq_len=2048 training.batch_size=8 training.micro_batch_size=2 \
       metrics.peak_tflops=989.0 'lr_scheduler.warmup_steps=2'; then
    verdict=$(python3 - "$log/gpu-1b/metrics.jsonl" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
late = rows[len(rows) // 2:]  # past the kernels' first compiles and the allocator's warm-up
tps = sum(r["tokens_per_s"] for r in late) / len(late)
mfu = sum(r.get("mfu") or 0 for r in late) / len(late)
peak = max(r.get("mem_peak_bytes") or 0 for r in rows)
print(f"{tps:,.0f} tokens/s, MFU {100 * mfu:.1f}% of 989 TFLOP/s, peak {peak / 2**30:.1f} GiB, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
PY
)
    echo "llama3_1b: $verdict"
    row "llama3_1b 12 steps bf16" "ok" "$verdict"
  else
    row "llama3_1b 12 steps bf16" "FAILED" "see above"; failed=1
  fi
  # RL on the GPU: the digit-sorting demo's policy after 20 supervised steps (on the CPU), then
  # 6 GRPO steps on the GPU; rollouts (KV-cache decode) and the trainer's forward must give the
  # same logprobs bit for bit (batch-invariant mode).
  python3 scripts/digits-sft-data.py "$log/digits.jsonl" 2000 >/dev/null
  if run_step rl-sft "$CARRY/anneal" train configs/rl_digits_sft.toml --run-dir "$log/rl-sft" \
       --set training.steps=20 --set checkpoint.interval=20 --set metrics.eval_freq=0 \
       --set metrics.progress_bar=false --set "data.path=\"$log/digits.jsonl\"" \
       --set "data.cache_dir=\"$log/cache\"" &&
     run_step rl "${EMU[@]}" "$CARRY/anneal" rl configs/rl_digits.toml --run-dir "$log/rl" \
       --set "rl.init_from=\"$log/rl-sft/checkpoints/step-20\"" --set "training.steps=$RL_STEPS" \
       --set rl.eval_freq=0 --set 'job.device="cuda"'; then
    verdict=$(python3 - "$log/rl/metrics.jsonl" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
worst = max(r["logprob_mismatch_max"] for r in rows)
ok = "ok" if rows and worst == 0 else "FAILED"
print(f"{ok} {len(rows)} steps, logprob mismatch max {worst:g}, reward {rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f}")
PY
)
    echo "rl: $verdict"
    row "anneal rl $RL_STEPS steps on cuda" "${verdict%% *}" "${verdict#* }"
    [ "${verdict%% *}" = ok ] || failed=1
  else
    row "anneal rl $RL_STEPS steps on cuda" "FAILED" "see above"; failed=1
  fi
else
  for t in "train debug Llama 30 steps, f32" "train debug Llama 30 steps, bf16" "llama3_1b 12 steps bf16" "anneal rl 6 steps on cuda"; do
    row "$t" "SKIP" "no GPU"
  done
fi

echo
echo "== gpu_check summary"
printf '%-34s %-8s %s\n' step status result
printf '%s\n' "${ROWS[@]}"
rm -rf "$log"
exit $failed
