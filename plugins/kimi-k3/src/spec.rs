//! Kimi K3's parameters, each declared once with its shape, init, placement and name in a
//! transformers checkpoint, and the model's costs.

use crate::config::KimiK3Args;
use anneal_plugin_api::sdk::kit::kda::{self, KdaHfNames, KdaParams};
use anneal_plugin_api::sdk::kit::mla::{self, MlaParams};
use anneal_plugin_api::sdk::{
    Decl, HfMap, Init, LayerScope, ModelSpec, ParallelSupport, Param, ParamSpec, ParamTable,
};

/// A block's token mixer.
pub enum Mixer {
    /// Kimi Delta Attention.
    Kda(KdaParams),
    /// Gated multi-head latent attention without RoPE.
    Mla(MlaParams),
}

/// Attention over the residual bank: a pseudo-query scores each RMS-normed entry.
pub struct ResidualMix {
    /// The pseudo-query `[1, dim]`.
    pub query: Param,
    /// The keys' RMSNorm gain `[dim]`.
    pub norm: Param,
}

/// Kimi K3's sparse feed-forward: a sigmoid router on the block's input, the routed experts in
/// a latent width between two projections (the weighted sum normed there), shared experts on
/// the input.
pub struct LatentMoe {
    /// Router `[n_experts, dim]`.
    pub router: Param,
    /// The routing bias that steers the choice only `[n_experts]` (a buffer).
    pub bias: Param,
    /// `[latent, dim]`.
    pub down_proj: Param,
    /// Gates and ups `[n_experts, expert_ffn, latent]` (halves of `gate_up_proj`).
    pub gate: Param,
    /// See `gate`.
    pub up: Param,
    /// Down projections `[n_experts, latent, expert_ffn]`.
    pub down: Param,
    /// RMSNorm of the experts' weighted sum `[latent]`.
    pub norm: Param,
    /// `[dim, latent]`.
    pub up_proj: Param,
    /// The shared experts as one SiTU-GLU `[gate, up, down]`, when there are any.
    pub shared: Option<[Param; 3]>,
}

/// A block's feed-forward.
pub enum FeedForward {
    /// SiTU-GLU gate, up and down projections.
    Dense([Param; 3]),
    /// The latent mixture of experts.
    Latent(LatentMoe),
}

/// The parameters of one block.
pub struct BlockParams {
    /// RMSNorm before the mixer.
    pub attention_norm: Param,
    /// KDA or MLA.
    pub mixer: Mixer,
    /// RMSNorm before the feed-forward.
    pub ffn_norm: Param,
    /// The feed-forward.
    pub ffn: FeedForward,
    /// The residual mix before the mixer.
    pub pre_mix: ResidualMix,
    /// The residual mix before the feed-forward.
    pub post_mix: ResidualMix,
}

/// Every parameter of the model.
pub struct KimiK3Params {
    /// Token embeddings `[vocab, dim]`.
    pub tok_embeddings: Param,
    /// The blocks.
    pub layers: Vec<BlockParams>,
    /// The residual mix after the last block.
    pub final_mix: ResidualMix,
    /// Final RMSNorm.
    pub norm: Param,
    /// Output projection `[vocab, dim]` (the embedding table when tied).
    pub output: Param,
}

/// Declares every parameter: N(0,1) embeddings, truncated normal projections (depth-scaled
/// for those writing into the residual stream), ones for norms, zero pseudo-queries (each mix
/// starts as the mean of what it mixes), a zero routing bias.
pub fn declare(a: &KimiK3Args) -> (KimiK3Params, Vec<ParamSpec>) {
    let d = a.dim;
    let mut t = ParamTable::new(&a.dtype);
    let tok_embeddings = t.token_embedding(a.vocab_size, d);
    let layers = (0..a.n_layers)
        .map(|i| {
            let mut l = t.layer(i, &format!("layers.{i}"), &format!("model.layers.{i}"));
            declare_block(&mut l, a, i)
        })
        .collect();
    let [query, norm] = mix_decls(d, "final_mix", "model.final_attn_residual");
    let final_mix = ResidualMix {
        query: t.add(query),
        norm: t.add(norm),
    };
    let (norm, output) =
        t.final_norm_and_output(a.vocab_size, d, a.tie_embeddings.then_some(&tok_embeddings));
    let params = KimiK3Params {
        tok_embeddings,
        layers,
        final_mix,
        norm,
        output,
    };
    (params, t.into_specs())
}

