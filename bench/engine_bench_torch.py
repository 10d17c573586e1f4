#!/usr/bin/env python3
"""PyTorch CPU peer of host/engine/examples/engine_bench.rs: the same rows, timed the same way
(median of several reps after warmup, 2 threads). With `--anneal FILE` (the Rust bench's
output) it prints the comparison table: GFLOP/s of both and the ratio anneal/pytorch."""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(warmup, reps, f):
    for _ in range(warmup):
        f()
    ts = []
    for _ in range(reps):
        s = time.perf_counter()
        f()
        ts.append(time.perf_counter() - s)
    return statistics.median(ts)


def rows(reps):
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)
    out = []
    with torch.no_grad():
        for m, k, n in [(2048, 256, 1024), (2048, 1024, 256), (2048, 256, 8192)]:
            flop = 2.0 * m * k * n
            a, b, dc = r(m, k), r(k, n), r(m, n)
            for name, x, y in [
                (f"matmul {m}x{k}x{n} C=A·B", a, b),
                (f"matmul {m}x{k}x{n} dA=dC·Bᵀ", dc, b.T),
                (f"matmul {m}x{k}x{n} dB=Aᵀ·dC", a.T, dc),
            ]:
                out.append((name, flop, timed(3, reps, lambda: x @ y)))
    bs, h, t, d = 8, 4, 256, 64
    flop = 3.5 * 4.0 * bs * h * t * t * d / 2.0
    q, k, v, go = r(bs, h, t, d), r(bs, h, t, d), r(bs, h, t, d), r(bs, h, t, d)

    def fwd_bwd():
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        o.backward(go)

    out.append((f"attention B{bs} H{h} T{t} D{d} causal fwd+bwd", flop, timed(3, reps, fwd_bwd)))
    with torch.no_grad():
        s = timed(3, reps, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out.append((f"attention B{bs} H{h} T{t} D{d} causal fwd", flop / 3.5, s))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--anneal", help="the Rust bench's output (name, flop, seconds per line)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ours = {}
    if args.anneal:
        for line in open(args.anneal, encoding="utf-8"):
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 3:
                ours[parts[0]] = float(parts[2])
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.reps} reps")
    head = f"{'row':<44} {'anneal ms':>10} {'torch ms':>10} {'anneal GF/s':>12} {'torch GF/s':>11} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for name, flop, s in rows(args.reps):
        a = ours.get(name)
        a_ms = f"{a * 1e3:10.3f}" if a else f"{'-':>10}"
        a_gf = f"{flop / a / 1e9:12.1f}" if a else f"{'-':>12}"
        ratio = f"{s / a:6.2f}" if a else f"{'-':>6}"
        print(f"{name:<44} {a_ms} {s * 1e3:10.3f} {a_gf} {flop / s / 1e9:11.1f} {ratio}")


if __name__ == "__main__":
    main()
