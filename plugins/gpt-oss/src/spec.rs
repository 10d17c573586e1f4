//! The parameters of a gpt-oss model, each declared once with its shape, init, placement and
//! place in a Hugging Face checkpoint: transformers keeps each block's experts fused, the gate
//! and up products interleaved in one `gate_up_proj [E, D, 2F]` (`x · W` layout) with their
//! biases, and the router as a `Linear` (`[E, D]`, which we keep as `[D, E]`).

use crate::config::GptOssArgs;
use anneal_plugin_api::sdk::kit::blocks::{GqaParams, Proj};
use anneal_plugin_api::sdk::{Decl, HfMap, Init, ModelSpec, Param, ParamSpec, ParamTable};

/// The mixture of experts in one block.
pub struct ExpertParams {
    /// Router `[dim, n_experts]`.
    pub router: Param,
    /// The router's logit bias `[n_experts]`.
    pub router_bias: Param,
    /// Gates `[n_experts, dim, expert_ffn_dim]` and their biases `[n_experts, expert_ffn_dim]`.
    pub gate: (Param, Param),
    /// Ups, shaped like the gates.
    pub up: (Param, Param),
    /// Down projections `[n_experts, expert_ffn_dim, dim]`, biases `[n_experts, dim]`.
    pub down: (Param, Param),
    /// Aux-loss-free balancing bias `[n_experts]` (a buffer), when balancing is on.
    pub balance_bias: Option<Param>,
}

/// The parameters of one block.
pub struct BlockParams {
    /// RMSNorm before attention.
    pub attention_norm: Param,
    /// Attention: projections with biases (`[n_heads · head_dim, dim]` queries,
    /// `[n_kv_heads · head_dim, dim]` keys and values, `[dim, n_heads · head_dim]` output) and
    /// one learned sink logit per query head that joins the softmax without a value.
    pub attention: GqaParams,
    /// RMSNorm before the experts.
    pub ffn_norm: Param,
    /// The experts.
    pub experts: ExpertParams,
}

/// Every parameter of the model.
pub struct GptOssParams {
    /// Token embeddings `[vocab, dim]`.
    pub tok_embeddings: Param,
    /// The blocks.
    pub layers: Vec<BlockParams>,
    /// Final RMSNorm.
    pub norm: Param,
    /// Output projection `[vocab, dim]` (the embedding table when tied).
    pub output: Param,
}