/// A residual mix's pseudo-query and norm under `name` (Hugging Face `hf`).
fn mix_decls(d: usize, name: &str, hf: &str) -> [Decl; 2] {
    [
        Decl::new(&format!("{name}.query.weight"), [1, d])
            .init(Init::Zeros)
            .replicated()
            .hf_name(&format!("{hf}.pseudo_queries.weight")),
        Decl::new(&format!("{name}.norm.weight"), [d])
            .ones()
            .hf_name(&format!("{hf}.attn_residual_norm.weight")),
    ]
}

/// A residual mix in block scope `l`.
fn declare_mix(l: &mut LayerScope, d: usize, name: &str, hf: &str) -> ResidualMix {
    let [query, norm] = mix_decls(d, name, hf);
    ResidualMix {
        query: l.add(query),
        norm: l.add(norm),
    }
}

/// Declares block `i` in its scope `l`.
fn declare_block(l: &mut LayerScope, a: &KimiK3Args, i: usize) -> BlockParams {
    let d = a.dim;
    let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
    let mut norm = |name: &str, hf: &str| l.add(Decl::new(name, [d]).ones().hf_name(hf));
    let attention_norm = norm("attention_norm.weight", "input_layernorm.weight");
    let ffn_norm = norm("ffn_norm.weight", "post_attention_layernorm.weight");
    let mixer = if a.is_kda(i) {
        let (h, hd) = (a.kda_heads, a.kda_head_dim);
        let names = KdaHfNames {
            conv: "{p}_conv.conv1d.weight",
            forget: ["forget_gate_down", "forget_gate_up"],
            beta: "beta_proj",
            out_gate: &["output_gate"],
            a_log_shape: &[h, 1],
            dt_bias_shape: &[h, hd],
        };
        Mixer::Kda(kda::declare(l, d, &a.kda_shape(), &names, depth_std))
    } else {
        Mixer::Mla(mla::declare(l, d, &a.mla_shape(), true, depth_std))
    };
    let ffn = if a.is_sparse(i) {
        FeedForward::Latent(declare_experts(l, a, depth_std))
    } else {
        FeedForward::Dense(declare_situ_glu(
            l,
            d,
            a.ffn_dim,
            "feed_forward",
            "mlp",
            depth_std,
        ))
    };
    BlockParams {
        attention_norm,
        mixer,
        ffn_norm,
        ffn,
        pre_mix: declare_mix(l, d, "pre_mix", "pre_attn_residual"),
        post_mix: declare_mix(l, d, "post_mix", "post_attn_residual"),
    }
}

/// A SiTU-GLU's gate, up and down projections (`[f, d]`, `[f, d]`, `[d, f]`) under `name`
/// (Hugging Face `hf`'s `gate_proj`, `up_proj`, `down_proj`).
fn declare_situ_glu(
    l: &mut LayerScope,
    d: usize,
    f: usize,
    name: &str,
    hf: &str,
    depth_std: f64,
) -> [Param; 3] {
    let mut linear = |part: &str, hf_part: &str, shape: [usize; 2], std: f64, col: bool| {
        let decl = Decl::new(&format!("{name}.{part}.weight"), shape)
            .trunc_normal(std)
            .hf_name(&format!("{hf}.{hf_part}.weight"));
        l.add(if col { decl.column() } else { decl.row() })
    };
    [
        linear("w1", "gate_proj", [f, d], 0.02, true),
        linear("w3", "up_proj", [f, d], depth_std, true),
        linear("w2", "down_proj", [d, f], depth_std, false),
    ]
}

