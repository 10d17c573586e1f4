//! Model arguments, the named flavors and the reader of a Hugging Face `config.json`: each
//! argument is declared once, with its `config.json` key and its checks (the SDK's model kit).

use anneal_plugin_api::sdk::kit::mla::MlaShape;
use anneal_plugin_api::sdk::kit::{check, ModelArgs};
use anneal_plugin_api::sdk::{HfConfig, YarnScaling};
use serde::{Deserialize, Serialize};

/// Everything that defines a DeepSeek-V3-family model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct DeepseekArgs {
    /// Hidden size.
    #[arg(hf = "hidden_size", min = 1)]
    pub dim: usize,
    /// Number of blocks.
    #[arg(hf = "num_hidden_layers", min = 1)]
    pub n_layers: usize,
    /// Attention heads.
    #[arg(hf = "num_attention_heads", min = 1)]
    pub n_heads: usize,
    /// Vocabulary size.
    #[arg(hf = "vocab_size", min = 1)]
    pub vocab_size: usize,
    /// RMSNorm epsilon of the blocks and the final norm.
    #[arg(hf = "rms_norm_eps", default = 1e-6, non_negative)]
    pub norm_eps: f64,
    /// RoPE base.
    #[arg(rope = theta, default = 10_000.0)]
    pub rope_theta: f64,
    /// YaRN RoPE scaling; with `mscale_all_dim` it also scales the softmax.
    #[serde(default)]
    #[arg(rope = yarn)]
    pub yarn: Option<YarnScaling>,
    /// Longest sequence.
    #[arg(hf = "max_position_embeddings", default = 4096, min = 1)]
    pub max_seq_len: usize,
    /// Rank of the query compression (`q_lora_rank`); `None` projects queries directly.
    #[serde(default)]
    #[arg(hf = "q_lora_rank", min = 1)]
    pub q_lora_rank: Option<usize>,
    /// Rank of the key/value compression (`kv_lora_rank`): the latent a token caches.
    #[arg(hf = "kv_lora_rank", min = 1)]
    pub kv_lora_rank: usize,
    /// Per-head query/key dims without RoPE (`qk_nope_head_dim`).
    #[arg(hf = "qk_nope_head_dim", min = 1)]
    pub qk_nope_head_dim: usize,
    /// Per-head query/key dims with RoPE (`qk_rope_head_dim`), one key shared by the heads.
    #[arg(hf = "qk_rope_head_dim", min = 1)]
    pub qk_rope_head_dim: usize,
    /// Per-head value dims (`v_head_dim`).
    #[arg(hf = "v_head_dim", min = 1)]
    pub v_head_dim: usize,
    /// RoPE pairs `(2i, 2i+1)` (DeepSeek's layout) rather than `(i, i + d/2)`.
    #[serde(default = "yes")]
    #[arg(hf = "rope_interleave", default = true)]
    pub rope_interleave: bool,
    /// Hidden size of the dense feed-forward of the first blocks (`intermediate_size`).
    #[arg(hf = "intermediate_size", min = 1)]
    pub ffn_dim: usize,
    /// The first `first_k_dense` blocks are dense (`first_k_dense_replace`, which export writes
    /// as the count of leading dense blocks).
    #[arg(hf = "first_k_dense_replace", default = 0, import_only)]
    pub first_k_dense: usize,
    /// Routed experts per sparse block (`n_routed_experts`, or `num_local_experts`).
    #[arg(hf = "n_routed_experts", default = 0, min = 1)]
    pub n_experts: usize,
    /// Experts each token is sent to (`num_experts_per_tok`).
    #[arg(hf = "num_experts_per_tok", min = 1)]
    pub top_k: usize,
    /// Hidden size of one expert (`moe_intermediate_size`).
    #[arg(hf = "moe_intermediate_size", min = 1)]
    pub expert_ffn_dim: usize,
    /// Shared experts every token goes through, fused into one of `n_shared · expert_ffn_dim`.
    #[arg(hf = "n_shared_experts", default = 0)]
    pub n_shared_experts: usize,
    /// Expert groups (`n_group`); 1 routes over all experts.
    #[serde(default = "one")]
    #[arg(hf = "n_group", default = 1, min = 1)]
    pub n_group: usize,
    /// Groups a token may choose from (`topk_group`).
    #[serde(default = "one")]
    #[arg(hf = "topk_group", default = 1, min = 1)]
    pub topk_group: usize,
    /// Router scores: `sigmoid` (DeepSeek-V3, Kimi K2) or `softmax` (DeepSeek-V2).
    #[serde(default = "sigmoid")]
    #[arg(hf = "scoring_func", default = sigmoid(), one_of("sigmoid", "softmax"))]
    pub scoring: String,
    /// Renormalise the chosen experts' weights to sum to 1 (`norm_topk_prob`).
    #[serde(default = "yes")]
    #[arg(hf = "norm_topk_prob", default = true)]
    pub norm_topk_prob: bool,
    /// Factor on the routed experts' weights (`routed_scaling_factor`).
    #[arg(hf = "routed_scaling_factor", default = 1.0, positive)]
    pub routed_scaling_factor: f64,
    /// Coefficient of the load-balancing loss (0: none).
    #[serde(default)]
    #[arg(non_negative)]
    pub aux_loss_coef: f64,
    /// Aux-loss-free balancing rate of `e_score_correction_bias` (0: the bias stays as loaded).
    #[serde(default)]
    #[arg(non_negative)]
    pub balance_rate: f64,
    /// Multi-token prediction modules (`num_nextn_predict_layers`; 0 or 1): in training, one
    /// more block predicts the token after next, its loss an auxiliary loss `mtp` (weighted by
    /// `training.aux_loss_weights.mtp`) and logged as `mtp_loss`; off at inference.
    #[serde(default)]
    pub mtp_layers: usize,
    /// Share the embedding table with the output projection.
    #[serde(default)]
    #[arg(hf = "tie_word_embeddings", default = false)]
    pub tie_embeddings: bool,
    /// Parameter dtype (`f32` or `bf16`).
    #[serde(default = "f32_name")]
    #[arg(default = f32_name(), one_of("f32", "bf16"))]
    pub dtype: String,
    /// The Hugging Face `model_type` (`deepseek_v3`, `kimi_k2` or `kimi_linear`).
    #[serde(default = "model_type")]
    #[arg(hf = "model_type", default = model_type())]
    pub hf_model_type: String,
    /// Rotate the `qk_rope_head_dim` part of queries and the shared key (false: Kimi Linear's
    /// MLA, which keeps that part but applies no position encoding at all).
    #[serde(default = "yes")]
    #[arg(default = true)]
    pub mla_rope: bool,
    /// Blocks with a dense feed-forward, when not just the first `first_k_dense` (Kimi
    /// Linear's `mlp_layer_types`).
    #[serde(default)]
    pub dense_layers: Option<Vec<usize>>,
    /// Kimi Delta Attention (Kimi Linear): the blocks that use it instead of MLA, and its shapes.
    #[serde(default)]
    #[arg(nested)]
    pub kda: Option<KdaArgs>,
    /// Kimi K2.7's vision tower and projector (`kimi_k25`; `None`: a text model).
    #[serde(default)]
    pub vision: Option<crate::moonvit::MoonVitArgs>,
    /// Kimi Linear as Moonshot's released checkpoints lay it out: the dense blocks' MLP under
    /// `mlp.` (transformers' `save_pretrained` writes `block_sparse_moe.`) and the layer
    /// pattern as `linear_attn_config` (1-based lists) in `config.json`.
    #[serde(default)]
    pub hf_released_layout: bool,
}

