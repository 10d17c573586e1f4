"""Checks an exported checkpoint with Hugging Face transformers: loads the directory written by
`anneal checkpoint export --to-hf`, scores a text with its tokenizer, and compares the loss with
`anneal logprobs` on the same directory.

    .venv/bin/python host/runtime/tests/reference/check_hf_export.py HF_DIR [--text T] [--anneal BIN]
        [--vendored kimi_k3_modeling]

`--vendored` first imports a model this directory vendors (Kimi K3's, from transformers' main
branch), which registers its `model_type` with transformers' Auto classes.

Exits 1 when the two losses differ by more than 1e-4.
"""

import argparse
import importlib
import json
import pathlib
import subprocess
import sys

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--text", default="My lord, the queen speaks of a storm upon the sea.")
    ap.add_argument("--anneal", default="target/release/anneal")
    ap.add_argument("--vendored", help="a module beside this script to import first")
    args = ap.parse_args()
    if args.vendored:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        importlib.import_module(args.vendored)
    tok = Tokenizer.from_file(f"{args.hf_dir}/tokenizer.json")
    ids = tok.encode(args.text, add_special_tokens=False).ids
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0, :-1].double()
        hf_loss = torch.nn.functional.cross_entropy(logits, x[0, 1:]).item()
    out = subprocess.run(
        [args.anneal, "logprobs", "--model-dir", args.hf_dir, "--tokens", ",".join(map(str, ids))],
        check=True,
        capture_output=True,
        text=True,
    )
    ours = json.loads(out.stdout)["loss"]
    print(f"tokens {len(ids)}  transformers loss {hf_loss:.6f}  anneal loss {ours:.6f}  |diff| {abs(hf_loss - ours):.2e}")
    sys.exit(0 if abs(hf_loss - ours) <= 1e-4 else 1)


if __name__ == "__main__":
    main()
