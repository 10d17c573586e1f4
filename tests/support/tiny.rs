//! The `[model] args` of each family's tiny test model (inline TOML tables for
//! [`crate::cli::Job::config_with_model`]), shared by the tests that train them on the CPU and
//! on a GPU.

/// gpt-oss: GQA with sinks, a sliding window, MoE with a balancing bias.
pub const GPT_OSS: &str =
    "{ dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 1, head_dim = 16, vocab_size = 320, \
     max_seq_len = 64, sliding_window = 8, n_experts = 4, expert_ffn_dim = 16, \
     balance_rate = 0.01 }";

/// DeepSeek-V3: latent attention, one dense block, grouped routing, multi-token prediction.
pub const DEEPSEEK_V3: &str =
    "{ dim = 32, n_layers = 2, n_heads = 2, vocab_size = 320, max_seq_len = 64, \
     q_lora_rank = 16, kv_lora_rank = 8, qk_nope_head_dim = 8, qk_rope_head_dim = 4, \
     v_head_dim = 8, ffn_dim = 64, first_k_dense = 1, n_experts = 4, top_k = 2, \
     expert_ffn_dim = 16, n_group = 2, topk_group = 1, mtp_layers = 1, balance_rate = 0.01 }";

/// DeepSeek-V4: compressed sparse and heavily compressed attention, MoE.
pub const DEEPSEEK_V4: &str =
    "{ dim = 32, n_heads = 2, head_dim = 16, rope_head_dim = 8, q_lora_rank = 16, \
     o_groups = 2, o_lora_rank = 16, index_n_heads = 2, index_head_dim = 8, \
     index_topk = 3, csa_rate = 2, hca_rate = 4, sliding_window = 6, n_experts = 4, \
     top_k = 2, expert_ffn_dim = 32, vocab_size = 320, max_seq_len = 64 }";

/// Qwen3.5: Gated DeltaNet layers beside gated attention.
pub const QWEN3_5: &str =
    "{ dim = 32, n_layers = 4, n_heads = 2, n_kv_heads = 1, head_dim = 16, ffn_dim = 64, \
     linear_n_key_heads = 1, linear_n_value_heads = 2, linear_key_head_dim = 16, \
     linear_value_head_dim = 16, vocab_size = 320, max_seq_len = 64 }";

/// Kimi Linear (the `deepseek_v3` plugin, flavor `kimi_linear_debug`): Kimi Delta Attention in
/// layer 0, MLA without RoPE.
pub const KIMI_LINEAR: &str =
    "{ dim = 32, n_layers = 2, n_heads = 2, vocab_size = 320, max_seq_len = 64, \
     kv_lora_rank = 8, qk_nope_head_dim = 8, qk_rope_head_dim = 4, v_head_dim = 8, \
     ffn_dim = 64, n_experts = 4, top_k = 2, expert_ffn_dim = 16, \
     kda = { n_heads = 2, head_dim = 16, conv_kernel = 4, layers = [0] } }";

/// A tiny Kimi K3 as a TOML `[model] args` table (plugin `kimi_k3`, flavor `debugmodel`): KDA
/// (2 heads of 16) in blocks 0 and 2, gated MLA (2 heads) in block 1, residual blocks of 2,
/// block 0 dense, then 4 experts of 16 (top 2) in a 16-wide latent plus a shared one.
pub const KIMI_K3: &str = "{ dim = 32, n_layers = 3, vocab_size = 320, max_seq_len = 64, ffn_dim = 64, \
     attn_res_block = 2, layer_types = [\"linear_attention\", \"full_attention\", \"linear_attention\"], \
     mlp_layer_types = [\"dense\", \"sparse\", \"sparse\"], n_heads = 2, q_lora_rank = 16, \
     kv_lora_rank = 8, qk_nope_head_dim = 8, qk_rope_head_dim = 4, v_head_dim = 8, \
     kda_heads = 2, kda_head_dim = 16, n_experts = 4, top_k = 2, expert_ffn_dim = 16, latent_dim = 16 }";
