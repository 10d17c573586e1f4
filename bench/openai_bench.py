"""Total generated tokens/s of N concurrent clients vs the same N requests made one after the
other, against `anneal serve --model ...` (the official openai client, greedy decoding).

Usage: openai_bench.py BASE_URL MODEL [--clients 16] [--max-tokens 64]
Prints one JSON line: sequential and concurrent tokens/s, the ratio, and whether both modes
produced the same texts (they must: batching does not change results).
"""

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

ap = argparse.ArgumentParser()
ap.add_argument("base_url")
ap.add_argument("model")
ap.add_argument("--clients", type=int, default=16)
ap.add_argument("--max-tokens", type=int, default=64)
args = ap.parse_args()

client = OpenAI(base_url=args.base_url + "/v1", api_key="not-needed", max_retries=0, timeout=600)
subjects = ["The king", "A fool", "My lord", "The queen", "This night", "Our town", "Good sir", "Fair maid"]
verbs = ["speaks of", "waits for", "dreams of", "forgets", "remembers", "calls"]
prompts = [f"{subjects[i % len(subjects)]} {verbs[i % len(verbs)]}" for i in range(args.clients)]


def one(prompt):
    r = client.completions.create(
        model=args.model, prompt=prompt, max_tokens=args.max_tokens, temperature=0
    )
    return r.choices[0].text, r.usage.completion_tokens


one(prompts[0])  # warm-up (first-touch allocations, connection)
t0 = time.perf_counter()
sequential = [one(p) for p in prompts]
t_seq = time.perf_counter() - t0
t0 = time.perf_counter()
with ThreadPoolExecutor(max_workers=args.clients) as pool:
    concurrent = list(pool.map(one, prompts))
t_con = time.perf_counter() - t0
tokens_seq = sum(n for _, n in sequential)
tokens_con = sum(n for _, n in concurrent)
seq_tps, con_tps = tokens_seq / t_seq, tokens_con / t_con
print(json.dumps({
    "model": args.model,
    "clients": args.clients,
    "max_tokens": args.max_tokens,
    "tokens": tokens_con,
    "sequential_s": round(t_seq, 3),
    "concurrent_s": round(t_con, 3),
    "sequential_tokens_per_s": round(seq_tps, 1),
    "concurrent_tokens_per_s": round(con_tps, 1),
    "ratio": round(con_tps / seq_tps, 2),
    "same_texts": [t for t, _ in sequential] == [t for t, _ in concurrent],
}))
