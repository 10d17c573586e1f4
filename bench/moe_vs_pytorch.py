"""One MoE feed-forward layer, forward + backward, in PyTorch eager: the peer of
host/engine/examples/moe_bench.rs (softmax top-k router with renormalised weights, SwiGLU
experts, weighted combine; no shared experts, no aux loss).

  --mode loop     the usual loop over experts (Hugging Face's Qwen3-MoE / Mixtral block):
                  one-hot mask, per expert `where` + gather, three matmuls, index_add_
  --mode grouped  tokens sorted by expert, gathered once, torch._grouped_mm over contiguous
                  per-expert segments, index_add back (fails when torch lacks _grouped_mm)

Prints one JSON object: {"seconds": [per-iteration seconds], "counts": [tokens per expert]}.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def route(x, wr, k):
    probs = F.softmax(x @ wr, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), experts


def moe_loop(x, wr, gate, up, down, k):
    n, e = x.shape[0], gate.shape[0]
    weights, experts = route(x, wr, k)
    out = torch.zeros_like(x)
    mask = F.one_hot(experts, e).permute(2, 1, 0)  # [E, k, N]
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for ex in hit:
        ex = int(ex)
        slot, tok = torch.where(mask[ex])
        cur = x[tok]
        h = (F.silu(cur @ gate[ex]) * (cur @ up[ex])) @ down[ex]
        out.index_add_(0, tok, h * weights[tok, slot, None])
    return out, experts


def moe_grouped(x, wr, gate, up, down, k):
    e = gate.shape[0]
    weights, experts = route(x, wr, k)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    token = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
    xs = x[token]
    h = F.silu(torch._grouped_mm(xs, gate, offs=offs)) * torch._grouped_mm(xs, up, offs=offs)
    ys = torch._grouped_mm(h, down, offs=offs) * weights.flatten()[order, None]
    return torch.zeros_like(x).index_add(0, token, ys), experts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["loop", "grouped"], required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    n, d, e, f = a.tokens, a.hidden, a.experts, a.ffn
    x = torch.randn(n, d)
    weights = [torch.randn(d, e) / d**0.5, torch.randn(e, d, f) / d**0.5,
               torch.randn(e, d, f) / d**0.5, torch.randn(e, f, d) / f**0.5]
    g = torch.randn(n, d)
    layer = moe_loop if a.mode == "loop" else moe_grouped
    seconds, counts = [], []
    for _ in range(a.iters):
        start = time.perf_counter()
        xl = x.detach().requires_grad_()
        wl = [w.detach().requires_grad_() for w in weights]
        out, experts = layer(xl, *wl, a.topk)
        out.backward(g)
        seconds.append(time.perf_counter() - start)
        counts = torch.bincount(experts.flatten(), minlength=e).tolist()
    print(json.dumps({"seconds": seconds, "counts": counts}))


if __name__ == "__main__":
    main()