/// Declares every parameter: N(0,1) embeddings, truncated normal projections (depth-scaled for
/// those writing into the residual stream), zero biases, ones for norms.
pub fn declare(a: &GptOssArgs) -> (GptOssParams, Vec<ParamSpec>) {
    let (d, hd, e, f) = (a.dim, a.head_dim, a.n_experts, a.expert_ffn_dim);
    let (q_dim, kv_dim) = (a.n_heads * hd, a.n_kv_heads * hd);
    let mut t = ParamTable::new(&a.dtype);
    let tok_embeddings = t.token_embedding(a.vocab_size, d);
    let layers = (0..a.n_layers)
        .map(|i| {
            let std = 0.02;
            let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
            let mut l = t.layer(i, &format!("layers.{i}"), &format!("model.layers.{i}"));
            let mut norm = |name: &str, hf: &str| l.add(Decl::new(name, [d]).ones().hf_name(hf));
            let attention_norm = norm("attention_norm.weight", "input_layernorm.weight");
            let ffn_norm = norm("ffn_norm.weight", "post_attention_layernorm.weight");
            let mut linear = |name: &str, shape: [usize; 2], std: f64, hf: &str, col: bool| {
                let w = Decl::new(&format!("attention.{name}.weight"), shape)
                    .trunc_normal(std)
                    .hf_name(&format!("self_attn.{hf}.weight"));
                let b = Decl::new(&format!("attention.{name}.bias"), [shape[0]])
                    .init(Init::Zeros)
                    .hf_name(&format!("self_attn.{hf}.bias"));
                // A row-parallel product's bias is added once, after the reduction: kept whole.
                let (w, b) = if col {
                    (w.column(), b.column())
                } else {
                    (w.row(), b)
                };
                Proj {
                    weight: l.add(w),
                    bias: Some(l.add(b)),
                }
            };
            let attention = GqaParams {
                wq: linear("wq", [q_dim, d], std, "q_proj", true),
                wk: linear("wk", [kv_dim, d], std, "k_proj", true),
                wv: linear("wv", [kv_dim, d], std, "v_proj", true),
                wo: linear("wo", [d, q_dim], depth_std, "o_proj", false),
                qk_norm: None,
                gate: None,
                sinks: Some(
                    l.add(
                        Decl::new("attention.sinks", [a.n_heads])
                            .trunc_normal(std)
                            .hf_name("self_attn.sinks"),
                    ),
                ),
            };
            // Gate and up alternate along the last dim of the fused tensor.
            let fused = |index: usize, bias: bool| {
                let (name, dim) = if bias {
                    ("mlp.experts.gate_up_proj_bias", 1)
                } else {
                    ("mlp.experts.gate_up_proj", 2)
                };
                HfMap::one(name).part(dim, index, 2, true)
            };
            let mut expert = |name: &str, shape: Vec<usize>, std: Option<f64>, hf: HfMap| {
                let decl = Decl::new(name, shape).expert_dim(0).hf(hf);
                l.add(match std {
                    Some(std) => decl.trunc_normal(std),
                    None => decl.init(Init::Zeros),
                })
            };
            let down = |bias: bool| {
                HfMap::one(if bias {
                    "mlp.experts.down_proj_bias"
                } else {
                    "mlp.experts.down_proj"
                })
            };
            let experts = ExpertParams {
                gate: (
                    expert(
                        "feed_forward.experts.w1",
                        vec![e, d, f],
                        Some(std),
                        fused(0, false),
                    ),
                    expert(
                        "feed_forward.experts.w1_bias",
                        vec![e, f],
                        None,
                        fused(0, true),
                    ),
                ),
                up: (
                    expert(
                        "feed_forward.experts.w3",
                        vec![e, d, f],
                        Some(depth_std),
                        fused(1, false),
                    ),
                    expert(
                        "feed_forward.experts.w3_bias",
                        vec![e, f],
                        None,
                        fused(1, true),
                    ),
                ),
                down: (
                    expert(
                        "feed_forward.experts.w2",
                        vec![e, f, d],
                        Some(depth_std),
                        down(false),
                    ),
                    expert("feed_forward.experts.w2_bias", vec![e, d], None, down(true)),
                ),
                router: l.add(
                    Decl::new("feed_forward.router.weight", [d, e])
                        .trunc_normal(std)
                        .replicated()
                        .hf(HfMap::one("mlp.router.weight").transpose(0, 1)),
                ),
                router_bias: l.add(
                    Decl::new("feed_forward.router.bias", [e])
                        .init(Init::Zeros)
                        .replicated()
                        .hf_name("mlp.router.bias"),
                ),
                // Named as DeepSeek-V3 names the same bias in its checkpoints.
                balance_bias: (a.balance_rate > 0.0).then(|| {
                    l.add(
                        Decl::new("feed_forward.router.balance_bias", [e])
                            .init(Init::Zeros)
                            .buffer()
                            .hf_name("mlp.router.e_score_correction_bias"),
                    )
                }),
            };
            BlockParams {
                attention_norm,
                attention,
                ffn_norm,
                experts,
            }
        })
        .collect();
    let (norm, output) =
        t.final_norm_and_output(a.vocab_size, d, a.tie_embeddings.then_some(&tok_embeddings));
    let params = GptOssParams {
        tok_embeddings,
        layers,
        norm,
        output,
    };
    (params, t.into_specs())
}

/// Every parameter's spec.
pub fn params(a: &GptOssArgs) -> Vec<ParamSpec> {
    declare(a).1
}

/// The full spec: parameters, layers, KV-cache needs, FLOPs and the Hugging Face config.
pub fn model_spec(a: &GptOssArgs, params: Vec<ParamSpec>) -> ModelSpec {
    let n: usize = params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let embedding = a.vocab_size * a.dim;
    // 6 FLOPs per parameter per token (forward + backward) for the products a token goes
    // through (of the experts, only its top-k), plus attention scores and values over the
    // keys a query sees (the window in sliding layers).
    let idle_experts = a.n_layers * (a.n_experts - a.top_k) * 3 * a.dim * a.expert_ffn_dim;
    let dense = (n - embedding - idle_experts) as f64;
    let attn: usize = (0..a.n_layers)
        .map(|i| {
            let keys = a
                .window_of(i)
                .map_or(a.max_seq_len, |w| w.min(a.max_seq_len));
            12 * a.n_heads * a.head_dim * keys
        })
        .sum();
    ModelSpec {
        architecture: "gpt_oss".into(),
        n_layers: a.n_layers,
        vocab_size: a.vocab_size,
        max_seq_len: a.max_seq_len,
        flops_per_token: 6.0 * dense + attn as f64,
        // Only the layers without a window attend to the whole context.
        context_flops_per_token: (0..a.n_layers)
            .filter(|&i| a.window_of(i).is_none())
            .map(|_| (12 * a.n_heads * a.head_dim) as f64)
            .sum(),
        active_params: Some(n - idle_experts),
        kv_cache: vec![Some((a.n_kv_heads, a.head_dim)); a.n_layers],
        hf: Some(crate::hf::adapter(a)),
        parallel: Default::default(),
        params,
    }
}
