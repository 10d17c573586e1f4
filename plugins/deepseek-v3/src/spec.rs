//! The parameters of a DeepSeek-V3 model, each declared once with its shape, init, placement
//! and Hugging Face name (transformers saves routed experts one by one, which we stack into
//! `[experts, ..]` parameters, and the aux-loss-free bias `e_score_correction_bias` as a
//! buffer of the router).

use crate::config::DeepseekArgs;
use crate::kda::KdaParams;
use anneal_plugin_api::sdk::kit::mla::{self, MlaParams};
use anneal_plugin_api::sdk::{Decl, HfMap, Init, ModelSpec, Param, ParamSpec, ParamTable};

/// A block's feed-forward.
pub enum FeedForward {
    /// `W2 · (SiLU(W1 x) ⊙ W3 x)` (the first blocks).
    Dense {
        /// Gate `[ffn_dim, dim]`.
        w1: Param,
        /// Down `[dim, ffn_dim]`.
        w2: Param,
        /// Up `[ffn_dim, dim]`.
        w3: Param,
    },
    /// Routed experts plus shared ones.
    Experts {
        /// Router `[n_experts, dim]`.
        router: Param,
        /// `e_score_correction_bias [n_experts]`, a buffer.
        bias: Param,
        /// Gates, ups `[n_experts, expert_ffn_dim, dim]`, downs `[n_experts, dim, expert_ffn_dim]`.
        w1: Param,
        /// See `w1`.
        w2: Param,
        /// See `w1`.
        w3: Param,
        /// The shared experts as one SwiGLU `[gate, up, down]`, when there are any.
        shared: Option<[Param; 3]>,
    },
}

/// A block's token mixer.
pub enum Mixer {
    /// Multi-head latent attention.
    Mla(MlaParams),
    /// Kimi Delta Attention (Kimi Linear's linear-attention blocks).
    Kda(KdaParams),
}

/// The parameters of one block.
pub struct BlockParams {
    /// RMSNorm before attention.
    pub attention_norm: Param,
    /// Attention (MLA) or KDA.
    pub attention: Mixer,
    /// RMSNorm before the feed-forward.
    pub ffn_norm: Param,
    /// The feed-forward.
    pub ffn: FeedForward,
}

/// Every parameter of the model.
pub struct DeepseekParams {
    /// Token embeddings `[vocab, dim]`.
    pub tok_embeddings: Param,
    /// The blocks.
    pub layers: Vec<BlockParams>,
    /// Final RMSNorm.
    pub norm: Param,
    /// Output projection `[vocab, dim]` (the embedding table when tied).
    pub output: Param,
    /// The multi-token prediction module, when `mtp_layers` is 1.
    pub mtp: Option<MtpParams>,
    /// Kimi K2.7's vision tower and projector.
    pub vision: Option<crate::moonvit::MoonVit>,
}

/// DeepSeek-V3's multi-token prediction module (depth 1): from the main model's last hidden
/// state at `i` and the embedding of token `i + 1`, one more block predicts token `i + 2`
/// through the shared embedding and output head.
pub struct MtpParams {
    /// RMSNorm of the next token's embedding.
    pub enorm: Param,
    /// RMSNorm of the main model's hidden state.
    pub hnorm: Param,
    /// `[dim, 2·dim]`: the two, concatenated, down to the hidden size.
    pub eh_proj: Param,
    /// The block.
    pub block: BlockParams,
    /// RMSNorm before the shared output head.
    pub norm: Param,
}

/// Declares every parameter: N(0,1) embeddings, truncated normal projections (depth-scaled
/// for those writing into the residual stream), ones for norms, a zero routing bias.
pub fn declare(a: &DeepseekArgs) -> (DeepseekParams, Vec<ParamSpec>) {
    let d = a.dim;
    let mut t = ParamTable::new(&a.dtype);
    let tok_embeddings = t.token_embedding(a.vocab_size, d);
    let layers = (0..a.n_layers)
        .map(|i| {
            let (prefix, hf) = (format!("layers.{i}"), format!("model.layers.{i}"));
            declare_block(&mut t, a, i, &prefix, &hf, a.is_sparse(i))
        })
        .collect();
    // The MTP module sits after the blocks, where DeepSeek's checkpoints keep it.
    let mtp = (a.mtp_layers > 0).then(|| {
        let (i, hf) = (a.n_layers, format!("model.layers.{}", a.n_layers));
        let block = declare_block(&mut t, a, i, "mtp.block", &hf, true);
        let mut l = t.layer(i, "mtp", &hf);
        let mut norm = |name: &str, hf: &str| l.add(Decl::new(name, [d]).ones().hf_name(hf));
        let (enorm, hnorm) = (
            norm("enorm.weight", "enorm.weight"),
            norm("hnorm.weight", "hnorm.weight"),
        );
        let out_norm = norm("norm.weight", "shared_head.norm.weight");
        MtpParams {
            enorm,
            hnorm,
            eh_proj: l.add(
                Decl::new("eh_proj.weight", [d, 2 * d])
                    .trunc_normal(0.02)
                    .row()
                    .hf_name("eh_proj.weight"),
            ),
            block,
            norm: out_norm,
        }
    });
    let (norm, output) =
        t.final_norm_and_output(a.vocab_size, d, a.tie_embeddings.then_some(&tok_embeddings));
    let vision = a
        .vision
        .as_ref()
        .map(|v| crate::moonvit::MoonVit::declare(&mut t, v, d));
    let params = DeepseekParams {
        tok_embeddings,
        layers,
        norm,
        output,
        mtp,
        vision,
    };
    let mut specs = t.into_specs();
    if a.vision.is_some() {
        under_language_model(&mut specs);
    }
    (params, specs)
}