/// Kimi Delta Attention's shapes and the blocks it replaces MLA in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct KdaArgs {
    /// Heads (`linear_num_heads`); queries, keys and values have as many.
    #[arg(hf = "linear_num_heads", min = 1)]
    pub n_heads: usize,
    /// Dims per head of queries, keys and values (`linear_head_dim`).
    #[arg(hf = "linear_head_dim", min = 1)]
    pub head_dim: usize,
    /// Kernel of the causal depthwise convolution over `[q, k, v]` (`linear_conv_kernel_dim`).
    #[serde(default = "four")]
    #[arg(hf = "linear_conv_kernel_dim", default = 4, min = 1)]
    pub conv_kernel: usize,
    /// The blocks (0-based) that are KDA (`layer_types[i] == "linear_attention"`).
    pub layers: Vec<usize>,
}

impl KdaArgs {
    /// Channels of the fused `[q, k, v]` convolution.
    pub fn conv_dim(&self) -> usize {
        3 * self.n_heads * self.head_dim
    }
}

fn four() -> usize {
    4
}

fn yes() -> bool {
    true
}

fn one() -> usize {
    1
}

fn f32_name() -> String {
    "f32".into()
}

fn sigmoid() -> String {
    "sigmoid".into()
}

fn model_type() -> String {
    "deepseek_v3".into()
}

