"""Hugging Face peer of `bench/generate_vs_hf.sh`.

    python bench/generate_vs_hf.py save DIR              # writes the debug Llama (random weights)
    python bench/generate_vs_hf.py run DIR --batch 32 --new 64 --prompt 16 --threads 2

`run` prints one JSON line: decode tokens/s of `generate` (greedy, KV cache) measured as
batch · (new − 1) tokens over the time beyond a 1-token generate (which is the prefill).
"""

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def save(path):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=1024, vocab_size=8192, max_position_embeddings=2048,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def run(path, batch, new, prompt, threads, reps):
    torch.set_num_threads(threads)
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 8192, (1, prompt), generator=g).repeat(batch, 1)
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.no_grad():
            t = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, use_cache=True, pad_token_id=0)
            return time.perf_counter() - t

    gen(new)  # warm-up
    tps = []
    for _ in range(reps):
        full, first = gen(new), gen(1)
        tps.append(batch * (new - 1) / max(full - first, 1e-9))
    print(json.dumps({"batch": batch, "decode_tokens_per_s": sorted(tps)[len(tps) // 2]}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["save", "run"])
    ap.add_argument("dir")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if a.cmd == "save":
        save(a.dir)
    else:
        run(a.dir, a.batch, a.new, a.prompt, a.threads, a.reps)


if __name__ == "__main__":
    main()
