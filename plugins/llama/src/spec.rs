//! The parameters of a Llama model, each declared once: shape, init, placement and Hugging
//! Face name together, giving the handle `model.rs` fetches it with. Also the costs.

use crate::config::LlamaArgs;
use crate::hf;
use anneal_plugin_api::sdk::kit::blocks::{GqaParams, Proj};
use anneal_plugin_api::sdk::{
    Decl, HfMap, Init, ModelSpec, ParallelSupport, Param, ParamSpec, ParamTable,
};

/// The parameters of one block.
pub struct BlockParams {
    /// RMSNorm before attention.
    pub attention_norm: Param,
    /// Grouped-query attention: projections `[n_heads · head_dim, dim]` (queries),
    /// `[n_kv_heads · head_dim, dim]` (keys, values), `[dim, n_heads · head_dim]` (output), and
    /// Qwen3's per-head RMSNorm of queries and keys.
    pub attention: GqaParams,
    /// RMSNorm before the feed-forward.
    pub ffn_norm: Param,
    /// The feed-forward's weights.
    pub ffn: FeedForward,
}

/// A block's feed-forward: one SwiGLU, or a mixture of SwiGLU experts.
pub enum FeedForward {
    /// `W2 · (SiLU(W1 x) ⊙ W3 x)`.
    Dense {
        /// Gate `[ffn_dim, dim]`.
        w1: Param,
        /// Down projection `[dim, ffn_dim]`.
        w2: Param,
        /// Up projection `[ffn_dim, dim]`.
        w3: Param,
    },
    /// Top-k routed experts (Qwen3-MoE), stacked along a leading expert dim.
    Experts {
        /// Router `[n_experts, dim]`.
        router: Param,
        /// Gates `[n_experts, expert_ffn_dim, dim]`.
        w1: Param,
        /// Down projections `[n_experts, dim, expert_ffn_dim]`.
        w2: Param,
        /// Ups `[n_experts, expert_ffn_dim, dim]`.
        w3: Param,
        /// Aux-loss-free balancing bias `[n_experts]` (a buffer), when balancing is on.
        balance_bias: Option<Param>,
    },
}

/// Every parameter of the model.
pub struct LlamaParams {
    /// Token embeddings `[vocab, dim]`.
    pub tok_embeddings: Param,
    /// The blocks.
    pub layers: Vec<BlockParams>,
    /// Final RMSNorm.
    pub norm: Param,
    /// Output projection `[vocab, dim]` (the embedding table when tied).
    pub output: Param,
    /// Qwen3-VL's vision tower.
    pub vision: Option<anneal_plugin_api::sdk::vision::VisionTower>,
}

