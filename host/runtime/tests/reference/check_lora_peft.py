"""Loads an `anneal checkpoint export --adapter` directory with `peft` onto its base model and
compares the logits with the merged export of the same checkpoint, both run by transformers.

    python check_lora_peft.py BASE_DIR ADAPTER_DIR MERGED_DIR

BASE_DIR is the Hugging Face checkpoint the LoRA run started from (checkpoint.init_from_hf),
ADAPTER_DIR the adapter export and MERGED_DIR the merged export (`--to-hf` alone). Prints the
worst absolute difference of the logits over a few sequences and fails above 1e-4.
Needs torch, transformers and peft (e.g. `pip install torch transformers peft`).
"""
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main(base_dir, adapter_dir, merged_dir):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    vocab = base.config.vocab_size
    ids = torch.randint(0, vocab, (3, 48))
    with torch.no_grad():
        plain = base(ids).logits
    peft = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        a = peft(input_ids=ids).logits
        b = merged(ids).logits
    worst = (a - b).abs().max().item()
    moved = (a - plain).abs().max().item()
    print(f"peft vs merged export: worst |logit difference| {worst:.3e} "
          f"(the adapters move the base's logits by up to {moved:.3e})")
    if worst > 1e-4 or moved < 1e-3:
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
