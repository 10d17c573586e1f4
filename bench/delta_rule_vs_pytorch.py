"""One Gated DeltaNet mixer, forward + backward, in PyTorch: transformers' reference
`torch_chunk_gated_delta_rule` (Qwen3.5; chunk 64, l2-normalized q and k in the kernel) under
autograd, the peer of host/engine/examples/delta_rule_bench.rs. Same shapes and input
distributions: q, k, v standard normal, g uniform in [-0.5, 0), beta uniform in [0, 1).

Prints one JSON object: {"seconds": [per-iteration seconds], "forward": [their forward part]}.
"""
import argparse
import json
import time

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k-heads", type=int, default=16)
    p.add_argument("--v-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    b, t, hk, hv, d = a.batch, a.seq, a.k_heads, a.v_heads, a.head_dim
    inputs = [torch.randn(b, t, hk, d), torch.randn(b, t, hk, d), torch.randn(b, t, hv, d),
              -0.5 * torch.rand(b, t, hv), torch.rand(b, t, hv)]
    grad = torch.randn(b, t, hv, d)
    seconds, forward = [], []
    for _ in range(a.iters):
        start = time.perf_counter()
        x = [i.detach().requires_grad_() for i in inputs]
        out, _ = torch_chunk_gated_delta_rule(*x, use_qk_l2norm_in_kernel=True)
        forward.append(time.perf_counter() - start)
        out.backward(grad)
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds, "forward": forward}))


if __name__ == "__main__":
    main()
