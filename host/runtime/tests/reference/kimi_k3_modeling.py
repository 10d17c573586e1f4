# Copyright 2026 The Moonshot AI Team and the HuggingFace Inc. team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Reference (torch-only) implementation of the Kimi K3 text model (`model_type = "kimi_k3"`).

Vendored from huggingface/transformers, main branch,
`src/transformers/models/kimi_k3/modular_kimi_k3.py` at commit
e6ffd1347cc61c22b7120d1b556101c6908ba12e, so that the parity fixture can be written with the
transformers 5.25 that is installed (which has no `kimi_k3`). Apache-2.0, header kept above.

Taken from that file, with the same math: KimiK3RMSNorm, KimiK3RMSNormGated (the sigmoid
variant), KimiK3ShortConvolution, l2norm, torch_chunk_kda, torch_recurrent_kda,
KimiK3DeltaAttention, KimiK3GatedMLA, situ_and_mul, KimiK3MLP, KimiK3TopkRouter, KimiK3Experts,
KimiK3MoE, KimiK3DecoderLayer, KimiK3AttentionResidual, and KimiK3PreTrainedModel's
`_keep_in_fp32_modules_strict`.

What was changed:
  * Torch paths only: no flash-linear-attention (chunk_kda / fused_recurrent_kda /
    FusedRMSNormGated), no causal_conv1d kernels (the conv is `silu(conv1d(x)[..., :T])`, the
    torch fallback of those kernels), and no KV / conv / recurrent cache: passing a cache (or a
    padding mask that is not all ones) raises. torch_recurrent_kda is kept for reference only.
  * Every cast that upstream writes as "to float32" is here "to at least float32" (`_at_least_f32`):
    identical for bf16/f16/f32 inputs, but a float64 model stays float64 all the way, which the
    fixture script uses to measure the float32 rounding error. For that reason KimiK3RMSNorm,
    KimiK3RMSNormGated, KimiK3TopkRouter and the eager attention re-implement forward() of
    transformers' LlamaRMSNorm, Qwen3NextRMSNormGated, DeepseekV3TopkRouter and Llama's
    eager_attention_forward with only that cast changed.
  * KimiK3RMSNormGated: transformers 5.25's Qwen3NextRMSNormGated hard-codes SiLU; upstream calls
    it with activation="sigmoid", which is implemented explicitly:
    out = weight * rmsnorm(x) * sigmoid(gate).
  * KimiK3Experts subclasses transformers' DeepseekV4Experts but writes out its eager forward
    (without the `@use_experts_implementation` dispatch, whose grouped_mm path is not used here),
    with upstream's SiTU `_apply_gate`.
  * KimiK3DeltaAttention: upstream reads `config.linear_conv_kernel_dim` here and
    `config.conv_kernel_size` in KimiK3ShortConvolution; both name the config's `conv_kernel_size`
    (attribute_map). Only the full-rank output gate is supported: upstream's low-rank branch calls
    `output_gate_down(output_gate_up(x))`, the wrong order for the shapes it declares, so
    `use_full_rank_output_gate=False` raises. The per-key-channel KDA decay is computed per value
    channel upstream, so key and value heads (and head dims) must be equal: checked.
  * KimiK3GatedMLA always uses the eager attention below (with a causal additive mask).
  * Written here, not at that commit (which defines none of them; its KimiK3PreTrainedModel
    derives from an unimported `Kimi_K25PreTrainedModel`): KimiK3Config, KimiK3PreTrainedModel,
    KimiK3Model (embed_tokens -> zero-width block residual -> layers -> final attention residual
    `final_attn_residual` -> norm) and KimiK3ForCausalLM (lm_head), plus the Auto* registration.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
from transformers.models.llama.modeling_llama import LlamaRMSNorm, repeat_kv
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    """Upstream's `.to(torch.float32)` / `.float()`, except that float64 stays float64."""
    return x if x.dtype == torch.float64 else x.to(torch.float32)


