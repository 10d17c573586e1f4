#!/usr/bin/env python3
"""PyTorch's side of bench/gpu_check.sh's speed table (issue 41): each subcommand runs the peer
of one row on the same shapes, and counts FLOPs as the engine's side does, printing lines in the
engine's format so that the script reads both the same way.

  attention  bf16 causal F.scaled_dot_product_attention, forward + backward, batch 1, per
             sequence length (FLOPs as FlashAttention counts them: forward 4·B·H·T²·D halved
             for the causal mask, backward 2.5 times the forward); the engine's side is
             `cuda_ops --ignored attention_speed` (host/engine/tests/cuda/bench.rs)
  moe        a DeepSeek-V3-like MoE layer, forward + backward: f32 sigmoid router, top-k
             renormalised and scaled by 2.5, tokens permuted to expert order, torch._grouped_mm
             for gate / up / down with SwiGLU between, weighted combine (a per-expert loop
             where torch._grouped_mm is missing, said in the output); FLOPs the experts'
             three products, backward twice the forward; engine: `cuda_ops ... moe_speed`
  train      a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads, 8 kv heads, ffn
             8192, vocab 128256, tied embedding, RMSNorm, RoPE, SwiGLU) in plain eager PyTorch
             with SDPA: f32 weights under bf16 autocast, fused AdamW, gradient clipping at 1.0,
             seq 2048, batch 8 in micro-batches of 2, as `anneal train` runs `llama3_1b` in
             gpu_check.sh; prints tokens/s and MFU (`mfu` below)
  hfdir      writes --model-dir: an HF Llama directory of the same 1B shape (config.json and
             model.safetensors, random bf16 weights) with torch alone, for `anneal generate
             --model-dir` to be timed on, transformers or not
  decode     loads that directory as transformers' LlamaForCausalLM in --dtype (float32: the
             dtype the engine's llama plugin loads an HF directory in) and times greedy
             `generate` at each --batches size on the prompt --prompt-tokens; decode tokens/s
             as `anneal generate` reports them: the tokens after the first (over all rows) over
             the time after the prefill (generate(n) - generate(1)); exits 3 after a line
             "SKIP decode: ..." where transformers does not import
  mfu        the MFU of a tokens/s figure of the 1B model (no torch needed): 6·N FLOPs per
             token for its N = 1.236e9 multiplied parameters (the tied output head counted
             once, the embedding lookup not) plus attention's 12·layers·heads·head_dim·seq
             (PaLM's count), against 989 TFLOP/s (H100 / H200 dense bf16)

Only torch is needed (and transformers for decode). `--device cpu` with `--tiny` (train, hfdir)
or small shapes runs each code path on a CPU, to rehearse the script without a GPU.
"""
import argparse
import json
import os
import sys
import time

PEAK_TFLOPS = 989.0
LLAMA_1B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                rope_theta=500000.0, eps=1e-5)
LLAMA_TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512,
                  rope_theta=500000.0, eps=1e-5)


def llama_flops_per_token(c, seq):
    hd = c["hidden"] // c["heads"]
    per_layer = (c["hidden"] * c["heads"] * hd * 2            # q, o
                 + c["hidden"] * c["kv_heads"] * hd * 2       # k, v
                 + 3 * c["hidden"] * c["ffn"])                # gate, up, down
    n = c["layers"] * per_layer + c["vocab"] * c["hidden"]    # + the (tied) output head
    return 6.0 * n + 12.0 * c["layers"] * c["heads"] * hd * seq


def parse_ints(s):
    return [int(v) for v in s.split(",") if v.strip()]


