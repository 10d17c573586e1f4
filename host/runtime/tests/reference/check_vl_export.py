#!/usr/bin/env python3
"""Reloads the Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE (with vision), Muse Glimmer, Muse Spark Open and Kimi K2.7 checkpoints that
Anneal exported in transformers and compares their logits on the fixture's prompt with both
images against the fixtures' (what transformers computed with the original checkpoints). Needs
torch, safetensors and transformers (5.x):

    ANNEAL_VL_EXPORT=/tmp/vl-export cargo test --release -p anneal-runtime --test qwen3_vl export
    ANNEAL_VL_EXPORT=/tmp/vl-export cargo test --release -p anneal-runtime --test qwen3_5_vl export
    ANNEAL_VL_EXPORT=/tmp/vl-export cargo test --release -p anneal-runtime --test vl_families export
    python host/runtime/tests/reference/check_vl_export.py /tmp/vl-export [NAME ...]

checks the fixtures NAME (all seven when none is named). Exits 1 when any logit differs by more
than 1e-4.
"""
import pathlib
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures"
NAMES = ["tiny_qwen3_vl", "tiny_qwen3_vl_moe", "tiny_qwen3_5_vl", "tiny_qwen3_5_moe_vl", "tiny_muse_glimmer", "tiny_kimi_k25", "tiny_muse_spark"]


def main():
    worst = 0.0
    for name in sys.argv[2:] or NAMES:
        path = pathlib.Path(sys.argv[1]) / name
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        muse = name in ("tiny_muse_glimmer", "tiny_kimi_k25", "tiny_muse_spark")
        exp = load_file(FIXTURES / name / ("expected_vl.safetensors" if muse else "expected.safetensors"))
        if "pixel_values" not in exp:
            # The Qwen3.5 fixtures share tiny_qwen3_vl's images.
            exp |= {k: v for k, v in load_file(FIXTURES / "tiny_qwen3_vl" / "expected.safetensors").items()
                    if k in ("pixel_values", "image_grid_thw")}
        tokens = exp["vl_tokens"]
        image_token = model.config.image_token_id
        pixels = exp["pixel_values"]
        if model.config.model_type == "kimi_k25":
            # MoonViT's patch embedding is a Conv2d over [patches, C, p, p].
            p = model.config.vision_config.patch_size
            pixels = pixels.reshape(pixels.shape[0], 3, p, p)
        with torch.no_grad():
            logits = model(input_ids=tokens, pixel_values=pixels,
                           image_grid_thw=exp["image_grid_thw"],
                           mm_token_type_ids=(tokens == image_token).int()).logits
        diff = (logits.float() - exp["vl_logits"]).abs().max().item()
        worst = max(worst, diff)
        print(f"{name}: {type(model).__name__} from the export, max |logit difference| "
              f"{diff:.2e} over {tokens.shape[1]} positions with 2 images")
    sys.exit(0 if worst <= 1e-4 else 1)


if __name__ == "__main__":
    main()
