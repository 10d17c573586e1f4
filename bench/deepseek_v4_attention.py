"""Checkpoints and FLOP counts for `bench/deepseek_v4_attention.sh`.

    python bench/deepseek_v4_attention.py save DIR --kind csa|hca|dense [--heads 2]
    python bench/deepseek_v4_attention.py flops --seq 8192 [--heads 2]

`save` writes a one-block DeepSeek-V4 (hidden 512, HEADS query heads of 128 sharing one
key/value head, RoPE on 32 dims, a window of 128, V4's rates: CSA blocks of 4 with the indexer
keeping 512 (4 heads of 64), HCA blocks of 128; two small experts and a 256-token vocabulary so
the attention dominates). `dense` is the same block as a sliding-window block whose window
covers the whole sequence: dense causal attention of the same width through the same code.
`--kind mix` stacks a sliding, a CSA, an HCA and a CSA block (bench/deepseek_v4_decode.sh).
`flops` prints the attention core's training FLOPs per token (scores and values: 4·H·Dh per key
forward, times 3 with the backward; the indexer's scores 2·Hi·Di per block, forward only).
"""

import argparse
import json

WIDTH = dict(hidden_size=512, head_dim=128, q_lora_rank=256, partial_rotary_factor=0.25, o_groups=2,
             o_lora_rank=128, index_n_heads=4, index_head_dim=64, index_topk=512, sliding_window=128,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
KIND = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention", "dense": "sliding_attention"}
MIX = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"]


def save(path, kind, heads):
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    width = dict(WIDTH)
    if kind == "dense":
        width["sliding_window"] = 1 << 20
    layers = MIX if kind == "mix" else [KIND[kind]]
    cfg = DeepseekV4Config(vocab_size=256, num_hidden_layers=len(layers), num_attention_heads=heads,
                           num_key_value_heads=1, moe_intermediate_size=64, n_routed_experts=2,
                           num_experts_per_tok=1, hc_mult=1, max_position_embeddings=16384, layer_types=layers,
                           mlp_layer_types=["moe"] * len(layers), **width)
    model = DeepseekV4ForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    print(json.dumps({"kind": kind, "params": sum(p.numel() for p in model.parameters())}))


def flops(seq, heads):
    hd, w = WIDTH["head_dim"], WIDTH["sliding_window"]
    hi, di, k = WIDTH["index_n_heads"], WIDTH["index_head_dim"], WIDTH["index_topk"]
    rates = WIDTH["compress_rates"]
    per_key = 12 * heads * hd
    dense_keys = (seq + 1) / 2
    csa_blocks = seq / rates["compressed_sparse_attention"] / 2
    keys = {
        "dense": dense_keys,
        "csa": min(w, seq) + min(csa_blocks, k),
        "hca": min(w, seq) + seq / rates["heavily_compressed_attention"] / 2,
    }
    out = {}
    for kind, n in keys.items():
        indexer = 2 * hi * di * csa_blocks if kind == "csa" else 0.0
        out[kind] = {"keys_per_query": n, "flops_per_token": per_key * n + indexer}
    print(json.dumps(out))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["save", "flops"])
    p.add_argument("dir", nargs="?")
    p.add_argument("--kind", choices=list(KIND) + ["mix"])
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    a = p.parse_args()
    if a.cmd == "save":
        save(a.dir, a.kind, a.heads)
    else:
        flops(a.seq, a.heads)