/// Moves the decoder's Hugging Face names where Kimi K2.7's released checkpoints keep them
/// (`language_model.model.blocks.{i}.`, `language_model.lm_head`).
fn under_language_model(specs: &mut [ParamSpec]) {
    let text = specs
        .iter_mut()
        .filter(|p| !p.name.starts_with("vision.") && !p.name.starts_with("mm_projector."));
    for p in text {
        for s in p.hf.iter_mut().flat_map(|m| m.sources.iter_mut()) {
            *s = match s.strip_prefix("model.layers.") {
                Some(rest) => format!("language_model.model.blocks.{rest}"),
                None => format!("language_model.{s}"),
            };
        }
    }
}

/// Declares block `i` (attention or KDA, and a dense or sparse feed-forward) under `prefix`
/// and Hugging Face's `hf_prefix`.
fn declare_block(
    t: &mut ParamTable,
    a: &DeepseekArgs,
    i: usize,
    prefix: &str,
    hf_prefix: &str,
    sparse: bool,
) -> BlockParams {
    let d = a.dim;
    let std = 0.02;
    let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
    let mut l = t.layer(i, prefix, hf_prefix);
    let mut norm = |name: &str, n: usize, hf: &str| l.add(Decl::new(name, [n]).ones().hf_name(hf));
    let attention_norm = norm("attention_norm.weight", d, "input_layernorm.weight");
    let ffn_norm = norm("ffn_norm.weight", d, "post_attention_layernorm.weight");
    // The MTP block (DeepSeek-V3 only) is always MLA.
    let attention = match a.kda_at(i).filter(|_| prefix != "mtp.block") {
        Some(k) => Mixer::Kda(crate::kda::declare(&mut l, d, k, depth_std)),
        None => Mixer::Mla(mla::declare(&mut l, d, &a.mla_shape(), false, depth_std)),
    };
    let mut linear = |name: &str, shape: [usize; 2], std: f64, hf: &str, col: bool| {
        let decl = Decl::new(name, shape).trunc_normal(std).hf_name(hf);
        l.add(if col { decl.column() } else { decl.row() })
    };
    let names = HfFfnNames::of(a, sparse);
    let ffn = if !sparse {
        FeedForward::Dense {
            w1: linear(
                "feed_forward.w1.weight",
                [a.ffn_dim, d],
                std,
                &names.at("gate_proj.weight"),
                true,
            ),
            w3: linear(
                "feed_forward.w3.weight",
                [a.ffn_dim, d],
                depth_std,
                &names.at("up_proj.weight"),
                true,
            ),
            w2: linear(
                "feed_forward.w2.weight",
                [d, a.ffn_dim],
                depth_std,
                &names.at("down_proj.weight"),
                false,
            ),
        }
    } else {
        let (e, ef) = (a.n_experts, a.expert_ffn_dim);
        let shared_f = ef * a.n_shared_experts;
        let shared = (a.n_shared_experts > 0).then(|| {
            [
                linear(
                    "feed_forward.shared.w1.weight",
                    [shared_f, d],
                    std,
                    &names.at("shared_experts.gate_proj.weight"),
                    true,
                ),
                linear(
                    "feed_forward.shared.w3.weight",
                    [shared_f, d],
                    depth_std,
                    &names.at("shared_experts.up_proj.weight"),
                    true,
                ),
                linear(
                    "feed_forward.shared.w2.weight",
                    [d, shared_f],
                    depth_std,
                    &names.at("shared_experts.down_proj.weight"),
                    false,
                ),
            ]
        });
        let mut experts = |name: &str, shape: [usize; 3], std: f64, hf: &str| {
            l.add(
                Decl::new(name, shape)
                    .trunc_normal(std)
                    .expert_dim(0)
                    .hf(HfMap::stack(hf, e)),
            )
        };
        FeedForward::Experts {
            w1: experts("feed_forward.experts.w1", [e, ef, d], std, &names.expert(0)),
            w3: experts(
                "feed_forward.experts.w3",
                [e, ef, d],
                depth_std,
                &names.expert(1),
            ),
            w2: experts(
                "feed_forward.experts.w2",
                [e, d, ef],
                depth_std,
                &names.expert(2),
            ),
            shared,
            router: l.add(
                Decl::new("feed_forward.router.weight", [e, d])
                    .trunc_normal(std)
                    .replicated()
                    .hf_name(&names.at("gate.weight")),
            ),
            bias: l.add(
                Decl::new("feed_forward.router.balance_bias", [e])
                    .init(Init::Zeros)
                    .buffer()
                    .hf_name(&names.at("gate.e_score_correction_bias")),
            ),
        }
    };
    BlockParams {
        attention_norm,
        attention,
        ffn_norm,
        ffn,
    }
}