/// Declares every parameter, TorchTitan-style: N(0,1) embeddings, truncated normal
/// projections (depth-scaled for the ones writing into the residual stream), ones for norms.
pub fn declare(a: &LlamaArgs) -> (LlamaParams, Vec<ParamSpec>) {
    let (d, hd, f) = (a.dim, a.head_dim(), a.ffn_dim);
    let (q_dim, kv_dim) = (a.n_heads * hd, a.n_kv_heads * hd);
    let mut t = ParamTable::new(&a.dtype);
    let tok_embeddings = t.token_embedding(a.vocab_size, d);
    let layers = (0..a.n_layers)
        .map(|i| {
            let std = 0.02;
            let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
            let mut l = t.layer(i, &format!("layers.{i}"), &format!("model.layers.{i}"));
            let mut norm =
                |name: &str, n: usize, hf: &str| l.add(Decl::new(name, [n]).ones().hf_name(hf));
            let attention_norm = norm("attention_norm.weight", d, "input_layernorm.weight");
            let ffn_norm = norm("ffn_norm.weight", d, "post_attention_layernorm.weight");
            let qk_norm = a.qk_norm.then(|| {
                let mut head_norm = |name: &str, hf: &str| {
                    l.add(Decl::new(name, [hd]).ones().per_head().hf_name(hf))
                };
                (
                    head_norm("attention.q_norm.weight", "self_attn.q_norm.weight"),
                    head_norm("attention.k_norm.weight", "self_attn.k_norm.weight"),
                )
            });
            let mut linear = |name: &str, shape: [usize; 2], std: f64, hf: &str, col: bool| {
                let decl = Decl::new(name, shape).trunc_normal(std).hf_name(hf);
                l.add(if col { decl.column() } else { decl.row() })
            };
            BlockParams {
                attention: GqaParams {
                    wq: Proj::new(linear(
                        "attention.wq.weight",
                        [q_dim, d],
                        std,
                        "self_attn.q_proj.weight",
                        true,
                    )),
                    wk: Proj::new(linear(
                        "attention.wk.weight",
                        [kv_dim, d],
                        std,
                        "self_attn.k_proj.weight",
                        true,
                    )),
                    wv: Proj::new(linear(
                        "attention.wv.weight",
                        [kv_dim, d],
                        std,
                        "self_attn.v_proj.weight",
                        true,
                    )),
                    wo: Proj::new(linear(
                        "attention.wo.weight",
                        [d, q_dim],
                        depth_std,
                        "self_attn.o_proj.weight",
                        false,
                    )),
                    qk_norm,
                    sinks: None,
                    gate: None,
                },
                ffn: match a.moe_of(i) {
                    None => FeedForward::Dense {
                        w1: linear(
                            "feed_forward.w1.weight",
                            [f, d],
                            std,
                            "mlp.gate_proj.weight",
                            true,
                        ),
                        w3: linear(
                            "feed_forward.w3.weight",
                            [f, d],
                            depth_std,
                            "mlp.up_proj.weight",
                            true,
                        ),
                        w2: linear(
                            "feed_forward.w2.weight",
                            [d, f],
                            depth_std,
                            "mlp.down_proj.weight",
                            false,
                        ),
                    },
                    Some(m) => {
                        let (e, ef) = (m.n_experts, m.expert_ffn_dim);
                        let names = ExpertNames::of(&a.hf_model_type);
                        // Stacked `[expert, out, in]` linears: tensor parallelism splits each
                        // expert's gate / up by outputs and its down by inputs.
                        let mut experts =
                            |name: &str, shape: [usize; 3], std: f64, hf: HfMap, col: bool| {
                                let decl = Decl::new(name, shape)
                                    .trunc_normal(std)
                                    .expert_dim(0)
                                    .hf(hf);
                                l.add(if col { decl.column() } else { decl.row() })
                            };
                        FeedForward::Experts {
                            w1: experts(
                                "feed_forward.experts.w1",
                                [e, ef, d],
                                std,
                                names.expert(0, e),
                                true,
                            ),
                            w3: experts(
                                "feed_forward.experts.w3",
                                [e, ef, d],
                                depth_std,
                                names.expert(1, e),
                                true,
                            ),
                            w2: experts(
                                "feed_forward.experts.w2",
                                [e, d, ef],
                                depth_std,
                                names.expert(2, e),
                                false,
                            ),
                            router: l.add(
                                Decl::new("feed_forward.router.weight", [e, d])
                                    .trunc_normal(std)
                                    .replicated()
                                    .hf_name(names.router),
                            ),
                            // Named as DeepSeek-V3 names the same bias in its checkpoints.
                            balance_bias: (m.balance_rate > 0.0).then(|| {
                                l.add(
                                    Decl::new("feed_forward.router.balance_bias", [e])
                                        .init(Init::Zeros)
                                        .buffer()
                                        .hf_name(names.balance_bias),
                                )
                            }),
                        }
                    }
                },
                attention_norm,
                ffn_norm,
            }
        })
        .collect();
    let (norm, output) =
        t.final_norm_and_output(a.vocab_size, d, a.tie_embeddings.then_some(&tok_embeddings));
    let vision = a
        .vision
        .as_ref()
        .map(|v| anneal_plugin_api::sdk::vision::VisionTower::declare(v.vision.clone(), &mut t));
    let params = LlamaParams {
        tok_embeddings,
        layers,
        norm,
        output,
        vision,
    };
    let mut specs = t.into_specs();
    if a.vision.is_some() {
        crate::vl::text_under_language_model(&mut specs);
    }
    (params, specs)
}