/// A sparse block's experts under `mlp.`: stacked `[n_experts, ..]` with `expert_dim` 0, the
/// gates and ups the halves of transformers' fused `gate_up_proj`.
fn declare_experts(l: &mut LayerScope, a: &KimiK3Args, depth_std: f64) -> LatentMoe {
    let (d, e, f, m) = (a.dim, a.n_experts, a.expert_ffn_dim, a.latent_dim);
    let std = 0.02;
    let shared = (a.n_shared_experts > 0).then(|| {
        let f = a.n_shared_experts * f;
        declare_situ_glu(l, d, f, "moe.shared", "mlp.shared_experts", depth_std)
    });
    let mut add = |d: Decl| l.add(d);
    let stacked = |name: &str, shape: [usize; 3], std: f64, hf: HfMap| {
        Decl::new(name, shape)
            .trunc_normal(std)
            .expert_dim(0)
            .hf(hf)
    };
    let fused = |part| HfMap::one("mlp.experts.gate_up_proj").part(1, part, 2, false);
    let replicated = |name: &str, shape: [usize; 2], std: f64, hf: &str| {
        Decl::new(name, shape)
            .trunc_normal(std)
            .replicated()
            .hf_name(hf)
    };
    LatentMoe {
        router: add(replicated(
            "moe.router.weight",
            [e, d],
            std,
            "mlp.gate.weight",
        )),
        bias: add(Decl::new("moe.router.bias", [e])
            .init(Init::Zeros)
            .buffer()
            .hf_name("mlp.gate.e_score_correction_bias")),
        down_proj: add(replicated(
            "moe.down_proj.weight",
            [m, d],
            std,
            "mlp.routed_expert_down_proj.weight",
        )),
        gate: add(stacked("moe.gate", [e, f, m], std, fused(0))),
        up: add(stacked("moe.up", [e, f, m], std, fused(1))),
        down: add(stacked(
            "moe.down",
            [e, m, f],
            depth_std,
            HfMap::one("mlp.experts.down_proj"),
        )),
        norm: add(Decl::new("moe.norm.weight", [m])
            .ones()
            .replicated()
            .hf_name("mlp.routed_expert_norm.weight")),
        up_proj: add(replicated(
            "moe.up_proj.weight",
            [d, m],
            depth_std,
            "mlp.routed_expert_up_proj.weight",
        )),
        shared,
    }
}

/// Every parameter's spec.
pub fn params(a: &KimiK3Args) -> Vec<ParamSpec> {
    declare(a).1
}

/// Parameters a token does not go through: the routed experts it is not sent to.
pub fn idle_params(a: &KimiK3Args) -> usize {
    let sparse = (0..a.n_layers).filter(|&i| a.is_sparse(i)).count();
    sparse * (a.n_experts - a.top_k) * 3 * a.latent_dim * a.expert_ffn_dim
}

/// The full spec: parameters, KV-cache needs, FLOPs and the Hugging Face config.
pub fn model_spec(a: &KimiK3Args, params: Vec<ParamSpec>) -> ModelSpec {
    let n: usize = params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let embedding = a.vocab_size * a.dim;
    // 6 FLOPs per parameter per token for the products a token goes through (of the routed
    // experts, only its top-k), plus MLA's scores and values over the sequence and KDA's
    // chunked delta rule.
    let dense = (n - embedding - idle_params(a)) as f64;
    let kda_layers = (0..a.n_layers).filter(|&i| a.is_kda(i)).count();
    let mla_layers = a.n_layers - kda_layers;
    let s = a.mla_shape();
    let attn =
        6.0 * (mla_layers * a.n_heads * (s.qk_head_dim() + a.v_head_dim) * a.max_seq_len) as f64;
    let delta_rule = kda_layers as f64 * kda::train_flops_per_token(&a.kda_shape());
    ModelSpec {
        architecture: "kimi_k3".into(),
        n_layers: a.n_layers,
        vocab_size: a.vocab_size,
        max_seq_len: a.max_seq_len,
        flops_per_token: 6.0 * dense + attn + delta_rule,
        context_flops_per_token: attn / a.max_seq_len.max(1) as f64,
        active_params: Some(n - idle_params(a)),
        // MLA caches one shared key head [latent, shared key], the values read from it; KDA
        // blocks keep a fixed-size recurrent state instead.
        kv_cache: (0..a.n_layers)
            .map(|i| (!a.is_kda(i)).then_some((1, a.kv_lora_rank + a.qk_rope_head_dim)))
            .collect(),
        hf: Some(crate::hf::adapter(a)),
        // The latent experts and the residual mixes are not split across tensor-parallel
        // ranks yet, and expert parallelism splits the host's MoE op only.
        parallel: ParallelSupport {
            tensor: false,
            experts_outside_moe_op: true,
        },
        params,
    }
}
