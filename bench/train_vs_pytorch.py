"""PyTorch peer of `bench/train_vs_pytorch.sh`: HF LlamaForCausalLM with the debug model's shape
(or, with `--model moe`, HF Qwen3MoeForCausalLM with the shape of `configs/qwen3_moe_debug.toml`:
8 experts of 256, top 2, renormalised, load-balancing loss 0.001), AdamW, trained for N steps on
random tokens; prints one JSON line with the per-step tokens/s
(the first steps, which include compilation, are dropped by the caller).

  --mode eager|compile   torch eager or torch.compile of the whole step
  --dtype f32|bf16       bf16: CPU autocast (bf16 matmuls, f32 master weights and AdamW state),
                         the peer of Anneal's `training.dtype = "bf16"`

    python bench/train_vs_pytorch.py --mode eager|compile --dtype f32|bf16 --steps 20 --threads 2
"""

import argparse
import contextlib
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

BATCH, SEQ, VOCAB = 8, 256, 8192


AUX_COEF = 0.001


def moe_model():
    """The debug Qwen3-MoE of configs/qwen3_moe_debug.toml."""
    cfg = Qwen3MoeConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen3MoeForCausalLM(cfg).train()


def build(mode="eager", dtype="f32", batch=BATCH, seq=SEQ, arch="llama"):
    """(step(x) -> loss, batch(generator) -> x) for the debug Llama (or Qwen3-MoE)."""
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
    model = moe_model() if arch == "moe" else LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def autocast():
        if dtype == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(x):
        with autocast():
            out = model(input_ids=x[:, :-1], **({"output_router_logits": True} if arch == "moe" else {}))
            logits = out.logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1)
            )
            if arch == "moe":
                loss = loss + AUX_COEF * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if mode == "compile":
        step = torch.compile(step)

    def make_batch(g):
        return torch.randint(0, VOCAB, (batch, seq + 1), generator=g)

    return step, make_batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--seq", type=int, default=SEQ)
    ap.add_argument("--model", choices=["llama", "moe"], default="llama")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    step, make_batch = build(args.mode, args.dtype, args.batch, args.seq, args.model)
    g = torch.Generator().manual_seed(0)
    tokens = args.batch * args.seq
    per_step = []
    for _ in range(args.steps):
        x = make_batch(g)
        t = time.perf_counter()
        loss = step(x)
        float(loss)
        per_step.append(tokens / (time.perf_counter() - t))
    print(json.dumps({"mode": args.mode, "dtype": args.dtype, "tokens_per_s": per_step}))


if __name__ == "__main__":
    main()
