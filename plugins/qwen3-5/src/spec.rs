//! The parameters of a Qwen3.5 model, each declared once: shape, init, placement and Hugging
//! Face name together, giving the handle `model.rs` fetches it with. Also the costs.

use crate::config::{LayerType, Qwen35Args};
use crate::hf;
use anneal_plugin_api::sdk::kit::blocks::{GqaParams, Proj};
use anneal_plugin_api::sdk::vision::VisionTower;
use anneal_plugin_api::sdk::{
    Decl, HfMap, Init, LayerScope, ModelSpec, Param, ParamSpec, ParamTable,
};

/// A Gated DeltaNet token mixer.
pub struct LinearAttention {
    /// Queries, keys and values in one projection `[2·key_dim + value_dim, dim]`.
    pub in_proj_qkv: Param,
    /// The output gate `z` `[value_dim, dim]`.
    pub in_proj_z: Param,
    /// Write strength logits `[Hv, dim]` (β = sigmoid).
    pub in_proj_b: Param,
    /// Decay logits `[Hv, dim]`.
    pub in_proj_a: Param,
    /// Depthwise causal convolution `[conv_dim, 1, K]` (transformers' layout).
    pub conv1d: Param,
    /// Decay bias `[Hv]`, added before the softplus.
    pub dt_bias: Param,
    /// `log A` `[Hv]`: the decay rate is `−exp(A_log)`.
    pub a_log: Param,
    /// Gated RMSNorm weight `[Dv]`, shared by the value heads.
    pub norm: Param,
    /// Output projection `[dim, value_dim]`.
    pub out_proj: Param,
}

/// A block's token mixer.
pub enum Mixer {
    /// Gated DeltaNet.
    Linear(LinearAttention),
    /// Output-gated softmax attention: queries and their gates `[n_heads · 2 · head_dim, dim]`
    /// (per head: query, then gate), keys and values `[n_kv_heads · head_dim, dim]`, the output
    /// `[dim, n_heads · head_dim]`, zero-centred per-head RMSNorm of queries and keys.
    Full(GqaParams),
}

/// A SwiGLU feed-forward `W2 · (SiLU(W1 x) ⊙ W3 x)`.
pub struct SwiGlu {
    /// Gate `[ffn, dim]`.
    pub w1: Param,
    /// Down projection `[dim, ffn]`.
    pub w2: Param,
    /// Up projection `[ffn, dim]`.
    pub w3: Param,
}

/// A block's feed-forward.
pub enum FeedForward {
    /// One SwiGLU.
    Dense(SwiGlu),
    /// Routed SwiGLU experts plus a sigmoid-gated shared expert.
    Experts {
        /// Router `[n_experts, dim]`.
        router: Param,
        /// Gates `[n_experts, expert_ffn, dim]`.
        w1: Param,
        /// Down projections `[n_experts, dim, expert_ffn]`.
        w2: Param,
        /// Ups `[n_experts, expert_ffn, dim]`.
        w3: Param,
        /// The shared expert.
        shared: SwiGlu,
        /// The shared expert's gate `[1, dim]`.
        shared_gate: Param,
    },
}

/// The parameters of one block.
pub struct BlockParams {
    /// Zero-centred RMSNorm before the token mixer.
    pub attention_norm: Param,
    /// The token mixer.
    pub mixer: Mixer,
    /// Zero-centred RMSNorm before the feed-forward.
    pub ffn_norm: Param,
    /// The feed-forward.
    pub ffn: FeedForward,
}

/// Every parameter of the model.
pub struct Qwen35Params {
    /// Token embeddings `[vocab, dim]`.
    pub tok_embeddings: Param,
    /// The blocks.
    pub layers: Vec<BlockParams>,
    /// Final zero-centred RMSNorm.
    pub norm: Param,
    /// Output projection `[vocab, dim]` (the embedding table when tied).
    pub output: Param,
    /// The vision tower (`model.visual.*`), for a checkpoint with vision.
    pub vision: Option<VisionTower>,
}

