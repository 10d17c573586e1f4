#!/usr/bin/env python3
"""Prints the parameter counts (parameters only, buffers such as the routers' balancing bias left
out) of the full-size Kimi K3 (the default KimiK3Config of the vendored kimi_k3_modeling.py) and of
the debug configuration, built on the meta device.

    .venv/bin/python host/runtime/tests/reference/count_kimi_k3.py
"""
import importlib.util
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

HERE = pathlib.Path(__file__).resolve().parent

DEBUG = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=6, attn_res_block_size=2,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention",
                 "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, linear_attn_key_heads=4, linear_attn_key_head_dim=64,
    linear_attn_value_heads=4, linear_attn_value_head_dim=64, conv_kernel_size=4, forget_gate_lower_bound=-5.0,
    n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    n_shared_experts=1, moe_intermediate_size=128, routed_expert_hidden_size=128, activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0, max_position_embeddings=2048,
)


def main():
    spec = importlib.util.spec_from_file_location("kimi_k3_modeling", HERE / "kimi_k3_modeling.py")
    k3 = importlib.util.module_from_spec(spec)
    sys.modules["kimi_k3_modeling"] = k3
    spec.loader.exec_module(k3)
    for name, config in (("full-size Kimi K3", k3.KimiK3Config()), ("debug", k3.KimiK3Config(**DEBUG))):
        with torch.device("meta"):
            model = k3.KimiK3ForCausalLM(config)
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