class Timer:
    """Seconds per call: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.startswith("cuda")

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn, iters=None):
        fn()  # warm-up
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        one = time.perf_counter() - t
        if iters is None:
            iters = max(2, min(20, int(1.0 / max(one, 1e-6))))
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            self.torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / iters, iters
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters, iters


def cmd_attention(a):
    import torch
    import torch.nn.functional as F
    timer = Timer(torch, a.device)
    b, h, d = 1, a.heads, a.head_dim
    for t in parse_ints(a.seqs):
        g = torch.Generator(device=a.device).manual_seed(t)
        q, k, v, dout = (torch.rand(b, h, t, d, device=a.device, generator=g).mul_(2).sub_(1)
                         .to(torch.bfloat16) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def step():
            q.grad = k.grad = v.grad = None
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(dout)

        tf, _ = timer(fwd, a.iters)
        ts, iters = timer(step, a.iters)
        flops = 4.0 * b * h * d * t * t / 2
        print(f"attention bf16 causal seq={t} heads={h} dim={d}: fwd+bwd {ts * 1e3:.3f} ms, "
              f"{3.5 * flops / ts / 1e12:.1f} TFLOP/s (fwd {tf * 1e3:.3f} ms, "
              f"{flops / tf / 1e12:.1f} TFLOP/s; {iters} iterations; torch {torch.__version__} SDPA)",
              flush=True)
        del q, k, v, dout


def cmd_moe(a):
    import torch
    import torch.nn.functional as F
    dev = a.device
    n, e, k, d, f = a.tokens, a.experts, a.topk, a.hidden, a.ffn
    grouped = hasattr(torch, "_grouped_mm") and not a.loop
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        x = torch.rand(*shape, device=dev, generator=g).mul_(2).sub_(1).mul_(scale)
        return x.to(dtype).requires_grad_(True)

    x = rand(n, d)
    router = rand(d, e, scale=d ** -0.5, dtype=torch.float32)
    gate, up = rand(e, d, f, scale=d ** -0.5), rand(e, d, f, scale=d ** -0.5)
    down = rand(e, f, d, scale=f ** -0.5)
    dout = rand(n, d).detach()
    params = (x, router, gate, up, down)
    counts_seen = []

    def experts(xs, counts):
        if grouped:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(xs, gate, offs=offs)) * torch._grouped_mm(xs, up, offs=offs)
            return torch._grouped_mm(h, down, offs=offs)
        outs, start = [], 0
        for i, c in enumerate(counts.tolist()):
            if c:
                r = xs[start:start + c]
                outs.append((F.silu(r @ gate[i]) * (r @ up[i])) @ down[i])
            start += c
        return torch.cat(outs)

    def layer():
        # Router in f32 (as the engine's moe_ffn), DeepSeek-V3's sigmoid scores.
        scores = torch.sigmoid(x.float() @ router)
        w, idx = torch.topk(scores, k, dim=-1)
        w = w / w.sum(-1, keepdim=True) * 2.5
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e)
        xs = x[order // k]                                   # rows in expert order
        ys = experts(xs, counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=dev)
        y = ys[inverse].view(n, k, d)                        # back in token order
        out = (y * w.to(y.dtype).unsqueeze(-1)).sum(1)
        return out, counts

    def fwd():
        with torch.no_grad():
            counts_seen[:] = [layer()[1]]

    def step():
        for p in params:
            p.grad = None
        out, _ = layer()
        out.backward(dout)

    timer = Timer(torch, dev)
    tf, _ = timer(fwd, a.iters)
    ts, iters = timer(step, a.iters)
    c = counts_seen[0].tolist()
    flops = 3 * 2.0 * n * k * d * f
    how = "torch._grouped_mm" if grouped else "a per-expert loop (no torch._grouped_mm)"
    print(f"moe bf16 tokens={n} experts={e} topk={k} hidden={d} ffn={f}: fwd+bwd {ts * 1e3:.3f} ms, "
          f"{3 * flops / ts / 1e12:.1f} TFLOP/s (fwd {tf * 1e3:.3f} ms, {flops / tf / 1e12:.1f} TFLOP/s; "
          f"rows per expert {min(c)}..{max(c)}; {iters} iterations; torch {torch.__version__} {how})",
          flush=True)


def build_llama(torch, c, seq):
    import torch.nn as nn
    import torch.nn.functional as F
    hd = c["hidden"] // c["heads"]

    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c["eps"])
            return (xf * self.weight).to(x.dtype)

    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(torch.arange(seq).float(), inv)

    def rope(x, cos, sin):  # half-split rotation (HF's rotate_half)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            dim = c["hidden"]
            self.attn_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
            self.wq = nn.Linear(dim, c["heads"] * hd, bias=False)
            self.wk = nn.Linear(dim, c["kv_heads"] * hd, bias=False)
            self.wv = nn.Linear(dim, c["kv_heads"] * hd, bias=False)
            self.wo = nn.Linear(c["heads"] * hd, dim, bias=False)
            self.w1 = nn.Linear(dim, c["ffn"], bias=False)
            self.w3 = nn.Linear(dim, c["ffn"], bias=False)
            self.w2 = nn.Linear(c["ffn"], dim, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            h = self.attn_norm(x)
            q = self.wq(h).view(b, t, c["heads"], hd).transpose(1, 2)
            k = self.wk(h).view(b, t, c["kv_heads"], hd).transpose(1, 2)
            v = self.wv(h).view(b, t, c["kv_heads"], hd).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(o.transpose(1, 2).reshape(b, t, -1))
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(c["vocab"], c["hidden"])
            nn.init.normal_(self.tok_embeddings.weight, std=c["hidden"] ** -0.5)
            self.layers = nn.ModuleList(Block() for _ in range(c["layers"]))
            self.norm = RMSNorm(c["hidden"])
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

        def forward(self, tokens):
            t = tokens.shape[1]
            cos, sin = self.cos[:t].to(torch.bfloat16), self.sin[:t].to(torch.bfloat16)
            x = self.tok_embeddings(tokens)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return F.linear(self.norm(x), self.tok_embeddings.weight)  # tied output head

    return Llama()


def cmd_train(a):
    import torch
    import torch.nn.functional as F
    c = LLAMA_TINY if a.tiny else LLAMA_1B
    dev, seq = a.device, a.seq
    cuda = dev.startswith("cuda")
    torch.manual_seed(0)
    with torch.device(dev):
        model = build_llama(torch, c, seq)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            eps=1e-8, **({"fused": True} if cuda else {}))
    if a.batch % a.micro_batch:
        sys.exit(f"--batch {a.batch} is not a multiple of --micro-batch {a.micro_batch}")
    accum = a.batch // a.micro_batch
    g = torch.Generator(device=dev).manual_seed(1)
    data = torch.randint(0, c["vocab"], (accum, a.micro_batch, seq + 1), device=dev, generator=g)
    device_type = "cuda" if cuda else "cpu"
    losses = []

    def step():
        for i in range(accum):
            x, y = data[i, :, :-1], data[i, :, 1:]
            with torch.autocast(device_type, dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, c["vocab"]), y.reshape(-1)) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item() * accum)

    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    s = (time.perf_counter() - t) / a.steps
    tps = a.batch * seq / s
    fpt = llama_flops_per_token(c, seq)
    peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
    print(f"train llama{'_tiny' if a.tiny else '3_1b'} bf16 autocast seq={seq} batch={a.batch} "
          f"micro={a.micro_batch}: {tps:,.0f} tokens/s, {s * 1e3:.1f} ms/step, "
          f"{tps * fpt / 1e12:.1f} TFLOP/s, MFU {100 * tps * fpt / (PEAK_TFLOPS * 1e12):.1f}% of "
          f"{PEAK_TFLOPS:g} ({n_params / 1e6:.1f}M parameters, {fpt:.3e} FLOPs/token; loss "
          f"{losses[0]:.3f} -> {losses[-1]:.3f}{peak}; {a.steps} timed steps after {a.warmup}; "
          f"torch {torch.__version__} eager + SDPA)", flush=True)


def llama_hf_tensors(c):
    """HF LlamaForCausalLM names and shapes of the model `c` (the output head tied)."""
    hd = c["hidden"] // c["heads"]
    d, f = c["hidden"], c["ffn"]
    out = [("model.embed_tokens.weight", (c["vocab"], d))]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (c["heads"] * hd, d)),
                (p + "self_attn.k_proj.weight", (c["kv_heads"] * hd, d)),
                (p + "self_attn.v_proj.weight", (c["kv_heads"] * hd, d)),
                (p + "self_attn.o_proj.weight", (d, c["heads"] * hd)),
                (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (f, d)),
                (p + "mlp.up_proj.weight", (f, d)),
                (p + "mlp.down_proj.weight", (d, f))]
    return out + [("model.norm.weight", (d,))]


def cmd_hfdir(a):
    """A Hugging Face Llama directory (config.json + model.safetensors, bf16, random weights
    N(0, 0.02), norms 1) written with torch alone, so that the engine's decode runs where
    transformers is missing."""
    import torch
    c = LLAMA_TINY if a.tiny else LLAMA_1B
    t0 = time.perf_counter()
    os.makedirs(a.model_dir, exist_ok=True)
    g = torch.Generator(device=a.device).manual_seed(0)
    tensors = {}
    for name, shape in llama_hf_tensors(c):
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, device=a.device).normal_(0.0, 0.02, generator=g)
            t = t.to(torch.bfloat16).cpu()
        tensors[name] = t
    try:
        from safetensors.torch import save_file
        save_file(tensors, os.path.join(a.model_dir, "model.safetensors"), metadata={"format": "pt"})
    except ImportError:  # the format by hand: a JSON header, then the raw bytes in order
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, t in tensors.items():
            n = t.numel() * 2
            header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + n]}
            off += n
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        with open(os.path.join(a.model_dir, "model.safetensors"), "wb") as out:
            out.write(len(h).to_bytes(8, "little") + h)
            for t in tensors.values():
                out.write(t.contiguous().view(torch.int16).numpy().tobytes())
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c["vocab"], "hidden_size": c["hidden"], "intermediate_size": c["ffn"],
        "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"], "head_dim": c["hidden"] // c["heads"],
        "max_position_embeddings": a.max_positions, "rms_norm_eps": c["eps"],
        "rope_theta": c["rope_theta"], "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0,
    }
    with open(os.path.join(a.model_dir, "config.json"), "w") as out:
        json.dump(config, out, indent=1)
    n = sum(t.numel() for t in tensors.values())
    print(f"hfdir: a {n / 1e6:.1f}M-parameter Llama in {a.model_dir} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)


def cmd_decode(a):
    import torch
    try:
        import transformers
        from transformers import LlamaForCausalLM
    except Exception as e:  # the row says SKIP with this line
        print(f"SKIP decode: import transformers failed: {type(e).__name__}: {e}", flush=True)
        return 3
    dev = a.device
    dtype = getattr(torch, a.dtype)
    t0 = time.perf_counter()
    try:
        model = LlamaForCausalLM.from_pretrained(a.model_dir, dtype=dtype)
    except TypeError:  # transformers 4 names it torch_dtype
        model = LlamaForCausalLM.from_pretrained(a.model_dir, torch_dtype=dtype)
    model.to(dev).eval()
    print(f"decode: loaded {a.model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters, {a.dtype}) in {time.perf_counter() - t0:.1f} s", flush=True)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = parse_ints(a.prompt_tokens)
    timer = Timer(torch, dev)

    def gen(ids, new):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + new, out.shape
        return out

    def seconds(ids, new, runs):
        best = None
        for _ in range(runs):
            timer.sync()
            t = time.perf_counter()
            gen(ids, new)
            timer.sync()
            s = time.perf_counter() - t
            best = s if best is None else min(best, s)
        return best

    for b in parse_ints(a.batches):
        ids = torch.tensor([prompt] * b, device=dev)
        first = gen(ids, 8)[0, len(prompt):].tolist()  # warm-up; row 0's first tokens
        t1 = seconds(ids, 1, 3)  # the prefill and its token
        tn = seconds(ids, a.new_tokens, 2)
        tps = b * (a.new_tokens - 1) / max(tn - t1, 1e-9)
        print(f"decode batch={b} prompt={len(prompt)} new={a.new_tokens} {a.dtype}: "
              f"{tps:.1f} tokens/s (prefill {t1 * 1e3:.1f} ms, all {tn * 1e3:.1f} ms; HF generate "
              f"greedy, transformers {transformers.__version__}, torch {torch.__version__}; row 0 "
              f"starts {first})", flush=True)
    return 0


def cmd_mfu(a):
    c = LLAMA_TINY if a.tiny else LLAMA_1B
    fpt = llama_flops_per_token(c, a.seq)
    print(f"{100 * a.tokens_per_s * fpt / (PEAK_TFLOPS * 1e12):.1f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(s):
        s.add_argument("--device", default="cuda")
        s.add_argument("--iters", type=int, default=None,
                       help="timed iterations (default: about a second's worth, 2 to 20)")

    s = sub.add_parser("attention")
    common(s)
    s.add_argument("--seqs", default=os.environ.get("ANNEAL_BENCH_SEQS", "4096,8192,16384"))
    s.add_argument("--heads", type=int, default=int(os.environ.get("ANNEAL_BENCH_HEADS", 16)))
    s.add_argument("--head-dim", type=int,
                   default=int(os.environ.get("ANNEAL_BENCH_HEAD_DIM", 128)))
    s = sub.add_parser("moe")
    common(s)
    env = lambda k, v: int(os.environ.get(f"ANNEAL_BENCH_{k}", v))  # noqa: E731
    s.add_argument("--tokens", type=int, default=env("TOKENS", 8192))
    s.add_argument("--experts", type=int, default=env("EXPERTS", 64))
    s.add_argument("--topk", type=int, default=env("TOPK", 8))
    s.add_argument("--hidden", type=int, default=env("HIDDEN", 7168))
    s.add_argument("--ffn", type=int, default=env("FFN", 2048))
    s.add_argument("--loop", action="store_true", help="a per-expert loop, not torch._grouped_mm")
    s = sub.add_parser("train")
    s.add_argument("--device", default="cuda")
    s.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU rehearsal)")
    s.add_argument("--seq", type=int, default=2048)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--micro-batch", type=int, default=2)
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--steps", type=int, default=4)
    s = sub.add_parser("hfdir")
    s.add_argument("--device", default="cuda")
    s.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU rehearsal)")
    s.add_argument("--model-dir", required=True)
    s.add_argument("--max-positions", type=int, default=2048)
    s = sub.add_parser("decode")
    s.add_argument("--device", default="cuda")
    s.add_argument("--model-dir", required=True, help="written by hfdir")
    s.add_argument("--batches", default="1,32")
    s.add_argument("--prompt-tokens", default=",".join(str(7 + 131 * i % 500) for i in range(32)))
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s = sub.add_parser("mfu")
    s.add_argument("--tokens-per-s", type=float, required=True)
    s.add_argument("--seq", type=int, default=2048)
    s.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    return {"attention": cmd_attention, "moe": cmd_moe, "train": cmd_train,
            "hfdir": cmd_hfdir, "decode": cmd_decode, "mfu": cmd_mfu}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
