"""PyTorch's own profiler table for the step `anneal train --profile` breaks down: the debug
Llama's shape (HF LlamaForCausalLM, see train_vs_pytorch.py), batch 8 x 256, fp32, AdamW,
clipping, eager mode. Runs WARMUP steps, then profiles STEPS and prints the per-op table
(self CPU time, per step) sorted like Anneal's.

    OMP_NUM_THREADS=2 python bench/profile_pytorch.py --threads 2 [--steps 3] [--dtype bf16]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_vs_pytorch import build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--trace", help="also write a Chrome trace here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    step, batch = build("eager", args.dtype)
    g = torch.Generator().manual_seed(0)
    for _ in range(args.warmup):
        step(batch(g))
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            float(step(batch(g)))
    avg = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in avg)
    print(f"PyTorch {torch.__version__} eager {args.dtype}, {args.threads} thread(s): "
          f"{total / 1e3 / args.steps:.1f} ms of op self time per step")
    print(f"| {'op':<44} | {'calls/step':>10} | {'ms/step':>10} | {'%':>6} |")
    print(f"|{'-' * 46}|{'-' * 12}|{'-' * 12}|{'-' * 8}|")
    for e in sorted(avg, key=lambda e: -e.self_cpu_time_total)[:30]:
        ms = e.self_cpu_time_total / 1e3 / args.steps
        print(f"| {e.key[:44]:<44} | {e.count / args.steps:>10.1f} | {ms:>10.2f} | "
              f"{100 * e.self_cpu_time_total / total:>6.1f} |")
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