/// Truncated-normal projections of std 0.02 (depth-scaled for the ones writing into the
/// residual stream), split for tensor parallelism along outputs (`col`) or inputs.
fn linear(
    l: &mut LayerScope<'_>,
    name: &str,
    shape: [usize; 2],
    std: f64,
    hf: &str,
    col: bool,
) -> Param {
    let decl = Decl::new(name, shape).trunc_normal(std).hf_name(hf);
    l.add(if col { decl.column() } else { decl.row() })
}

fn swiglu(
    l: &mut LayerScope<'_>,
    at: &str,
    hf: &str,
    d: usize,
    f: usize,
    std: f64,
    depth_std: f64,
) -> SwiGlu {
    SwiGlu {
        w1: linear(
            l,
            &format!("{at}.w1.weight"),
            [f, d],
            std,
            &format!("{hf}.gate_proj.weight"),
            true,
        ),
        w3: linear(
            l,
            &format!("{at}.w3.weight"),
            [f, d],
            depth_std,
            &format!("{hf}.up_proj.weight"),
            true,
        ),
        w2: linear(
            l,
            &format!("{at}.w2.weight"),
            [d, f],
            depth_std,
            &format!("{hf}.down_proj.weight"),
            false,
        ),
    }
}

fn linear_attention(
    a: &Qwen35Args,
    l: &mut LayerScope<'_>,
    std: f64,
    depth_std: f64,
) -> LinearAttention {
    let (d, hv) = (a.dim, a.linear_n_value_heads);
    let (conv, vd) = (a.conv_dim(), a.linear_value_dim());
    let mut proj = |name: &str, rows: usize, std: f64| {
        let full = format!("linear_attn.{name}.weight");
        linear(l, &full, [rows, d], std, &full, true)
    };
    let (in_proj_qkv, in_proj_z) = (proj("in_proj_qkv", conv, std), proj("in_proj_z", vd, std));
    let (in_proj_b, in_proj_a) = (proj("in_proj_b", hv, std), proj("in_proj_a", hv, std));
    let mut vector = |name: &str, n: usize, init: Init| {
        let full = format!("linear_attn.{name}");
        l.add(Decl::new(&full, [n]).init(init).hf_name(&full))
    };
    // A = exp(A_log) log-uniform in [1, 16], as FLA initializes it; softplus(a + 1) starts
    // each head's decay near e^{-A·1.3}.
    let a_log = vector(
        "A_log",
        hv,
        Init::Uniform {
            lo: 0.0,
            hi: 16f64.ln(),
        },
    );
    let dt_bias = vector("dt_bias", hv, Init::Ones);
    let norm = vector("norm.weight", a.linear_value_head_dim, Init::Ones);
    // PyTorch's Conv1d default: U(±1/sqrt(fan_in)), fan_in = kernel size for a depthwise one.
    let bound = (a.linear_conv_kernel as f64).powf(-0.5);
    let conv1d = l.add(
        Decl::new("linear_attn.conv1d.weight", [conv, 1, a.linear_conv_kernel])
            .init(Init::Uniform {
                lo: -bound,
                hi: bound,
            })
            .hf_name("linear_attn.conv1d.weight"),
    );
    let out_proj = linear(
        l,
        "linear_attn.out_proj.weight",
        [d, vd],
        depth_std,
        "linear_attn.out_proj.weight",
        false,
    );
    LinearAttention {
        in_proj_qkv,
        in_proj_z,
        in_proj_b,
        in_proj_a,
        conv1d,
        dt_bias,
        a_log,
        norm,
        out_proj,
    }
}

fn full_attention(a: &Qwen35Args, l: &mut LayerScope<'_>, std: f64, depth_std: f64) -> GqaParams {
    let (d, hd) = (a.dim, a.head_dim);
    let (q, kv) = (a.n_heads * hd, a.n_kv_heads * hd);
    let mut norm = |name: &str, hf: &str| l.add(Decl::new(name, [hd]).hf_name(hf));
    let (q_norm, k_norm) = (
        norm("attention.q_norm.weight", "self_attn.q_norm.weight"),
        norm("attention.k_norm.weight", "self_attn.k_norm.weight"),
    );
    let mut linear = |name, shape, std, hf, col| Proj::new(linear(l, name, shape, std, hf, col));
    GqaParams {
        wq: linear(
            "attention.wq.weight",
            [2 * q, d],
            std,
            "self_attn.q_proj.weight",
            true,
        ),
        wk: linear(
            "attention.wk.weight",
            [kv, d],
            std,
            "self_attn.k_proj.weight",
            true,
        ),
        wv: linear(
            "attention.wv.weight",
            [kv, d],
            std,
            "self_attn.v_proj.weight",
            true,
        ),
        wo: linear(
            "attention.wo.weight",
            [d, q],
            depth_std,
            "self_attn.o_proj.weight",
            false,
        ),
        qk_norm: Some((q_norm, k_norm)),
        sinks: None,
        gate: None,
    }
}

