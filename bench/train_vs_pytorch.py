"""PyTorch peer of `bench/train_vs_pytorch.sh`: HF LlamaForCausalLM with the debug model's shape,
AdamW, fp32, trained for N steps on random tokens; prints one JSON line with the per-step
tokens/s (the first steps, which include compilation, are reported separately).

    python bench/train_vs_pytorch.py --mode eager|compile --steps 20 --threads 2
"""

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=1024,
        vocab_size=8192,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step(x):
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if args.mode == "compile":
        step = torch.compile(step)
    g = torch.Generator().manual_seed(0)
    tokens = args.batch * args.seq
    per_step = []
    for _ in range(args.steps):
        x = torch.randint(0, 8192, (args.batch, args.seq + 1), generator=g)
        t = time.perf_counter()
        loss = step(x)
        float(loss)
        per_step.append(tokens / (time.perf_counter() - t))
    print(json.dumps({"mode": args.mode, "tokens_per_s": per_step, "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
