#!/usr/bin/env python3
"""Regenerates the PyTorch reference fixtures the engine's tests compare against.

Run from the repository root (needs torch and safetensors, e.g. in a venv:
`python3 -m venv .venv && .venv/bin/pip install torch safetensors`):

    .venv/bin/python host/engine/tests/reference/make_fixtures.py

Each `fixtures_<family>.py` next to this file defines `make() -> dict[str, torch.Tensor]`; its
tensors are written to `host/engine/tests/fixtures/<family>.safetensors`. Inputs are stored next
to expected outputs, so the Rust tests need no PyTorch.
"""
import importlib
import pathlib
import sys

import torch
from safetensors.torch import save_file

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE.parent / "fixtures"


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    OUT.mkdir(exist_ok=True)
    families = sorted(p.stem[len("fixtures_"):] for p in HERE.glob("fixtures_*.py"))
    only = set(sys.argv[1:])
    for fam in families:
        if only and fam not in only:
            continue
        mod = importlib.import_module(f"fixtures_{fam}")
        tensors = {k: v.detach().contiguous() for k, v in mod.make().items()}
        save_file(tensors, str(OUT / f"{fam}.safetensors"))
        print(f"{fam}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