fn feed_forward(a: &Qwen35Args, l: &mut LayerScope<'_>, std: f64, depth_std: f64) -> FeedForward {
    let d = a.dim;
    let Some(m) = &a.moe else {
        return FeedForward::Dense(swiglu(
            l,
            "feed_forward",
            "mlp",
            d,
            a.ffn_dim,
            std,
            depth_std,
        ));
    };
    let (e, f) = (m.n_experts, m.expert_ffn_dim);
    let mut experts = |name: &str, shape: [usize; 3], std: f64, hf: &str| {
        l.add(
            Decl::new(name, shape)
                .trunc_normal(std)
                .expert_dim(0)
                .hf(HfMap::stack(hf, e)),
        )
    };
    FeedForward::Experts {
        w1: experts(
            "feed_forward.experts.w1",
            [e, f, d],
            std,
            "mlp.experts.{e}.gate_proj.weight",
        ),
        w3: experts(
            "feed_forward.experts.w3",
            [e, f, d],
            depth_std,
            "mlp.experts.{e}.up_proj.weight",
        ),
        w2: experts(
            "feed_forward.experts.w2",
            [e, d, f],
            depth_std,
            "mlp.experts.{e}.down_proj.weight",
        ),
        router: l.add(
            Decl::new("feed_forward.router.weight", [e, d])
                .trunc_normal(std)
                .replicated()
                .hf_name("mlp.gate.weight"),
        ),
        shared: swiglu(
            l,
            "feed_forward.shared_expert",
            "mlp.shared_expert",
            d,
            m.shared_ffn_dim,
            std,
            depth_std,
        ),
        shared_gate: l.add(
            Decl::new("feed_forward.shared_expert_gate.weight", [1, d])
                .trunc_normal(std)
                .replicated()
                .hf_name("mlp.shared_expert_gate.weight"),
        ),
    }
}

/// Declares every parameter: N(0, 1) embeddings, truncated-normal projections, zeros for the
/// zero-centred norms (they scale by `1 + w`), ones for the gated norm, as transformers does;
/// then the vision tower, if any.
pub fn declare(a: &Qwen35Args) -> (Qwen35Params, Vec<ParamSpec>) {
    let d = a.dim;
    let base = if a.nested() {
        "model.language_model"
    } else {
        "model"
    };
    let mut t = ParamTable::new(&a.dtype);
    let tok_embeddings = t.add(
        Decl::new("tok_embeddings.weight", [a.vocab_size, d])
            .normal(1.0)
            .vocab()
            .hf_name(&format!("{base}.embed_tokens.weight")),
    );
    let layers = (0..a.n_layers)
        .map(|i| {
            let std = 0.02;
            let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
            let mut l = t.layer(i, &format!("layers.{i}"), &format!("{base}.layers.{i}"));
            let attention_norm =
                l.add(Decl::new("attention_norm.weight", [d]).hf_name("input_layernorm.weight"));
            let ffn_norm =
                l.add(Decl::new("ffn_norm.weight", [d]).hf_name("post_attention_layernorm.weight"));
            let mixer = match a.layer_type(i) {
                LayerType::LinearAttention => {
                    Mixer::Linear(linear_attention(a, &mut l, std, depth_std))
                }
                LayerType::FullAttention => Mixer::Full(full_attention(a, &mut l, std, depth_std)),
            };
            let ffn = feed_forward(a, &mut l, std, depth_std);
            BlockParams {
                attention_norm,
                mixer,
                ffn_norm,
                ffn,
            }
        })
        .collect();
    let norm = t.add(Decl::new("norm.weight", [d]).hf_name(&format!("{base}.norm.weight")));
    let output = if a.tie_embeddings {
        tok_embeddings.clone()
    } else {
        t.add(
            Decl::new("output.weight", [a.vocab_size, d])
                .trunc_normal((d as f64).powf(-0.5))
                .column()
                .hf_name("lm_head.weight"),
        )
    };
    let vision = a
        .vision
        .as_ref()
        .map(|v| VisionTower::declare(v.vision.clone(), &mut t));
    let params = Qwen35Params {
        tok_embeddings,
        layers,
        norm,
        output,
        vision,
    };
    (params, t.into_specs())
}

