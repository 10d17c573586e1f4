#!/usr/bin/env python3
"""Writes tiny random Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (with vision) models and
their outputs for the plugin tests.

Needs torch, safetensors, transformers (5.x) and pillow; run from the repository root with a
Python that has them, e.g.:

    python host/runtime/tests/reference/make_vl_fixture.py           # everything
    python host/runtime/tests/reference/make_vl_fixture.py --grads   # only tiny_qwen3_vl's grads
    python host/runtime/tests/reference/make_vl_fixture.py --moe     # only tiny_qwen3_vl_moe
    python host/runtime/tests/reference/make_vl_fixture.py --qwen3-5 # only the two Qwen3.5 ones

Writes `host/runtime/tests/fixtures/tiny_qwen3_vl/`: `config.json` and `model.safetensors` as
`save_pretrained` writes them; `preprocessor_config.json` (`PROCESSOR`) and the two images as
`image0.png` and `image1.png` (`write_inputs`, which needs only numpy and pillow), and
`huge.png`, a PNG whose header claims 20,000 × 20,000 pixels (for the pixel limit); and
`expected.safetensors` holding
- `pixel_values` (f32 [patches, C·t·p·p]) and `image_grid_thw` (i64 [2, 3]): the slow
  Qwen2-VL image processor's output for two generated images, a 64×32 one kept as it is and a
  70×50 one resized to 64×64;
- `image_embeds` (f32 [tokens, D]): the tower's merged embeddings, `deepstack.<j>` (f32
  [tokens, D]) its DeepStack features;
- `tokens` / `logits`: a text-only prompt and the full model's logits;
- `vl_tokens` / `vl_logits` / `vl_positions`: a prompt holding both images (2 and 4 placeholder
  tokens, each between vision start and end tokens), the logits with the images, and
  `get_rope_index`'s 3-D positions (i64 [3, 1, T]);

and `grads.safetensors` (`write_grads`). `tiny_qwen3_vl_moe/` holds the same for a Qwen3-VL-MoE
model (4 experts, top 2, fused `gate_up_proj` / `down_proj` expert tensors), with its processor
config beside it; its images are `tiny_qwen3_vl/`'s.

`tiny_qwen3_5_vl/` and `tiny_qwen3_5_moe_vl/` (`qwen3_5`) hold `Qwen3_5ForConditionalGeneration`
and `Qwen3_5MoeForConditionalGeneration` checkpoints (Gated DeltaNet and gated full attention
with partial, interleaved MRoPE; a tower without DeepStack; the MoE one's experts saved per
expert) with `expected.safetensors` and `grads.safetensors` as above, less `pixel_values` and
`image_grid_thw`: they take `tiny_qwen3_vl/`'s, which the processor makes again here and checks.
"""
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import json

import numpy as np
from PIL import Image

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures"
OUT = FIXTURES / "tiny_qwen3_vl"

# The image processor's settings: 16-pixel patches merged 2 × 2, between 32² and 64² pixels.
PROCESSOR = dict(
    patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32, max_pixels=64 * 64,
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    image_processor_type="Qwen2VLImageProcessor",
)


def images():
    rng = np.random.default_rng(7)
    a = rng.integers(0, 256, size=(32, 64, 3), dtype=np.uint8)  # h 32, w 64: no resize
    b = rng.integers(0, 256, size=(50, 70, 3), dtype=np.uint8)  # resized to 64 × 64
    return [Image.fromarray(a), Image.fromarray(b)]


def write_inputs(images_too=True):
    """The images as files (PNG: lossless, so `anneal logprobs --image` reads the same pixels)
    and the processor's config, beside the checkpoint. Needs only numpy and pillow."""
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2) + "\n")
    if images_too:
        for i, image in enumerate(images()):
            image.save(OUT / f"image{i}.png")
        (OUT / "huge.png").write_bytes(huge_png())