impl DeepseekArgs {
    /// The shapes the SDK's multi-head latent attention takes.
    pub fn mla_shape(&self) -> MlaShape {
        MlaShape {
            n_heads: self.n_heads,
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
        }
    }

    /// Query/key dims per head.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether block `i` routes over experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        match &self.dense_layers {
            Some(dense) => !dense.contains(&i),
            None => i >= self.first_k_dense,
        }
    }

    /// The KDA shapes when block `i` is a Kimi Delta Attention block.
    pub fn kda_at(&self, i: usize) -> Option<&KdaArgs> {
        self.kda.as_ref().filter(|k| k.layers.contains(&i))
    }

    /// The softmax scale: `1/sqrt(qk_head_dim)`, times YaRN's `mscale²` when `mscale_all_dim`
    /// is set (the attention then sharpens with the context extension, as DeepSeek-V3 does).
    pub fn softmax_scale(&self) -> f64 {
        let base = (self.qk_head_dim() as f64).powf(-0.5);
        match &self.yarn {
            Some(y) if y.mscale_all_dim.is_some_and(|m| m != 0.0) && y.factor > 1.0 => {
                let m = 0.1 * y.mscale_all_dim.unwrap_or(0.0) * y.factor.ln() + 1.0;
                base * m * m
            }
            _ => base,
        }
    }

    /// Checks the arguments fit together, naming the one that does not: the per-field checks,
    /// then what they cannot see.
    pub fn validate(&self) -> Result<(), String> {
        self.check()?;
        if let Some(v) = &self.vision {
            v.validate(self.vocab_size)?;
        }
        if self.mtp_layers > 1 {
            return Err(format!(
                "mtp_layers = {} is not supported (0 or 1)",
                self.mtp_layers
            ));
        }
        if self.mla_rope && !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(format!(
                "qk_rope_head_dim ({}) must be even for RoPE",
                self.qk_rope_head_dim
            ));
        }
        check::group_routing(
            self.n_experts,
            self.top_k,
            self.n_group,
            self.topk_group,
            ["n_routed_experts", "top_k (num_experts_per_tok)"],
        )?;
        if !self.mla_rope && self.yarn.is_some() {
            return Err("yarn scaling needs mla_rope (MLA without RoPE has no positions)".into());
        }
        self.validate_layer_lists()
    }

    /// The lists of block indices (KDA blocks, dense blocks).
    fn validate_layer_lists(&self) -> Result<(), String> {
        let in_range = |what: &str, list: &[usize]| {
            let mut seen = vec![false; self.n_layers];
            for &i in list {
                match seen.get_mut(i) {
                    None => {
                        return Err(format!(
                            "{what}: block {i} is out of range (the model has {} blocks)",
                            self.n_layers
                        ))
                    }
                    Some(true) => return Err(format!("{what}: block {i} is listed twice")),
                    Some(s) => *s = true,
                }
            }
            Ok(())
        };
        match &self.dense_layers {
            Some(dense) => in_range("dense_layers", dense)?,
            // A count that covers every block leaves no MoE layer: the experts configured
            // would never run, which is almost always a slip (a layer count lowered for a
            // small run). A dense model on purpose says so by listing its blocks.
            None if self.first_k_dense >= self.n_layers => {
                return Err(format!(
                    "first_k_dense (first_k_dense_replace) = {} makes all {} blocks dense (n_layers), so the model has no MoE layer and never uses its {} experts; set it below {}, or for a dense model on purpose list every block in dense_layers ([0, .., {}])",
                    self.first_k_dense,
                    self.n_layers,
                    self.n_experts,
                    self.n_layers,
                    self.n_layers.saturating_sub(1)
                ))
            }
            None => {}
        }
        // That layout's config.json names the dense blocks by their count
        // (`first_k_dense_replace`).
        let first_dense = (0..self.n_layers)
            .take_while(|&i| !self.is_sparse(i))
            .count();
        if self.hf_released_layout && (first_dense..self.n_layers).any(|i| !self.is_sparse(i)) {
            return Err(
                "hf_released_layout needs the dense blocks to be the first ones (first_k_dense_replace)"
                    .into(),
            );
        }
        if let Some(k) = &self.kda {
            in_range("kda.layers", &k.layers)?;
        }
        Ok(())
    }
}