/// Where a model type keeps its router and experts in a Hugging Face checkpoint: one tensor
/// per expert (`{e}`: the expert's index) of gate, up and down, or (`fused`) all experts in two
/// tensors, `gate_up_proj [E, 2·F, D]` (gate rows, then up rows) and `down_proj [E, D, F]`, as
/// transformers 5 keeps Qwen3-VL-MoE's.
struct ExpertNames {
    router: &'static str,
    balance_bias: &'static str,
    per_expert: [&'static str; 3],
    fused: bool,
}

impl ExpertNames {
    fn of(model_type: &str) -> ExpertNames {
        match model_type {
            "mixtral" => ExpertNames {
                router: "block_sparse_moe.gate.weight",
                balance_bias: "block_sparse_moe.gate.e_score_correction_bias",
                per_expert: [
                    "block_sparse_moe.experts.{e}.w1.weight",
                    "block_sparse_moe.experts.{e}.w3.weight",
                    "block_sparse_moe.experts.{e}.w2.weight",
                ],
                fused: false,
            },
            other => ExpertNames {
                router: "mlp.gate.weight",
                balance_bias: "mlp.gate.e_score_correction_bias",
                per_expert: [
                    "mlp.experts.{e}.gate_proj.weight",
                    "mlp.experts.{e}.up_proj.weight",
                    "mlp.experts.{e}.down_proj.weight",
                ],
                fused: other == "qwen3_vl_moe",
            },
        }
    }

    /// The stacked gate (`which` 0), up (1) or down (2) projections of `n` experts.
    fn expert(&self, which: usize, n: usize) -> HfMap {
        match (self.fused, which) {
            (false, _) => HfMap::stack(self.per_expert[which], n),
            (true, 2) => HfMap::one("mlp.experts.down_proj"),
            (true, part) => HfMap::one("mlp.experts.gate_up_proj").part(1, part, 2, false),
        }
    }
}

/// Every parameter's spec.
pub fn params(a: &LlamaArgs) -> Vec<ParamSpec> {
    declare(a).1
}

/// The full spec: parameters, layers, KV-cache needs, FLOPs and the Hugging Face config.
pub fn model_spec(a: &LlamaArgs, params: Vec<ParamSpec>) -> ModelSpec {
    let n: usize = params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let embedding = a.vocab_size * a.dim;
    // 6 FLOPs per parameter per token (forward + backward) for the matmuls a token goes through
    // (of a sparse layer's experts, only the top-k it is routed to), plus attention scores and
    // values: 12 · layers · heads · head_dim · seq_len.
    let idle_experts: usize = (0..a.n_layers)
        .filter_map(|i| a.moe_of(i))
        .map(|m| (m.n_experts - m.top_k) * 3 * a.dim * m.expert_ffn_dim)
        .sum();
    // The vision tower runs per image patch, not per text token.
    let vision = a.vision.as_ref().map_or(0, |v| v.vision.n_params());
    let dense = (n - embedding - idle_experts - vision) as f64;
    let attn = 12.0 * (a.n_layers * a.n_heads * a.head_dim() * a.max_seq_len) as f64;
    ModelSpec {
        architecture: "llama".into(),
        n_layers: a.n_layers,
        vocab_size: a.vocab_size,
        max_seq_len: a.max_seq_len,
        flops_per_token: 6.0 * dense + attn,
        context_flops_per_token: attn / a.max_seq_len.max(1) as f64,
        active_params: (idle_experts > 0).then_some(n - idle_experts),
        kv_cache: vec![Some((a.n_kv_heads, a.head_dim())); a.n_layers],
        hf: Some(hf::adapter(a)),
        params,
        // Checked to run on a rank's share of the heads and widths: the Llama 3 family, dense
        // Qwen3 (per-head q/k norms) and Qwen3-MoE (routed experts without biases).
        parallel: ParallelSupport {
            tensor: matches!(a.hf_model_type.as_str(), "llama" | "qwen3" | "qwen3_moe"),
            ..Default::default()
        },
    }
}
