"""transformers peer of `bench/linear_attention.sh` (Qwen3.5, PyTorch on CPU).

    python bench/linear_attention.py save DIR --kind layer|hybrid|full   # random weights
    python bench/linear_attention.py step DIR --seq 2048 --iters 3 --threads 2
    python bench/linear_attention.py decode DIR --prompt 8192 --new 32 --threads 2

`layer` is one Qwen3.5 block whose mixer is a Gated DeltaNet (hidden 1024, 8 key heads and 16
value heads of 128, conv 4) with a small MLP and vocabulary, so the step is the mixer's cost;
`hybrid` is 4 blocks, three Gated DeltaNet and one full attention (Qwen3.5's 3:1), `full` the
same with full attention in every block. `step` prints the seconds of forward + mean
cross-entropy + backward per iteration (and of the forward part), `decode` the decode tokens/s
of greedy `generate` after a prompt (the time beyond a 1-token generate, which is the prefill).
"""

import argparse
import json
import time

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

GDN = dict(linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
           linear_value_head_dim=128, linear_conv_kernel_dim=4)


def config(kind):
    if kind == "layer":
        return Qwen3_5TextConfig(vocab_size=256, hidden_size=1024, intermediate_size=256, num_hidden_layers=1,
                                 layer_types=["linear_attention"], num_attention_heads=8, num_key_value_heads=2,
                                 head_dim=128, max_position_embeddings=16384, tie_word_embeddings=False, **GDN)
    layers = ["linear_attention"] * 3 + ["full_attention"] if kind == "hybrid" else ["full_attention"] * 4
    return Qwen3_5TextConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                             layer_types=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                             max_position_embeddings=16384, tie_word_embeddings=False, bos_token_id=None,
                             eos_token_id=None, pad_token_id=0, **GDN)


def save(path, kind):
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config(kind))
    model.save_pretrained(path, safe_serialization=True)
    print(json.dumps({"kind": kind, "params": sum(p.numel() for p in model.parameters())}))


def load(path, threads):
    torch.set_num_threads(threads)
    return Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def step(path, seq, iters, threads):
    model = load(path, threads).train()
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(3))
    seconds, forward = [], []
    for _ in range(iters):
        start = time.perf_counter()
        logits = model(tokens, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        forward.append(time.perf_counter() - start)
        loss.backward()
        seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    print(json.dumps({"seconds": seconds, "forward": forward, "seq": seq}))


def decode(path, prompt, new, threads):
    model = load(path, threads).eval()
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))

    def gen(n):
        with torch.no_grad():
            t = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)
            return time.perf_counter() - t

    full, first = gen(new), gen(1)
    print(json.dumps({"decode_tokens_per_s": (new - 1) / max(full - first, 1e-9)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["save", "step", "decode"])
    ap.add_argument("dir")
    ap.add_argument("--kind", default="layer", choices=["layer", "hybrid", "full"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.cmd == "save":
        save(a.dir, a.kind)
    elif a.cmd == "step":
        step(a.dir, a.seq, a.iters, a.threads)
    else:
        decode(a.dir, a.prompt, a.new, a.threads)


if __name__ == "__main__":
    main()