/// DeepSeek-V3's YaRN: a 4096-token context stretched 40×, the softmax sharpened to match.
fn deepseek_yarn(factor: f64) -> Option<YarnScaling> {
    Some(YarnScaling {
        factor,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: None,
        mscale: Some(1.0),
        mscale_all_dim: Some(1.0),
    })
}

/// DeepSeek-V3 671B as released.
fn v3() -> DeepseekArgs {
    DeepseekArgs {
        dim: 7168,
        n_layers: 61,
        n_heads: 128,
        vocab_size: 129_280,
        norm_eps: 1e-6,
        rope_theta: 10_000.0,
        yarn: deepseek_yarn(40.0),
        max_seq_len: 163_840,
        q_lora_rank: Some(1536),
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        rope_interleave: true,
        ffn_dim: 18_432,
        first_k_dense: 3,
        n_experts: 256,
        top_k: 8,
        expert_ffn_dim: 2048,
        n_shared_experts: 1,
        n_group: 8,
        topk_group: 4,
        scoring: sigmoid(),
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
        aux_loss_coef: 0.0,
        balance_rate: 0.0,
        mtp_layers: 1,
        tie_embeddings: false,
        dtype: "bf16".into(),
        hf_model_type: "deepseek_v3".into(),
        mla_rope: true,
        dense_layers: None,
        kda: None,
        vision: None,
        hf_released_layout: false,
    }
}

