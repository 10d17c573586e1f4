"""PyTorch peer of `bench/parallel_layouts.sh`: the debug Llama's shape (hidden 256, 4 heads, FFN
1024, vocab 8192, RoPE theta 5e5) written out in plain PyTorch, trained over gloo with one thread
per rank on a global batch of 8 x 256 random tokens in micro-batches of one sequence, AdamW.

Layouts (`--layout`):
  pp        `torch.distributed.pipelining`, one stage per rank, `Schedule1F1B`
  pp_inter  two virtual stages per rank (stage r and r + world), `ScheduleInterleaved1F1B`
  tp        DTensor tensor parallelism as TorchTitan applies it: q/k/v/gate/up column-wise,
            o/down row-wise, the embedding row-wise over the vocabulary, the output head
            column-wise with `loss_parallel` (no full logits gathered)
  tp_sp     `tp` plus sequence parallelism for the norms (activations sharded along the sequence
            between blocks)

Rank 0 prints one JSON line: the layout, the median global tokens/s after the warmup steps and
every rank's peak resident memory.

    torchrun --nproc_per_node 2 bench/parallel_layouts_torch.py --layout pp --layers 4
"""

import argparse
import json
import math
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, FFN, VOCAB, THETA, EPS = 256, 4, 1024, 8192, 500000.0, 1e-5
GLOBAL_BATCH, SEQ = 8, 256


def rope_tables(seq, head_dim):
    inv = 1.0 / THETA ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ang = torch.outer(torch.arange(seq).float(), inv)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    # x [b, t, h, d]: rotate the two halves (the Hugging Face Llama convention).
    a, b = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        cos, sin = rope_tables(SEQ, DIM // HEADS)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, h):
        b, t, _ = h.shape
        hd = DIM // HEADS
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = apply_rope(self.wq(h).view(b, t, -1, hd), self.cos[:t], self.sin[:t])
        k = apply_rope(self.wk(h).view(b, t, -1, hd), self.cos[:t], self.sin[:t])
        v = self.wv(h).view(b, t, -1, hd)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, h):
        return self.w2(F.silu(self.w1(h)) * self.w3(h))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM, eps=EPS), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(DIM, eps=EPS), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.norm = nn.RMSNorm(DIM, eps=EPS)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def pipeline_stage(layers, stage, stages):
    """The part of the model a pipeline stage holds: contiguous blocks, the embedding on the
    first stage, the norm and head on the last (torchtitan's manual split)."""
    model = Llama(layers)
    per = layers // stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != stages - 1:
        model.norm, model.output = None, None
    return model


def run_pipeline(args, rank, world):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    virtual = 2 if args.layout == "pp_inter" else 1
    stages = world * virtual
    ids = [rank + v * world for v in range(virtual)]
    modules = [pipeline_stage(args.layers, i, stages) for i in ids]
    pipe = [PipelineStage(m, i, stages, torch.device("cpu")) for m, i in zip(modules, ids)]
    params = [p for m in modules for p in m.parameters()]
    micro = GLOBAL_BATCH
    if virtual == 1:
        sched = Schedule1F1B(pipe[0], n_microbatches=micro, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(pipe, n_microbatches=micro, loss_fn=loss_fn)
    holds_first = 0 in ids
    holds_last = stages - 1 in ids

    def step(x):
        if holds_first and holds_last:
            sched.step(x[:, :-1], target=x[:, 1:])
        elif holds_first:
            sched.step(x[:, :-1])
        elif holds_last:
            sched.step(target=x[:, 1:])
        else:
            sched.step()

    return params, step


def run_tensor_parallel(args, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    sp = args.layout == "tp_sp"
    model = Llama(args.layers)
    # Between blocks the residual stream is sharded along the sequence under SP, whole otherwise.
    between = Shard(1) if sp else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if sp:
            # Norms run on sequence shards; each sub-block gathers its input once (all-gather
            # in) and its row-wise projection reduce-scatters the output.
            def gather():
                return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                         "attention": gather(), "feed_forward": gather()})
        parallelize_module(block, mesh, plan)
    params = list(model.parameters())

    def step(x):
        for m in range(GLOBAL_BATCH):
            logits = model(x[m : m + 1, :-1])
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), x[m : m + 1, 1:].flatten(0, 1))
                (loss / GLOBAL_BATCH).backward()

    return params, step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=("pp", "pp_inter", "tp", "tp_sp"), required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if args.layout.startswith("pp"):
        params, step = run_pipeline(args, rank, world)
    else:
        params, step = run_tensor_parallel(args, rank, world)
    opt = torch.optim.AdamW(params, lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # Every rank draws the same batch: pipeline stages and tensor-parallel ranks share it.
    g = torch.Generator().manual_seed(0)
    per_step = []
    for _ in range(args.steps):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        dist.barrier()
        t = time.perf_counter()
        step(x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        per_step.append(GLOBAL_BATCH * SEQ / (time.perf_counter() - t))
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        tps = statistics.median(per_step[args.warmup :]) if len(per_step) > args.warmup else math.nan
        print(json.dumps({"layout": args.layout, "layers": args.layers, "tokens_per_s": tps,
                          "peak_rss_mib": [round(float(p), 1) for p in peaks]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