def huge_png():
    """A valid PNG header claiming 20,000 × 20,000 RGB pixels, with a few bytes of data."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


def main(moe=False):
    import torch
    from safetensors.torch import save_file
    from transformers import (Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)

    global OUT
    OUT = FIXTURES / ("tiny_qwen3_vl_moe" if moe else "tiny_qwen3_vl")
    torch.manual_seed(0)
    text = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                             mrope_interleaved=True),
    )
    if moe:
        text.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                    decoder_sparse_step=1, mlp_only_layers=[])
    config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text,
        vision_config=dict(
            depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32,
            patch_size=16, temporal_patch_size=2, in_channels=3, spatial_merge_size=2,
            num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
        ),
        image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
        tie_word_embeddings=False,
    )
    model_class = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    model = model_class(config).float().eval()
    # Random norm weights and biases, so a swapped or missing one shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if "experts" in name or name.endswith("mlp.gate.weight"):
                # transformers 5 leaves fused experts and the router uninitialised (zeros).
                p.copy_(torch.randn_like(p) * 0.2)
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)

    proc = Qwen2VLImageProcessor(
        **{k: v for k, v in PROCESSOR.items() if k != "image_processor_type"})
    write_inputs(images_too=not moe)
    inputs = proc(images=images(), return_tensors="pt")
    pixel_values, grid = inputs["pixel_values"].float(), inputs["image_grid_thw"].long()
    with torch.no_grad():
        vis = model.model.visual(pixel_values, grid_thw=grid)
        tokens = torch.randint(0, 90, (1, 12))
        logits = model(input_ids=tokens).logits
    placeholders = lambda n: [92] + [90] * n + [93]
    vl_tokens = torch.tensor([[1, 2, 3, *placeholders(2), 4, 5, *placeholders(4), 6, 7, 8]])
    mm_types = (vl_tokens == 90).int()
    with torch.no_grad():
        vl_logits = model(input_ids=vl_tokens, pixel_values=pixel_values, image_grid_thw=grid,
                          mm_token_type_ids=mm_types).logits
        vl_positions, _ = model.model.get_rope_index(vl_tokens, mm_types, image_grid_thw=grid)
    out = {
        "vl_tokens": vl_tokens.contiguous(),
        "vl_logits": vl_logits.float().contiguous(),
        "vl_positions": vl_positions.contiguous(),
        "pixel_values": pixel_values.contiguous(),
        "image_grid_thw": grid.contiguous(),
        "image_embeds": vis.pooler_output.contiguous(),
        "tokens": tokens.contiguous(),
        "logits": logits.float().contiguous(),
    }
    for j, f in enumerate(vis.deepstack_features):
        out[f"deepstack.{j}"] = f.contiguous()
    save_file(out, OUT / "expected.safetensors")
    print({k: tuple(v.shape) for k, v in out.items()}, grid.tolist())
    write_grads(model)


def write_grads(model=None, out=None, rename=None):
    """`grads.safetensors`: `vl_loss`, the mean next-token cross-entropy of `vl_tokens` with
    both images, and `grad.<name>`, its gradient for every parameter under the checkpoint's
    names (`rename(name, grad)` yields them where the checkpoint stores a parameter otherwise
    than it is held). Without a model (`--grads`) the saved checkpoint and
    `expected.safetensors` are read, so the gradients can be added without rewriting the rest."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLForConditionalGeneration

    out = OUT if out is None else out
    if model is None:
        model = Qwen3VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    exp = load_file(out / "expected.safetensors")
    tokens = exp["vl_tokens"]
    pixels, grid = exp.get("pixel_values"), exp.get("image_grid_thw")
    if pixels is None:
        pixels, grid = shared_pixels()
    model.zero_grad()
    logits = model(input_ids=tokens, pixel_values=pixels, image_grid_thw=grid,
                   mm_token_type_ids=(tokens == 90).int()).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
    loss.backward()
    grads = {"vl_loss": loss.detach().reshape(1).contiguous()}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        for saved, part in (rename(name, g) if rename else [(name, g)]):
            grads[f"grad.{saved}"] = part.contiguous()
    save_file(grads, out / "grads.safetensors")
    print(f"vl_loss {loss.item():.6f}, {len(grads) - 1} gradients")


def shared_pixels():
    """`tiny_qwen3_vl/`'s `pixel_values` and `image_grid_thw`, which the other fixtures share."""
    from safetensors.torch import load_file

    exp = load_file(FIXTURES / "tiny_qwen3_vl" / "expected.safetensors")
    return exp["pixel_values"], exp["image_grid_thw"]