# ----------------------------------------------------------------------------------------------
# Configuration (written here)
# ----------------------------------------------------------------------------------------------


class KimiK3Config(PreTrainedConfig):
    r"""Kimi K3 text model. Defaults are the full-size model: 93 blocks of width 7168, KDA (96 heads of
    128, a causal conv of 4) in every block but every 4th one (from block 3) and the last, which use
    gated MLA without RoPE (96 heads); a dense first block, then 896 routed experts (top 16) of 3072 in
    a latent width of 3584 beside 2 shared ones; SiTU activations; attention residuals over blocks of
    12 layers."""

    model_type = "kimi_k3"
    attribute_map = {
        "num_local_experts": "n_routed_experts",
        "linear_conv_kernel_dim": "conv_kernel_size",
    }

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 33792
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int | None = 96
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = False
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    # Gated MLA (no RoPE: the "rope" part of the key is shared between heads but not rotated)
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # Kimi Delta Attention
    linear_attn_key_heads: int = 96
    linear_attn_key_head_dim: int = 128
    linear_attn_value_heads: int = 96
    linear_attn_value_head_dim: int = 128
    conv_kernel_size: int = 4
    forget_gate_lower_bound: float | int | None = -5.0
    use_full_rank_output_gate: bool = True
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    # Mixture of experts
    n_routed_experts: int = 896
    num_experts_per_tok: int = 16
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float | int = 1.0
    n_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    # SiTU activation
    hidden_act: str = "situ"
    activation_situ_beta: float | int = 4.0
    activation_situ_linear_beta: float | int | None = 25.0
    # Attention residuals
    attn_res_block_size: int = 12

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types is None:
            last = self.num_hidden_layers - 1
            self.layer_types = [
                "full_attention" if i % 4 == 3 or i == last else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i == 0 else "sparse" for i in range(self.num_hidden_layers)]
        super().__post_init__(**kwargs)
        if len(self.layer_types) != self.num_hidden_layers or len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types and mlp_layer_types need one entry per hidden layer")
        if set(self.layer_types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"unknown layer_types {set(self.layer_types)}")
        if set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"unknown mlp_layer_types {set(self.mlp_layer_types)}")
        if self.hidden_act != "situ":
            raise ValueError("Kimi K3 always uses the SiTU activation (hidden_act='situ')")


# ----------------------------------------------------------------------------------------------
# Modules (from modular_kimi_k3.py at e6ffd1347cc61c22b7120d1b556101c6908ba12e)
# ----------------------------------------------------------------------------------------------