anneal_plugin_api::flavors! {
    /// The named flavors.
    pub fn flavor -> DeepseekArgs;
    // The debug Llama's size (hidden 256, 4 blocks, 4 heads) with DeepSeek-V3's blocks: MLA
    // with a 64-rank query and 32-rank key/value latent, a dense first block, then 8 routed
    // experts of 128 in 4 groups (top 2 of 2 groups) plus one shared expert.
    "debugmodel" => DeepseekArgs {
        dim: 256,
        n_layers: 4,
        n_heads: 4,
        vocab_size: 8192,
        yarn: None,
        max_seq_len: 2048,
        q_lora_rank: Some(64),
        kv_lora_rank: 32,
        qk_nope_head_dim: 32,
        qk_rope_head_dim: 16,
        v_head_dim: 32,
        ffn_dim: 512,
        first_k_dense: 1,
        n_experts: 8,
        top_k: 2,
        expert_ffn_dim: 128,
        n_group: 4,
        topk_group: 2,
        aux_loss_coef: 0.0,
        balance_rate: 0.001,
        dtype: "f32".into(),
        ..v3()
    },
    "deepseek_v3_671b" => v3(),
    "kimi_k2_1t" => DeepseekArgs {
        n_heads: 64,
        vocab_size: 163_840,
        rope_theta: 50_000.0,
        yarn: deepseek_yarn(32.0),
        max_seq_len: 131_072,
        first_k_dense: 1,
        n_experts: 384,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 2.827,
        mtp_layers: 0,
        hf_model_type: "kimi_k2".into(),
        ..v3()
    },
    // Kimi K2.5 / K2.7 (`kimi_k25`): Kimi K2's decoder under transformers' default MoonViT3d.
    "kimi_k25_1t" => DeepseekArgs {
        vision: Some(crate::moonvit::MoonVitArgs::released()),
        hf_model_type: "kimi_k25".into(),
        ..flavor("kimi_k2_1t")?
    },
    // The debug model with a tiny MoonViT3d (2 blocks of 64 over 14-pixel patches, an 8 × 8
    // position grid) whose image tokens are ids 5 and 6, where chat-trained tokenizers put them.
    "debugmodel_kimi_k25" => DeepseekArgs {
        vision: Some(crate::moonvit::MoonVitArgs {
            pos_emb_height: 8,
            pos_emb_width: 8,
            num_heads: 2,
            depth: 2,
            hidden_size: 64,
            intermediate_size: 128,
            projection_hidden_size: 64,
            image_token_id: 5,
            video_token_id: 6,
            vision_start_token_id: 3,
            vision_end_token_id: 4,
            ..crate::moonvit::MoonVitArgs::released()
        }),
        hf_model_type: "kimi_k25".into(),
        mtp_layers: 0,
        ..flavor("debugmodel")?
    },
    // DeepSeek-V2-Lite (model type deepseek_v2): the same blocks with softmax routing over 64
    // experts, no query latent and no routing groups.
    "deepseek_v2_lite_16b" => DeepseekArgs {
        dim: 2048,
        n_layers: 27,
        n_heads: 16,
        vocab_size: 102_400,
        yarn: Some(YarnScaling {
            mscale: Some(0.707),
            mscale_all_dim: Some(0.707),
            ..deepseek_yarn(40.0)?
        }),
        q_lora_rank: None,
        ffn_dim: 10_944,
        first_k_dense: 1,
        n_experts: 64,
        top_k: 6,
        expert_ffn_dim: 1408,
        n_shared_experts: 2,
        n_group: 1,
        topk_group: 1,
        scoring: "softmax".into(),
        norm_topk_prob: false,
        routed_scaling_factor: 1.0,
        mtp_layers: 0,
        ..v3()
    },
    "moonlight_16b_a3b" => DeepseekArgs {
        dim: 2048,
        n_layers: 27,
        n_heads: 16,
        vocab_size: 163_840,
        rope_theta: 50_000.0,
        yarn: None,
        max_seq_len: 8192,
        q_lora_rank: None,
        ffn_dim: 11_264,
        first_k_dense: 1,
        n_experts: 64,
        top_k: 6,
        expert_ffn_dim: 1408,
        n_shared_experts: 2,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 2.446,
        mtp_layers: 0,
        ..v3()
    },
    "kimi_linear_debug" => crate::kimi_config::kimi_linear_debug(),
    "kimi_linear_48b_a3b" => crate::kimi_config::kimi_linear_48b_a3b(),
}

