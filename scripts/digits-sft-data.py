#!/usr/bin/env python3
"""Writes the supervised warm-start corpus of the RL demo (configs/rl_digits_sft.toml): JSON lines
{"text": "4213=1234"}, each a 3-5 digit string, '=', and the digits sorted.

Usage: scripts/digits-sft-data.py [OUT.jsonl] [N] [SEED]   (default data/digits_sft.jsonl 20000 1)
"""
import json
import os
import random
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "data/digits_sft.jsonl"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
with open(out, "w") as f:
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 5)))
        f.write(json.dumps({"text": f"{digits}={''.join(sorted(digits))}"}) + "\n")
print(f"wrote {n} tasks to {out}")