def qwen3_5(moe=False):
    """`tiny_qwen3_5_vl/` (or `tiny_qwen3_5_moe_vl/`): a Qwen3.5 (-MoE) model with vision, as
    small as it can be and still show each part: a gated full-attention block between two Gated
    DeltaNet blocks, its two query heads (one KV head) rotating half their 24 dims (6 frequency
    pairs, `mrope_section` [3, 2, 1]: the sixth pair goes back to time); a two-block tower of
    width 8 (two heads of 4) without DeepStack; tied embeddings; for MoE, 4 experts of 8 (top
    2) beside a gated shared expert of 16."""
    import torch
    from safetensors.torch import save_file
    from transformers import (Qwen2VLImageProcessor, Qwen3_5Config, Qwen3_5ForConditionalGeneration,
                              Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)
    from make_hf_fixtures import checkpoint_grads

    out_dir = FIXTURES / ("tiny_qwen3_5_moe_vl" if moe else "tiny_qwen3_5_vl")
    torch.manual_seed(35)
    text = dict(
        vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, max_position_embeddings=128,
        rms_norm_eps=1e-6, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                             mrope_section=[3, 2, 1], mrope_interleaved=True),
    )
    if moe:
        del text["intermediate_size"]
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                    shared_expert_intermediate_size=16)
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text,
        vision_config=dict(
            depth=2, hidden_size=8, num_heads=2, intermediate_size=16, out_hidden_size=32,
            patch_size=16, temporal_patch_size=2, in_channels=3, spatial_merge_size=2,
            num_position_embeddings=16,
        ),
        image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
        tie_word_embeddings=True,
    )
    model_class = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    model = model_class(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random norm weights and biases (the zero-centred RMSNorms start at 0), so a swapped
            # or missing one shows.
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if "experts" in name or name.endswith("mlp.gate.weight"):
                # transformers 5 leaves fused experts and the router uninitialised (zeros).
                p.copy_(torch.randn_like(p) * 0.2)
            if name.endswith("A_log"):
                # A = exp(A_log) up to 16 decays the Gated DeltaNet state by up to e^-20 a
                # token: it forgets at once, and A_log's gradient shrinks to 1e-8, the edge of
                # f32 rounding. Divided by e^3, the state carries the images to the text after.
                p.sub_(3.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").unlink(missing_ok=True)

    # The processor makes tiny_qwen3_vl's pixels again: the two fixtures share them.
    proc = Qwen2VLImageProcessor(
        **{k: v for k, v in PROCESSOR.items() if k != "image_processor_type"})
    inputs = proc(images=images(), return_tensors="pt")
    pixel_values, grid = shared_pixels()
    assert torch.equal(inputs["pixel_values"].float(), pixel_values)
    assert torch.equal(inputs["image_grid_thw"].long(), grid)
    placeholders = lambda n: [92] + [90] * n + [93]
    vl_tokens = torch.tensor([[1, 2, 3, *placeholders(2), 4, 5, *placeholders(4), 6, 7, 8]])
    mm_types = (vl_tokens == 90).int()
    with torch.no_grad():
        vis = model.model.visual(pixel_values, grid_thw=grid)
        tokens = torch.randint(0, 90, (1, 12))
        logits = model(input_ids=tokens).logits
        vl_logits = model(input_ids=vl_tokens, pixel_values=pixel_values, image_grid_thw=grid,
                          mm_token_type_ids=mm_types).logits
        vl_positions, _ = model.model.get_rope_index(vl_tokens, mm_types, image_grid_thw=grid)
    out = {
        "vl_tokens": vl_tokens.contiguous(),
        "vl_logits": vl_logits.float().contiguous(),
        "vl_positions": vl_positions.contiguous(),
        "image_embeds": vis.pooler_output.contiguous(),
        "tokens": tokens.contiguous(),
        "logits": logits.float().contiguous(),
    }
    save_file(out, out_dir / "expected.safetensors")
    print({k: tuple(v.shape) for k, v in out.items()}, grid.tolist())
    model_type = "qwen3_5_moe" if moe else "qwen3_5"
    write_grads(model, out_dir, lambda name, g: checkpoint_grads(name, g, model_type))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--grads"]:
        write_grads()
    elif sys.argv[1:] == ["--moe"]:
        main(moe=True)
    elif sys.argv[1:] == ["--qwen3-5"]:
        qwen3_5()
        qwen3_5(moe=True)
    else:
        main()
        main(moe=True)
        qwen3_5()
        qwen3_5(moe=True)