class KimiK3RMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm (weight * x / rms(x), default eps 1e-6), computed in at least float32."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = _at_least_f32(hidden_states)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class KimiK3RMSNormGated(Qwen3NextRMSNormGated):
    """Qwen3Next's gated RMSNorm (norm before gate) with upstream's activation="sigmoid":
    out = weight * rmsnorm(x) * sigmoid(gate)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, activation: str = "sigmoid", **kwargs) -> None:
        super().__init__(hidden_size, eps=eps)
        if activation != "sigmoid":
            raise ValueError("only the sigmoid gate of Kimi K3 is implemented here")
        self.activation = activation

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = _at_least_f32(hidden_states)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        # Norm before gate
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight * hidden_states.to(input_dtype)
        hidden_states = hidden_states * torch.sigmoid(_at_least_f32(gate))
        return hidden_states.to(input_dtype)


class KimiK3ShortConvolution(nn.Module):
    """Depthwise causal conv1d (no bias) followed by SiLU; weight `conv1d.weight [C, 1, K]`."""

    def __init__(
        self,
        config: KimiK3Config,
        hidden_size: int,
        conv_state_idx: int,
        layer_idx: int,
        bias: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.kernel_size = config.conv_kernel_size
        self.conv_state_idx = conv_state_idx
        self.layer_idx = layer_idx
        self.activation = activation

        self.conv1d = nn.Conv1d(
            in_channels=hidden_size,
            out_channels=hidden_size,
            groups=hidden_size,
            kernel_size=self.kernel_size,
            padding=self.kernel_size - 1,
            bias=bias,
        )

    def forward(self, input_states: torch.Tensor, use_precomputed_states: bool, seq_len: int,
                past_key_values=None, seq_idx=None) -> torch.Tensor:
        if use_precomputed_states or past_key_values is not None:
            raise NotImplementedError("this reference has no conv cache")
        if seq_idx is not None:
            raise NotImplementedError("packed sequences (seq_idx) are not supported by this reference")
        # Channel-first layout: [batch_size, hidden_size, seq_len]; the torch fallback of causal_conv1d_fn
        input_states = input_states.transpose(1, 2)
        output_states = F.silu(self.conv1d(input_states)[:, :, :seq_len])
        return output_states.transpose(1, 2)


def l2norm(x: torch.FloatTensor, dim: int = -1, eps: float = 1e-6):
    """This function is intended to align with the l2norm implementation in the FLA library."""
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def torch_chunk_kda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA (Kimi Delta Attention) gated delta rule with per-key-channel decays, chunked along the
    sequence. query/key [B, T, H, Dk], value [B, T, H, Dv], g (log-decay, <= 0) [B, T, H, Dk],
    beta [B, T, H]. Returns the output [B, T, H, Dv] and the final state [B, H, Dk, Dv] or None."""
    initial_dtype = query.dtype
    batch_size, sequence_length, num_heads, k_head_dim = key.shape
    v_head_dim = value.shape[-1]
    log_decay = g

    # Make sure all tensors are (at least) fp32 and reshape them to [batch_size, num_heads, seqlen, ...]
    query, key, value, beta, log_decay = [
        _at_least_f32(x.transpose(1, 2).contiguous()) for x in (query, key, value, beta, log_decay)
    ]
    if use_qk_l2norm_in_kernel:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    # And always normalize queries by the head dimension
    query = query / (query.shape[-1] ** 0.5)

    # Pad sequence length to be a multiple of chunk_size
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query = F.pad(query, (0, 0, 0, pad_size))
    key = F.pad(key, (0, 0, 0, pad_size))
    value = F.pad(value, (0, 0, 0, pad_size))
    beta = F.pad(beta, (0, pad_size))
    log_decay = F.pad(log_decay, (0, 0, 0, pad_size))

    total_sequence_length = sequence_length + pad_size
    num_chunks = total_sequence_length // chunk_size

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)

    query, key, value, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, value, k_beta, v_beta)
    ]
    log_decay = log_decay.reshape(log_decay.shape[0], log_decay.shape[1], -1, chunk_size, log_decay.shape[-1])

    mask = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device), diagonal=0)
    strictly_upper_mask = mask.triu(1)

    cum_log_decay = log_decay.cumsum(dim=3)
    cum_decay = cum_log_decay.exp()

    pairwise_decay_numel = batch_size * num_heads * chunk_size * chunk_size * cum_log_decay.shape[-1]
    numel_bound = 2**26
    chunks_per_group = max(1, min(num_chunks, numel_bound // pairwise_decay_numel))

    vectorized_shape = (batch_size, num_heads, num_chunks, chunk_size, chunk_size)
    ut_attn = torch.empty(vectorized_shape, dtype=value.dtype, device=value.device)
    qk_attn = torch.empty(vectorized_shape, dtype=value.dtype, device=value.device)

    for s in range(0, num_chunks, chunks_per_group):
        chunks = slice(s, s + chunks_per_group)
        group_cum_log_decay = cum_log_decay[:, :, chunks]
        pairwise_log_decay = group_cum_log_decay.unsqueeze(4) - group_cum_log_decay.unsqueeze(3)
        pairwise_log_decay = pairwise_log_decay.masked_fill(strictly_upper_mask.unsqueeze(-1), float("-inf"))
        pairwise_decay = pairwise_log_decay.exp()

        decayed_keys = key[:, :, chunks].unsqueeze(-3) * pairwise_decay
        ut_attn[:, :, chunks] = -(decayed_keys @ k_beta[:, :, chunks].unsqueeze(-1)).squeeze(-1)
        ut_attn[:, :, chunks] = ut_attn[:, :, chunks].masked_fill(mask, 0)
        qk_attn[:, :, chunks] = (decayed_keys @ query[:, :, chunks].unsqueeze(-1)).squeeze(-1)

    # UT transform: (I + L)^-1 by forward substitution
    for i in range(1, chunk_size):
        row = ut_attn[..., i, :i].clone()
        sub = ut_attn[..., :i, :i].clone()
        ut_attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    ut_attn = ut_attn + torch.eye(chunk_size, dtype=ut_attn.dtype, device=ut_attn.device)
    new_values = ut_attn @ v_beta
    k_cumdecay = ut_attn @ (k_beta * cum_decay)

    if initial_state is None:
        recurrent_state_shape = (batch_size, num_heads, k_head_dim, v_head_dim)
        last_recurrent_state = torch.zeros(recurrent_state_shape, dtype=new_values.dtype, device=new_values.device)
    else:
        last_recurrent_state = initial_state.to(new_values)
    core_attn_out = torch.zeros_like(new_values)

    for i in range(num_chunks):
        q_i, k_i, cum_log_decay_i = query[:, :, i], key[:, :, i], cum_log_decay[:, :, i]
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ last_recurrent_state
        inter_chunk_attn = (q_i * cum_decay[:, :, i]) @ last_recurrent_state
        core_attn_out[:, :, i] = inter_chunk_attn + qk_attn[:, :, i] @ v_new
        chunk_log_decay = cum_log_decay_i[:, :, -1]
        state_decay = chunk_log_decay.exp().unsqueeze(-1)
        key_decay = (chunk_log_decay.unsqueeze(2) - cum_log_decay_i).exp()
        last_recurrent_state = last_recurrent_state * state_decay + (k_i * key_decay).transpose(-1, -2) @ v_new

    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.reshape(core_attn_out.shape[0], core_attn_out.shape[1], -1, core_attn_out.shape[-1])
    core_attn_out = core_attn_out[:, :, :sequence_length]
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, last_recurrent_state


def torch_recurrent_kda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same KDA rule one token at a time (upstream uses it for decoding; kept as a cross-check)."""
    initial_dtype = query.dtype
    batch_size, sequence_length, num_heads, k_head_dim = key.shape
    v_head_dim = value.shape[-1]
    log_decay = g

    query, key, value, beta, log_decay = [
        _at_least_f32(x.transpose(1, 2).contiguous()) for x in (query, key, value, beta, log_decay)
    ]
    if use_qk_l2norm_in_kernel:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)

    query = query / (query.shape[-1] ** 0.5)

    if initial_state is None:
        recurrent_state_shape = (batch_size, num_heads, k_head_dim, v_head_dim)
        last_recurrent_state = torch.zeros(recurrent_state_shape, dtype=value.dtype, device=value.device)
    else:
        last_recurrent_state = initial_state.to(value)
    core_attn_out = torch.zeros_like(value)

    for i in range(sequence_length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        decay_t = log_decay[:, :, i].exp().unsqueeze(-1)
        last_recurrent_state = last_recurrent_state * decay_t
        beta_t = beta[:, :, i].unsqueeze(-1)
        kv_mem = (last_recurrent_state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        last_recurrent_state = last_recurrent_state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        core_attn_out[:, :, i] = (last_recurrent_state * q_t.unsqueeze(-1)).sum(dim=-2)

    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, last_recurrent_state


class KimiK3DeltaAttention(nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx

        self.hidden_size = config.hidden_size
        self.num_k_heads = config.linear_attn_key_heads
        self.head_k_dim = config.linear_attn_key_head_dim
        self.num_v_heads = config.linear_attn_value_heads
        self.head_v_dim = config.linear_attn_value_head_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        if self.num_k_heads != self.num_v_heads or self.head_k_dim != self.head_v_dim:
            # The decay g is computed per value channel but applied per key channel, and the kernel has no
            # head grouping: upstream's math only holds with equal key and value heads and head dims.
            raise ValueError("KimiK3DeltaAttention needs linear_attn_key_heads == linear_attn_value_heads and "
                             "linear_attn_key_head_dim == linear_attn_value_head_dim")

        projection_k_size = self.head_k_dim * self.num_k_heads
        projection_v_size = self.head_v_dim * self.num_v_heads

        self.q_proj = nn.Linear(self.hidden_size, projection_k_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, projection_k_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, projection_v_size, bias=False)

        self.q_conv = KimiK3ShortConvolution(config, projection_k_size, conv_state_idx=0, layer_idx=layer_idx)
        self.k_conv = KimiK3ShortConvolution(config, projection_k_size, conv_state_idx=1, layer_idx=layer_idx)
        self.v_conv = KimiK3ShortConvolution(config, projection_v_size, conv_state_idx=2, layer_idx=layer_idx)

        self.chunk_kda = torch_chunk_kda
        self.recurrent_kda = torch_recurrent_kda

        self.forget_gate_down = nn.Linear(self.hidden_size, self.head_v_dim, bias=False)
        self.forget_gate_up = nn.Linear(self.head_v_dim, projection_v_size, bias=False)
        self.beta_proj = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)

        A_log_init = torch.empty(self.num_v_heads, 1, dtype=torch.float32).uniform_(1, 16)
        self.A_log = torch.nn.Parameter(A_log_init.log())
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, self.head_v_dim, dtype=torch.float32))
        self.forget_gate_lower_bound = config.forget_gate_lower_bound

        self.use_full_rank_output_gate = config.use_full_rank_output_gate
        if not self.use_full_rank_output_gate:
            raise NotImplementedError(
                "use_full_rank_output_gate=False is not supported: at the vendored commit the low-rank output gate "
                "calls output_gate_down(output_gate_up(x)), the wrong order for its declared shapes")
        self.output_gate = nn.Linear(self.hidden_size, projection_v_size, bias=False)

        self.o_norm = KimiK3RMSNormGated(self.head_v_dim, eps=config.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(projection_v_size, self.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, past_key_values=None, attention_mask=None, **kwargs):
        if past_key_values is not None:
            raise NotImplementedError("this reference has no recurrent / conv cache")
        if attention_mask is not None:
            # Only a padding mask without padding is accepted (it would be a no-op upstream)
            if attention_mask.dim() != 2 or not bool(attention_mask.all()):
                raise NotImplementedError("padding masks are not supported by this reference")

        batch_size, seq_len = hidden_states.shape[:2]
        q_states = self.q_proj(hidden_states)
        k_states = self.k_proj(hidden_states)
        v_states = self.v_proj(hidden_states)

        q_states = self.q_conv(q_states, False, seq_len)
        k_states = self.k_conv(k_states, False, seq_len)
        v_states = self.v_conv(v_states, False, seq_len)

        key_shape = (batch_size, seq_len, self.num_k_heads, self.head_k_dim)
        value_shape = (batch_size, seq_len, self.num_v_heads, self.head_v_dim)

        q_states = q_states.view(key_shape)
        k_states = k_states.view(key_shape)
        v_states = v_states.view(value_shape)

        # The log-decay of the states ("g" in the flash-linear-attention API)
        gate = self.forget_gate_up(self.forget_gate_down(hidden_states))
        gate = gate.reshape(value_shape)
        log_decay_scale = self.A_log.exp()
        if self.forget_gate_lower_bound is not None:
            gate = self.forget_gate_lower_bound * (log_decay_scale * (gate + self.dt_bias)).sigmoid()
        else:
            gate = -log_decay_scale * F.softplus(_at_least_f32(gate) + self.dt_bias)

        beta = _at_least_f32(self.beta_proj(hidden_states)).sigmoid()

        core_attn_out, _ = self.chunk_kda(
            q_states,
            k_states,
            v_states,
            g=gate,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )

        output_gate = self.output_gate(hidden_states)
        output_gate = output_gate.reshape(value_shape)
        normed_attn_out = self.o_norm(core_attn_out, output_gate)

        normed_attn_out = normed_attn_out.reshape(batch_size, seq_len, -1)
        output = self.o_proj(normed_attn_out)
        return output, None


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Llama's eager attention; the softmax in at least float32."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)

    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask

    attn_weights = _at_least_f32(attn_weights).softmax(dim=-1).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class KimiK3GatedMLA(nn.Module):
    """Deepseek V2-style MLA with a sigmoid output gate and no RoPE (the shared key part is not rotated)."""

    is_causal: bool = True

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx

        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_dropout = config.attention_dropout

        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank

        self.k_shared_head_dim = config.qk_rope_head_dim  # no RoPE is applied but is shared between heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.k_shared_head_dim
        self.v_head_dim = config.v_head_dim

        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=config.attention_bias)
        self.q_a_layernorm = KimiK3RMSNorm(config.q_lora_rank)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)

        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.k_shared_head_dim, bias=False)
        self.kv_a_layernorm = KimiK3RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )

        self.output_gate_proj = nn.Linear(config.hidden_size, self.num_heads * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=False)
        self.scaling = self.qk_head_dim ** (-0.5)

    def expand_kv(self, kv_nope: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, seq_length, _ = kv_nope.shape
        key_shape = (batch_size, seq_length, -1, self.qk_nope_head_dim + self.v_head_dim)

        kv_nope = self.kv_b_proj(kv_nope).view(key_shape).transpose(1, 2)
        kv_nope, value_states = torch.split(kv_nope, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        k_pe = k_pe.expand(*kv_nope.shape[:-1], -1)
        key_states = torch.cat((kv_nope, k_pe), dim=-1)
        return key_states, value_states

    def forward(self, hidden_states, attention_mask, past_key_values=None, **kwargs):
        if past_key_values is not None:
            raise NotImplementedError("this reference has no KV cache")
        batch_size, seq_length = hidden_states.shape[:-1]
        query_shape = (batch_size, seq_length, -1, self.qk_head_dim)

        query_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        query_states = query_states.view(query_shape).transpose(1, 2)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_nope, k_shared = torch.split(compressed_kv, [self.kv_lora_rank, self.k_shared_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        k_shared = k_shared.view(batch_size, 1, seq_length, self.k_shared_head_dim)

        key_states, value_states = self.expand_kv(kv_nope, k_shared)

        attn_output, attn_weights = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )
        attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()

        # Divergence from Deepseek V2 MLA: an additional gate on the attention output
        gate = self.output_gate_proj(hidden_states).sigmoid()
        attn_output = attn_output * gate

        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SituAndMul: out = beta * tanh(gate / beta) * sigmoid(gate) * up, where up is first soft-capped
    to linear_beta * tanh(up / linear_beta) if linear_beta is given; in (at least) float32."""
    original_dtype = gate.dtype
    gate = _at_least_f32(gate)
    up = _at_least_f32(up)

    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)

    out = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up
    return out.to(original_dtype)


class KimiK3MLP(nn.Module):
    def __init__(self, config: KimiK3Config, intermediate_size: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.beta = config.activation_situ_beta
        self.linear_beta = config.activation_situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_and_mul(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


class KimiK3TopkRouter(DeepseekV3TopkRouter):
    """DeepseekV3TopkRouter: sigmoid scores, a balancing bias (buffer) for the choice only, group-limited
    top-k, renormalisation (+1e-20) and routed_scaling_factor. Its forward, computed in at least float32."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = F.linear(_at_least_f32(hidden_states), _at_least_f32(self.weight))
        scores = router_logits.sigmoid()
        scores_for_choice = scores + self.e_score_correction_bias
        group_scores = (
            scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.num_group, self.num_experts // self.num_group)
            .reshape(-1, self.num_experts)
        )
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        if self.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return router_logits, topk_weights, topk_indices


class KimiK3Experts(DeepseekV4Experts):
    """Expert weights stored as 3D tensors in the latent width (routed_expert_hidden_size):
    gate_up_proj [E, 2I, L], down_proj [E, L, I]; SiTU instead of SwiGLU. The forward is
    DeepseekV4Experts' eager one, written out (no experts-implementation dispatch)."""

    def __init__(self, config: KimiK3Config):
        nn.Module.__init__(self)
        self.num_experts = config.num_local_experts
        self.hidden_dim = config.routed_expert_hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.beta = config.activation_situ_beta
        self.linear_beta = config.activation_situ_linear_beta

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            current = self._apply_gate(F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]))
            current = F.linear(current, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return situ_and_mul(gate, up, self.beta, self.linear_beta)


class KimiK3MoE(DeepseekV3MoE):
    def __init__(self, config: KimiK3Config):
        # DeepseekV3MoE.__init__ with KimiK3's router, experts and (SiTU) shared experts
        nn.Module.__init__(self)
        self.config = config
        self.experts = KimiK3Experts(config)
        self.gate = KimiK3TopkRouter(config)
        self.shared_experts = KimiK3MLP(
            config=config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
        )
        self.hidden_size = config.hidden_size
        self.moe_hidden_size = config.routed_expert_hidden_size
        self.rms_norm_eps = config.rms_norm_eps
        self.routed_expert_down_proj = nn.Linear(self.hidden_size, self.moe_hidden_size, bias=False)
        self.routed_expert_norm = KimiK3RMSNorm(self.moe_hidden_size, self.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(self.moe_hidden_size, self.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        orig_shape = hidden_states.shape
        _, topk_weights, topk_indices = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])

        # Project to a smaller latent space for the experts
        hidden_states = self.routed_expert_down_proj(hidden_states)
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights)
        # Normalize inside the latent space, before leaving it
        hidden_states = self.routed_expert_norm(hidden_states)
        hidden_states = self.routed_expert_up_proj(hidden_states)
        hidden_states = hidden_states.view(*orig_shape)

        hidden_states = hidden_states + self.shared_experts(residuals)
        return hidden_states


class KimiK3DecoderLayer(nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size

        if config.layer_types[layer_idx] == "linear_attention":
            self.self_attn = KimiK3DeltaAttention(config=config, layer_idx=layer_idx)
        else:
            self.self_attn = KimiK3GatedMLA(config=config, layer_idx=layer_idx)

        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = KimiK3MoE(config)
        else:
            self.mlp = KimiK3MLP(config, intermediate_size=config.intermediate_size)

        self.input_layernorm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        self.is_start_of_residual_block = layer_idx % config.attn_res_block_size == 0
        self.pre_attn_residual = KimiK3AttentionResidual(config)
        self.post_attn_residual = KimiK3AttentionResidual(config)

    def forward(self, hidden_states, block_residual, attention_mask=None, past_key_values=None, **kwargs):
        residual = hidden_states

        # An attention-like operation over the residuals replaces the plain skip connection
        if block_residual.shape[1] > 0:
            hidden_states = self.pre_attn_residual(hidden_states, block_residual)

        # At the start of a residual block, the current residual joins the block residual
        if self.is_start_of_residual_block:
            block_residual = torch.cat([block_residual, _at_least_f32(residual.view(-1, 1, self.hidden_size))], dim=1)
            residual = None

        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
        )

        if not self.is_start_of_residual_block:
            hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = self.post_attn_residual(hidden_states, block_residual)

        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)

        hidden_states = hidden_states + residual
        return hidden_states, block_residual


