#!/usr/bin/env python3
"""Regenerates the image processor fixtures in host/data/tests/fixtures/images/.

Run from the repository root, with a Python that has transformers (v5), torch, torchvision,
pillow, numpy and safetensors (no GPU needed):

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch torchvision transformers pillow numpy safetensors
    /tmp/refvenv/bin/python host/data/tests/reference/make_image_fixtures.py

It draws a few small deterministic images (numpy, no randomness beyond a fixed seed), saves them
as PNG / RGBA PNG / JPEG / WebP, and runs transformers' Qwen2-VL image processor on each: the slow
one (`Qwen2VLImageProcessorPil`, PIL's bicubic resize) and the fast one (`Qwen2VLImageProcessor`,
torchvision). Both are configured from the `preprocessor_config.json` written next to the images,
the file the Rust side parses too. Written:

- the images and three configs (`qwen2vl/`: Qwen2-VL's defaults; `qwen3vl/`: Qwen3-VL's patch 16
  and `size` dict, with small pixel bounds so the fixtures stay small; `tiny/`: a 512-pixel
  budget for a 7.5x downscale);
- `reference.safetensors`: per case `<case>.decoded` (PIL's RGB pixels after `convert_to_rgb`,
  u8 [H, W, 3]), `<case>.pixel_values` (the slow processor's, f32) and `<case>.image_grid_thw`
  (i64 [1, 3]);
- `cases.json`: per case its file, config, sizes and the slow-vs-fast max abs difference.
"""

import json
import pathlib

import numpy as np
from PIL import Image
from safetensors.numpy import save_file
from transformers.image_transforms import convert_to_rgb
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

OUT = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "images"

CONFIGS = {
    # Qwen2-VL / Qwen2.5-VL style: top-level min_pixels / max_pixels, CLIP mean and std.
    "qwen2vl": {
        "min_pixels": 3136,
        "max_pixels": 1003520,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 0.00392156862745098,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    },
    # Qwen3-VL style: `size` dict, patch 16, mean/std 0.5 (bounds made small for small fixtures).
    "qwen3vl": {
        "size": {"shortest_edge": 1024, "longest_edge": 8192},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
    },
    # Qwen3-VL style with a tiny pixel budget, so a 120 x 240 image shrinks 3.75x and 7.5x: the
    # filter's support is widest there.
    "tiny": {
        "size": {"shortest_edge": 256, "longest_edge": 512},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
}


def draw(h, w, seed, noise=20):
    """Gradients, a disc, stripes and a little seeded noise: edges and texture that resizing shows."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 255 * x / max(w - 1, 1)
    g = 255 * y / max(h - 1, 1)
    b = 128 + 100 * np.sin((x + 2 * y) / 3.0)
    disc = (x - w * 0.6) ** 2 + (y - h * 0.4) ** 2 < (min(h, w) * 0.3) ** 2
    r[disc], g[disc], b[disc] = 250, 30, 40
    stripes = (x.astype(int) // 4) % 2 == 0
    g[stripes & (y < h / 4)] = 255
    noise = np.random.default_rng(seed).integers(-noise, noise + 1, size=(h, w, 3))
    img = np.stack([r, g, b], axis=-1) + noise
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def make_images():
    """(case, file name, config) for each fixture; writes the image files."""
    cases = []

    def save(name, array, config, **kwargs):
        mode = "RGBA" if array.shape[-1] == 4 else "RGB"
        Image.fromarray(array, mode).save(OUT / name, **kwargs)
        cases.append((name.split(".")[0], name, config))

    # No resize: sides already multiples of 28 (or 32) within the bounds.
    save("rgb_h56_w56.png", draw(56, 56, 1), "qwen2vl")
    alpha = np.tile(np.linspace(0, 255, 56).astype(np.uint8)[None, :], (56, 1))
    save("rgba_h56_w56.png", np.dstack([draw(56, 56, 2), alpha]), "qwen2vl")
    save("photo_h56_w56.jpg", draw(56, 56, 3), "qwen2vl", quality=90)
    save("rgb_h64_w64.png", draw(64, 64, 4), "qwen3vl")
    # Resized: down (60 x 90 -> 56 x 84, lossy WebP), up (33 x 47 -> 56 x 84), and a 2x
    # downscale where the filter's support widens (200 x 120 -> 96 x 64 under qwen3vl's bounds).
    save("shapes_h60_w90.webp", draw(60, 90, 5), "qwen2vl", quality=85)
    save("small_h33_w47.png", draw(33, 47, 6), "qwen2vl")
    save("large_h200_w120.png", draw(200, 120, 7, noise=4), "qwen3vl")
    # 120 x 240 -> 32 x 32 under `tiny` (no noise, to keep the PNG small).
    save("wide_h120_w240.png", draw(120, 240, 8, noise=0), "tiny")
    # One side kept, so PIL skips that pass: 32 x 40 -> 32 x 32 and 40 x 32 -> 32 x 32 under `tiny`.
    save("onepass_h32_w40.png", draw(32, 40, 9, noise=0), "tiny")
    save("onepass_h40_w32.png", draw(40, 32, 10, noise=0), "tiny")
    return cases


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    processors = {}
    for name, config in CONFIGS.items():
        d = OUT / name
        d.mkdir(exist_ok=True)
        (d / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
        processors[name] = (
            Qwen2VLImageProcessorPil.from_pretrained(d),
            Qwen2VLImageProcessor.from_pretrained(d),
        )

    tensors, meta = {}, {}
    for case, file, config in make_images():
        image = Image.open(OUT / file)
        image.load()
        slow, fast = processors[config]
        s = slow(images=[image], return_tensors="np")
        f = fast(images=[image], return_tensors="pt")
        pv = np.asarray(s["pixel_values"], dtype=np.float32)
        fast_pv = f["pixel_values"].numpy().astype(np.float32)
        grid = np.asarray(s["image_grid_thw"], dtype=np.int64)
        assert grid.tolist() == f["image_grid_thw"].tolist(), case
        # PIL's own convert_to_rgb path, as the slow processor takes it.
        decoded = convert_to_rgb(Image.open(OUT / file), return_numpy=True)
        tensors[f"{case}.decoded"] = np.ascontiguousarray(decoded, dtype=np.uint8)
        tensors[f"{case}.pixel_values"] = np.ascontiguousarray(pv)
        tensors[f"{case}.image_grid_thw"] = grid
        t, gh, gw = grid[0].tolist()
        p = slow.patch_size
        meta[case] = {
            "file": file,
            "config": config,
            "input_hw": [image.height, image.width],
            "resized_hw": [gh * p, gw * p],
            "resized": [gh * p, gw * p] != [image.height, image.width],
            "slow_fast_max_abs_diff": float(np.abs(pv - fast_pv).max()),
        }
        print(case, meta[case])

    save_file(tensors, str(OUT / "reference.safetensors"))
    (OUT / "cases.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