/// Every parameter's spec.
pub fn params(a: &Qwen35Args) -> Vec<ParamSpec> {
    declare(a).1
}

/// Chunk length of the host's chunked delta rule.
const CHUNK: f64 = 64.0;

/// Forward FLOPs per token of one linear-attention layer's delta rule (chunked form, chunks of
/// `C` = 64), per value head with key size `Dk` and value size `Dv`:
/// - `6·Dk·Dv` for the three products with the state (`W·S`, `Q·S` and the update `Kᵀ·U`),
/// - `2·C·(3·Dk + 2·Dv)` for the products inside a chunk (`K·Kᵀ`, `Q·Kᵀ`, `T·(βK)`, `T·(βV)`
///   and the masked scores times the new values),
/// - `2·C²/3` for the triangular solve of the UT transform.
pub fn delta_rule_forward_flops(a: &Qwen35Args) -> f64 {
    let (dk, dv) = (a.linear_key_head_dim as f64, a.linear_value_head_dim as f64);
    let per_head = 6.0 * dk * dv + 2.0 * CHUNK * (3.0 * dk + 2.0 * dv) + 2.0 * CHUNK * CHUNK / 3.0;
    a.linear_n_value_heads as f64 * per_head
}

/// Parameters a token does not go through: the experts it is not routed to.
pub fn idle_params(a: &Qwen35Args) -> usize {
    a.moe.as_ref().map_or(0, |m| {
        a.n_layers * (m.n_experts - m.top_k) * 3 * a.dim * m.expert_ffn_dim
    })
}

/// The full spec: parameters, layers, KV-cache needs, FLOPs and the Hugging Face config.
///
/// Training FLOPs per token: 6 per parameter a token goes through (the embedding lookup
/// excluded unless the table is the output head too; the depthwise convolution's weights count
/// like a projection's, each used once per token; the vision tower, which runs per image patch,
/// not counted), plus per full-attention layer the scores and values at `max_seq_len`
/// (`12 · heads · head_dim · seq_len`), plus per linear-attention layer 3 × the delta rule's
/// chunked forward work ([`delta_rule_forward_flops`]; backward costs about twice the forward).
pub fn model_spec(a: &Qwen35Args, params: Vec<ParamSpec>) -> ModelSpec {
    let n: usize = params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let idle = idle_params(a);
    // The lookup is free; a tied table still costs its product as the output head.
    let lookup = if a.tie_embeddings {
        0
    } else {
        a.vocab_size * a.dim
    };
    let vision = a.vision.as_ref().map_or(0, |v| v.vision.n_params());
    let dense = (n - lookup - idle - vision) as f64;
    let full = a.count(LayerType::FullAttention) as f64;
    let linear = a.count(LayerType::LinearAttention) as f64;
    let attn = 12.0 * full * (a.n_heads * a.head_dim * a.max_seq_len) as f64;
    let delta = 3.0 * linear * delta_rule_forward_flops(a);
    ModelSpec {
        architecture: "qwen3_5".into(),
        n_layers: a.n_layers,
        vocab_size: a.vocab_size,
        max_seq_len: a.max_seq_len,
        flops_per_token: 6.0 * dense + attn + delta,
        context_flops_per_token: attn / a.max_seq_len.max(1) as f64,
        active_params: (idle > 0).then_some(n - idle),
        kv_cache: (0..a.n_layers)
            .map(|i| {
                (a.layer_type(i) == LayerType::FullAttention).then_some((a.n_kv_heads, a.head_dim))
            })
            .collect(),
        hf: Some(hf::adapter(a)),
        parallel: Default::default(),
        params,
    }
}