/// Arguments from a Hugging Face `deepseek_v3` (or `kimi_k2`, or `kimi_linear`, see
/// [`crate::kimi_config`]) `config.json`. A key that is absent takes transformers' default; a
/// key of the wrong type is reported as such.
pub fn from_hf_config(c: &serde_json::Value) -> Result<DeepseekArgs, String> {
    let f = HfConfig::new(c);
    let model_type = f.str("model_type")?.unwrap_or("deepseek_v3");
    if model_type == "kimi_linear" {
        return crate::kimi_config::from_hf_config(c);
    }
    if model_type == "kimi_k25" {
        // The DeepSeek-V3 decoder under `text_config`, the tower beside it; the top level ties.
        let text = c
            .get("text_config")
            .ok_or("config.json: missing object 'text_config'")?;
        f.object("text_config")?;
        let mut a = from_hf_config(text)?;
        a.vision = Some(crate::moonvit::MoonVitArgs::from_top(&f)?);
        a.tie_embeddings = f.bool("tie_word_embeddings")?.unwrap_or(true);
        a.hf_model_type = "kimi_k25".into();
        a.validate().map_err(|e| format!("config.json: {e}"))?;
        return Ok(a);
    }
    if !matches!(model_type, "deepseek_v3" | "kimi_k2") {
        return Err(format!(
            "config.json: model_type '{model_type}' is not served by this plugin (deepseek_v3, kimi_k2, kimi_linear, kimi_k25)"
        ));
    }
    if f.rope(10_000.0)?.llama3.is_some() {
        return Err("config.json: deepseek_v3 with llama3 rope scaling is not supported".into());
    }
    if f.bool("attention_bias")?.unwrap_or(false) {
        return Err("config.json: attention_bias = true is not supported".into());
    }
    let scoring = f.str("scoring_func")?.unwrap_or("sigmoid");
    if !matches!(scoring, "sigmoid" | "softmax") {
        return Err(format!(
            "config.json: scoring_func '{scoring}' is not supported (sigmoid, softmax)"
        ));
    }
    let mut a = DeepseekArgs::from_hf(&f)?;
    // A head split that does not add up: transformers derives these two from the others.
    let (nope, rope_dim) = (a.qk_nope_head_dim, a.qk_rope_head_dim);
    for (key, want) in [("qk_head_dim", nope + rope_dim), ("head_dim", rope_dim)] {
        if let Some(got) = f.uint(key)? {
            if got != want {
                return Err(format!(
                    "config.json: {key} = {got} does not match qk_nope_head_dim + qk_rope_head_dim = {nope} + {rope_dim} (qk_head_dim) and qk_rope_head_dim (head_dim): expected {want}"
                ));
            }
        }
    }
    if f.get("n_routed_experts").is_none() {
        a.n_experts = f.need_uint("num_local_experts")?;
    }
    // The load-balancing loss counts only when transformers would add it.
    if f.bool("output_router_logits")?.unwrap_or(false) {
        a.aux_loss_coef = f.float("router_aux_loss_coef")?.unwrap_or(0.001);
    }
    // A checkpoint whose every block is dense says so on purpose (its weights hold no experts
    // there), which the arguments spell as the full list.
    a.dense_layers = (a.first_k_dense >= a.n_layers).then(|| (0..a.n_layers).collect());
    a.validate().map_err(|e| format!("config.json: {e}"))?;
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> serde_json::Value {
        json!({
            "model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "intermediate_size": 112, "moe_intermediate_size": 24,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "kv_lora_rank": 16,
            "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "routed_scaling_factor": 2.5, "vocab_size": 96,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0}
        })
    }

    #[test]
    fn a_tiny_config_reads_and_the_softmax_scale_takes_mscale() {
        let a = from_hf_config(&tiny()).unwrap();
        assert_eq!(
            (a.qk_head_dim(), a.is_sparse(0), a.is_sparse(1)),
            (24, false, true)
        );
        let m = 0.1 * 4f64.ln() + 1.0;
        assert!((a.softmax_scale() - m * m / 24f64.sqrt()).abs() < 1e-12);
    }

    #[test]
    fn bad_configs_name_the_key() {
        for (k, v, want) in [
            (
                "topk_group",
                json!(5),
                "topk_group (5) must not exceed n_group (4)",
            ),
            ("n_group", json!(3), "n_group (3) must split"),
            ("num_experts_per_tok", json!(5), "more experts per token"),
            (
                "qk_rope_head_dim",
                json!(7),
                "qk_rope_head_dim (7) must be even",
            ),
            ("kv_lora_rank", json!(0), "kv_lora_rank must be at least 1"),
            ("scoring_func", json!("relu"), "scoring_func 'relu'"),
            ("qk_head_dim", json!(25), "qk_head_dim = 25 does not match"),
            ("head_dim", json!(16), "head_dim = 16 does not match"),
        ] {
            let mut c = tiny();
            c[k] = v;
            let e = from_hf_config(&c).unwrap_err();
            assert!(e.contains(want), "{k}: {e}");
        }
    }

    #[test]
    fn no_moe_layer_is_refused_unless_the_dense_blocks_are_listed() {
        let mut a = flavor("debugmodel").unwrap();
        for k in [a.n_layers, a.n_layers + 3] {
            a.first_k_dense = k;
            let e = a.validate().unwrap_err();
            assert!(e.starts_with("first_k_dense"), "{e}");
            assert!(
                e.contains("no MoE layer") && e.contains("dense_layers"),
                "{e}"
            );
        }
        a.first_k_dense = a.n_layers - 1;
        a.validate().unwrap();
        // A dense model on purpose: every block listed.
        a.first_k_dense = a.n_layers;
        a.dense_layers = Some((0..a.n_layers).collect());
        a.validate().unwrap();
        assert!((0..a.n_layers).all(|i| !a.is_sparse(i)));
        // A checkpoint whose config.json makes every block dense reads as that list.
        let mut c = tiny();
        c["first_k_dense_replace"] = json!(3);
        let hf = from_hf_config(&c).unwrap();
        assert_eq!(hf.dense_layers, Some(vec![0, 1, 2]));
    }
}