class KimiK3AttentionResidual(nn.Module):
    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.config = config
        # Pseudo-queries have an output size of 1: a dot product along the hidden dim
        self.pseudo_queries = nn.Linear(config.hidden_size, 1, bias=False)
        self.attn_residual_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, block_residual: torch.Tensor) -> torch.Tensor:
        """Softmax attention, per token, over [block_residual..., hidden_states] (keys = values), with
        keys normalized by attn_residual_norm and scored by the learned pseudo-query.
        hidden_states [B, T, D], block_residual [B*T, N-1, D] -> [B, T, D]."""
        batch_size, seq_len, hidden_size = hidden_states.shape
        initial_dtype = hidden_states.dtype

        hidden_states = hidden_states.view(-1, 1, hidden_size)
        keys_or_values = torch.cat((block_residual, _at_least_f32(hidden_states)), dim=1)

        normalized_keys = self.attn_residual_norm(keys_or_values)
        scores = self.pseudo_queries(normalized_keys)  # [num_tokens, N, 1]
        probs = scores.transpose(1, 2).softmax(-1)  # [num_tokens, 1, N]
        hidden_states = torch.matmul(probs, keys_or_values)  # [num_tokens, 1, hidden_size]
        hidden_states = hidden_states.squeeze(1)

        return hidden_states.to(initial_dtype).view(batch_size, seq_len, hidden_size)


