"""PyTorch peer of `bench/tp_vs_pytorch.sh`: HF LlamaForCausalLM with the debug model's shape,
tensor parallel with DTensor (`parallelize_module`: q/k/v and gate/up column-wise, o and down
row-wise, the embedding split by vocabulary, the head column-wise with its logits left sharded
for `loss_parallel`, as TorchTitan plans it; `--sp` adds sequence parallelism on the norms) over
gloo, one thread per rank, AdamW and norm clipping. Every rank trains on the whole global batch
of 8 x 256 random tokens in micro-batches of 1 (Anneal's layout); rank 0 prints one JSON line
with the per-step tokens/s and every rank's peak resident memory.

    torchrun --nproc_per_node 2 bench/tp_vs_pytorch.py --steps 12 [--sp]
"""

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from transformers import LlamaConfig, LlamaForCausalLM

GLOBAL_BATCH, SEQ, VOCAB = 8, 256, 8192


def plan(sp):
    """TorchTitan's Llama plan: the block's projections, and with `sp` the norms on shards."""
    seq = Shard(1) if sp else Replicate()
    block = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        block["input_layernorm"] = SequenceParallel()
        block["post_attention_layernorm"] = SequenceParallel()
        block["self_attn.q_proj"] = ColwiseParallel(input_layouts=Shard(1))
        block["self_attn.k_proj"] = ColwiseParallel(input_layouts=Shard(1))
        block["self_attn.v_proj"] = ColwiseParallel(input_layouts=Shard(1))
        block["mlp.gate_proj"] = ColwiseParallel(input_layouts=Shard(1))
        block["mlp.up_proj"] = ColwiseParallel(input_layouts=Shard(1))
    outer = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        outer["model.norm"] = SequenceParallel()
    return block, outer


def clip_grad_norm(params, max_norm):
    """The global norm with each shard counted once (replicated gradients, DTensor or not, are
    counted from one rank's copy), then clipping; `clip_grad_norm_` refuses the mix of plain
    tensors (norms without SP) and DTensors."""
    sharded, whole = torch.zeros(()), torch.zeros(())
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        sq = local.float().pow(2).sum()
        if isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements):
            sharded += sq
        else:
            whole += sq
    dist.all_reduce(sharded)
    norm = (sharded + whole).sqrt()
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    for g in grads:
        g.mul_(scale)
    return norm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=1024,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).train()
    block, outer = plan(args.sp)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, block)
    parallelize_module(model, mesh, outer)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    per_step = []
    pos = torch.arange(SEQ).unsqueeze(0)
    for _ in range(args.steps):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        dist.barrier()
        t = time.perf_counter()
        for i in range(GLOBAL_BATCH):
            # Explicit positions: under SP the embedding's local output holds half the
            # sequence, from which HF would otherwise count the positions.
            logits = model(input_ids=x[i : i + 1, :-1], position_ids=pos, cache_position=pos[0]).logits
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, VOCAB).float(), x[i : i + 1, 1:].reshape(-1)
                ) / GLOBAL_BATCH
                loss.backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        per_step.append(GLOBAL_BATCH * SEQ / (time.perf_counter() - t))
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    all_rss = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(all_rss, rss)
    if rank == 0:
        print(json.dumps({"tokens_per_s": per_step, "peak_rss_bytes": [int(r) for r in all_rss]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
