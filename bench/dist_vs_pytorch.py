"""PyTorch peer of `bench/dist_vs_pytorch.sh`: HF LlamaForCausalLM with the debug model's shape
(the one `bench/train_vs_pytorch.py` builds), sharded with FSDP2 (`fully_shard` on every decoder
layer and on the root) over the gloo backend, AdamW and norm clipping, one thread per rank. Each
rank trains on its half of a global batch of 8 x 256 random tokens; rank 0 prints one JSON line
with the per-step global tokens/s and every rank's peak resident memory.

    torchrun --nproc_per_node 2 bench/dist_vs_pytorch.py --steps 20
"""

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

GLOBAL_BATCH, SEQ, VOCAB = 8, 256, 8192


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
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
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)
    local = GLOBAL_BATCH // world
    per_step = []
    for _ in range(args.steps):
        x = torch.randint(0, VOCAB, (local, SEQ + 1), generator=g)
        dist.barrier()
        t = time.perf_counter()
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
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
