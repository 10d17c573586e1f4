#!/usr/bin/env python3
"""Checks a Kimi K3 (`kimi_k3`) checkpoint with the vendored reference (kimi_k3_modeling.py, which
registers `kimi_k3` with transformers' Auto classes): loads HF_DIR in float32 with
`from_pretrained`, runs the tokens of FIXTURE_DIR/expected.safetensors and compares its logits
with the fixture's.

    .venv/bin/python host/runtime/tests/reference/check_kimi_k3_export.py HF_DIR FIXTURE_DIR

Exits 1 when the largest |logit difference| exceeds 1e-4 (or the shapes differ).
"""
import importlib.util
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from safetensors.torch import load_file

HERE = pathlib.Path(__file__).resolve().parent


def load_reference():
    spec = importlib.util.spec_from_file_location("kimi_k3_modeling", HERE / "kimi_k3_modeling.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kimi_k3_modeling"] = module
    spec.loader.exec_module(module)
    return module


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    hf_dir, fixture_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    k3 = load_reference()
    model = k3.KimiK3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    expected = load_file(str(fixture_dir / "expected.safetensors"))
    tokens, want = expected["tokens"], expected["logits"]
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    if logits.shape != want.shape:
        print(f"logits of shape {tuple(logits.shape)}, the fixture's are {tuple(want.shape)}")
        sys.exit(1)
    diff = (logits - want).abs().max().item()
    print(f"tokens {tuple(tokens.shape)}  max |logit difference| {diff:.3e}")
    sys.exit(0 if diff <= 1e-4 else 1)


if __name__ == "__main__":
    main()
