#!/usr/bin/env python3
"""Checks a chat model exported by `anneal checkpoint export --to-hf` with Hugging Face
transformers: the directory loads with `AutoTokenizer` and `AutoModelForCausalLM`, its chat
template renders conversations, and transformers' next-token log-probabilities of each rendered
conversation equal `anneal logprobs` on the same directory (so the logits agree up to each row's
log-sum-exp, which both compute).

    .venv/bin/python host/runtime/tests/reference/check_chat_export.py HF_DIR \
        [--chat host/runtime/tests/fixtures/tiny_qwen3_chat/chat.jsonl] [-n 8] [--anneal BIN]

Exits 1 when a log-probability differs by more than 1e-4.
"""
import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--chat", default="host/runtime/tests/fixtures/tiny_qwen3_chat/chat.jsonl")
    ap.add_argument("-n", type=int, default=8, help="conversations to check")
    ap.add_argument("--anneal", default="target/release/anneal")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    worst = 0.0
    with open(args.chat) as f:
        convs = [json.loads(line)["messages"] for line in f][: args.n]
    for i, messages in enumerate(convs):
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        with torch.no_grad():
            x = torch.tensor([ids])
            lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), dim=-1)
            hf = lp.gather(1, x[0, 1:, None])[:, 0]
        out = subprocess.run(
            [args.anneal, "logprobs", "--model-dir", args.hf_dir, "--tokens", ",".join(map(str, ids))],
            check=True, capture_output=True, text=True)
        ours = torch.tensor(json.loads(out.stdout)["logprobs"], dtype=torch.float64)
        d = (hf - ours).abs().max().item()
        worst = max(worst, d)
        print(f"conversation {i}: {len(ids)} tokens, max |log-prob difference| {d:.2e}")
    print(f"{args.hf_dir}: {len(convs)} conversations, worst {worst:.2e} (transformers vs anneal)")
    sys.exit(0 if worst <= 1e-4 else 1)


if __name__ == "__main__":
    main()