/// The Hugging Face names of a block's feed-forward: DeepSeek-V3's `mlp.` with
/// `gate_proj`/`up_proj`/`down_proj` experts, or Kimi Linear's `block_sparse_moe.` with experts
/// `w1`/`w3`/`w2` (a dense block's MLP under `mlp.` in the released checkpoints, under
/// `block_sparse_moe.` where transformers' `save_pretrained` wrote it).
struct HfFfnNames {
    prefix: &'static str,
    /// Experts' gate, up and down.
    experts: [&'static str; 3],
}

impl HfFfnNames {
    /// The names in block `i` (`sparse` or not).
    fn of(a: &DeepseekArgs, sparse: bool) -> Self {
        if a.hf_model_type != "kimi_linear" {
            return HfFfnNames {
                prefix: "mlp.",
                experts: ["gate_proj", "up_proj", "down_proj"],
            };
        }
        HfFfnNames {
            // The released checkpoints keep a dense block's MLP under `mlp.`.
            prefix: if a.hf_released_layout && !sparse {
                "mlp."
            } else {
                "block_sparse_moe."
            },
            experts: ["w1", "w3", "w2"],
        }
    }

    /// `prefix` + `name`.
    fn at(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The per-expert template of expert tensor `which` (0 gate, 1 up, 2 down).
    fn expert(&self, which: usize) -> String {
        format!(
            "{}experts.{{e}}.{}.weight",
            self.prefix, self.experts[which]
        )
    }
}

/// Every parameter's spec.
pub fn params(a: &DeepseekArgs) -> Vec<ParamSpec> {
    declare(a).1
}

/// Parameters a token does not go through: the routed experts it is not sent to.
pub fn idle_params(a: &DeepseekArgs) -> usize {
    let sparse = (0..a.n_layers).filter(|&i| a.is_sparse(i)).count();
    sparse * (a.n_experts - a.top_k) * 3 * a.dim * a.expert_ffn_dim
}

/// The full spec: parameters, layers, KV-cache needs, FLOPs and the Hugging Face config.
pub fn model_spec(a: &DeepseekArgs, params: Vec<ParamSpec>) -> ModelSpec {
    let n: usize = params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let embedding = a.vocab_size * a.dim;
    let mtp: usize = params
        .iter()
        .filter(|p| p.name.starts_with("mtp."))
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    // 6 FLOPs per parameter per token (forward + backward) for the products a token goes
    // through (of the routed experts, only its top-k; KDA's projections and convolution),
    // plus, in MLA blocks, attention scores (qk_head_dim) and values (v_head_dim) over the
    // sequence and, in KDA blocks, the chunked delta rule's work.
    let dense = (n - embedding - idle_params(a)) as f64;
    let kda_layers = (0..a.n_layers).filter(|&i| a.kda_at(i).is_some()).count();
    let mla_layers = a.n_layers - kda_layers;
    let attn =
        6.0 * (mla_layers * a.n_heads * (a.qk_head_dim() + a.v_head_dim) * a.max_seq_len) as f64;
    let delta_rule = a.kda.as_ref().map_or(0.0, |k| {
        kda_layers as f64 * anneal_plugin_api::sdk::kit::kda::train_flops_per_token(&k.shape())
    });
    ModelSpec {
        architecture: "deepseek_v3".into(),
        n_layers: a.n_layers,
        vocab_size: a.vocab_size,
        max_seq_len: a.max_seq_len,
        flops_per_token: 6.0 * dense + attn + delta_rule,
        context_flops_per_token: attn / a.max_seq_len.max(1) as f64,
        // What a token goes through when the model runs: the MTP module trains only.
        active_params: Some(n - idle_params(a) - mtp),
        // The cache holds one shared key head [latent, RoPE key], the values read from it; the
        // estimate (which counts keys and values alike) counts it twice.
        // KDA blocks keep a fixed-size recurrent state instead.
        kv_cache: (0..a.n_layers)
            .map(|i| {
                a.kda_at(i)
                    .is_none()
                    .then_some((1, a.kv_lora_rank + a.qk_rope_head_dim))
            })
            .collect(),
        hf: Some(crate::hf::adapter(a)),
        parallel: Default::default(),
        params,
    }
}