# ----------------------------------------------------------------------------------------------
# Pretrained model, model and causal LM (written here)
# ----------------------------------------------------------------------------------------------


class KimiK3PreTrainedModel(PreTrainedModel):
    config: KimiK3Config
    config_class = KimiK3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiK3DecoderLayer"]
    _supports_flash_attn = False
    _supports_sdpa = False
    _supports_flex_attn = False
    # Upstream's list at the vendored commit
    _keep_in_fp32_modules_strict = ["pseudo_queries", "attn_residual_norm"]

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KimiK3DeltaAttention):  # following FLA's (and Kimi Linear's) initialization
            init.copy_(module.A_log, init.uniform_(module.A_log, a=1.0, b=16.0).log())
            dt = init.uniform_(module.dt_bias, a=math.log(1e-3), b=math.log(1e-1)).exp().clamp(min=1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif isinstance(module, KimiK3Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KimiK3TopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)


class KimiK3Model(KimiK3PreTrainedModel):
    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.final_attn_residual = KimiK3AttentionResidual(config)
        self.norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, past_key_values=None, cache=None,
                use_cache=None, **kwargs):
        if past_key_values is not None or cache is not None or use_cache:
            raise NotImplementedError("this reference has no cache: call it with use_cache=False")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError("padding masks are not supported by this reference")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden_states = inputs_embeds
        batch_size, seq_len, hidden_size = hidden_states.shape

        # Additive causal mask for the MLA layers (what create_causal_mask gives eager attention)
        causal = torch.full((seq_len, seq_len), torch.finfo(hidden_states.dtype).min, dtype=hidden_states.dtype,
                            device=hidden_states.device).triu(1)[None, None]

        block_residual = _at_least_f32(hidden_states.new_zeros(batch_size * seq_len, 0, hidden_size))
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            mask = causal if layer_type == "full_attention" else None
            hidden_states, block_residual = layer(hidden_states, block_residual, attention_mask=mask)

        hidden_states = self.final_attn_residual(hidden_states, block_residual)
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states)


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, past_key_values=None,
                cache=None, use_cache=None, **kwargs) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                             past_key_values=past_key_values, cache=cache, use_cache=use_cache)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            vocab = logits.shape[-1]
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


AutoConfig.register("kimi_k3", KimiK3Config, exist_ok=True)
AutoModelForCausalLM.register(KimiK3Config, KimiK3ForCausalLM, exist_ok=True)

__all__ = ["KimiK3Config", "KimiK3PreTrainedModel", "KimiK3Model", "KimiK3ForCausalLM"]
