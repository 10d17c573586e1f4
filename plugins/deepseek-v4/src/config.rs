//! Model arguments, the named flavors and the reading of a Hugging Face `config.json`
//! (transformers' `deepseek_v4`).

use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::{HfConfig, YarnScaling};
use serde::{Deserialize, Serialize};

/// What a block's attention sees besides its sliding window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionType {
    /// The sliding window only.
    SlidingAttention,
    /// Compressed sparse attention (CSA): overlapping blocks of `csa_rate` tokens, of which an
    /// indexer keeps the top `index_topk` per query.
    CompressedSparseAttention,
    /// Heavily compressed attention (HCA): every block of `hca_rate` tokens.
    HeavilyCompressedAttention,
}

/// How a block's experts are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpType {
    /// From the token id through a fixed table (`tid2eid`).
    HashMoe,
    /// By the learned router's top-k.
    Moe,
}

/// Everything that defines a DeepSeek-V4 model; a key absent from `config.json` takes
/// transformers' default (the V4-Flash shape).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct DeepseekV4Args {
    /// Hidden size.
    #[arg(hf = "hidden_size", default = 4096, min = 1)]
    pub dim: usize,
    /// Number of blocks.
    #[arg(hf = "num_hidden_layers", default = 43, min = 1)]
    pub n_layers: usize,
    /// Query heads (one key/value head is shared by all).
    #[arg(hf = "num_attention_heads", default = 64, min = 1)]
    pub n_heads: usize,
    /// Per-head size of queries, keys and values.
    #[arg(hf = "head_dim", default = 512, min = 1)]
    pub head_dim: usize,
    /// The trailing dims of each head that RoPE rotates (`qk_rope_head_dim`).
    #[arg(hf = "qk_rope_head_dim", default = head_dim / 8)]
    pub rope_head_dim: usize,
    /// Rank of the low-rank query projection.
    #[arg(hf = "q_lora_rank", default = 1024, min = 1)]
    pub q_lora_rank: usize,
    /// Vocabulary size.
    #[arg(hf = "vocab_size", default = 129_280, min = 1)]
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    #[arg(hf = "rms_norm_eps", default = 1e-6, non_negative)]
    pub norm_eps: f64,
    /// RoPE base of the sliding-window blocks.
    #[arg(hf = "rope_theta", default = 10_000.0, positive)]
    pub rope_theta: f64,
    /// RoPE base of the compressed blocks, their compressors and indexers.
    #[arg(hf = "compress_rope_theta", default = 160_000.0, positive)]
    pub compress_rope_theta: f64,
    /// YaRN scaling of the compressed blocks' RoPE.
    #[serde(default)]
    pub compress_yarn: Option<YarnScaling>,
    /// Longest sequence.
    #[arg(hf = "max_position_embeddings", default = 1_048_576, min = 1)]
    pub max_seq_len: usize,
    /// Each block's attention.
    #[arg(hf = "layer_types", json, default = default_layer_types(n_layers))]
    pub layer_types: Vec<AttentionType>,
    /// Tokens per compressed block in CSA blocks (`compress_rates` in `config.json`).
    #[arg(min = 1)]
    pub csa_rate: usize,
    /// Tokens per compressed block in HCA blocks.
    #[arg(min = 1)]
    pub hca_rate: usize,
    /// The sliding window (tokens, including the query's own).
    #[arg(hf = "sliding_window", default = 128, min = 1)]
    pub sliding_window: usize,
    /// Head groups of the grouped output projection.
    #[arg(hf = "o_groups", default = 8, min = 1)]
    pub o_groups: usize,
    /// Per-group rank of the grouped output projection.
    #[arg(hf = "o_lora_rank", default = 1024, min = 1)]
    pub o_lora_rank: usize,
    /// The indexer's query heads.
    #[arg(hf = "index_n_heads", default = 64, min = 1)]
    pub index_n_heads: usize,
    /// The indexer's head size.
    #[arg(hf = "index_head_dim", default = 128, min = 1)]
    pub index_head_dim: usize,
    /// Compressed blocks each query keeps in CSA blocks.
    #[arg(hf = "index_topk", default = 512, min = 1)]
    pub index_topk: usize,
    /// Residual streams of the hyper-connections.
    #[arg(hf = "hc_mult", default = 4, min = 1)]
    pub hc_mult: usize,
    /// Sinkhorn iterations of the residual mixing matrix.
    #[arg(hf = "hc_sinkhorn_iters", default = 20, min = 1)]
    pub hc_sinkhorn_iters: usize,
    /// Floor of the hyper-connection weights and Sinkhorn's denominators.
    #[arg(hf = "hc_eps", default = 1e-6, non_negative)]
    pub hc_eps: f64,
    /// Each block's expert choice.
    #[arg(hf = "mlp_layer_types", json, default = mlp_types(n_layers, 3))]
    pub mlp_layer_types: Vec<MlpType>,
    /// Routed experts per block.
    #[arg(hf = "n_routed_experts", default = 256, min = 1)]
    pub n_experts: usize,
    /// Experts per token.
    #[arg(hf = "num_experts_per_tok", default = 6, min = 1)]
    pub top_k: usize,
    /// Hidden size of one expert, the shared one included (`moe_intermediate_size`).
    #[arg(hf = "moe_intermediate_size", default = 2048, min = 1)]
    pub expert_ffn_dim: usize,
    /// `n_shared_experts` of the config (transformers builds one shared expert whatever it says).
    #[arg(hf = "n_shared_experts", default = 1)]
    pub n_shared_experts: usize,
    /// Router scores: `sqrtsoftplus`, `softmax` or `sigmoid`.
    #[arg(
        hf = "scoring_func",
        default = "sqrtsoftplus".into(),
        one_of("sqrtsoftplus", "softmax", "sigmoid")
    )]
    pub scoring: String,
    /// Factor on the routing weights.
    #[arg(hf = "routed_scaling_factor", default = 1.5, positive)]
    pub routed_scaling_factor: f64,
    /// Clamp of the experts' gate (above) and up (both sides) products.
    #[arg(hf = "swiglu_limit", default = 10.0, positive)]
    pub swiglu_limit: f64,
    /// Step of the aux-loss-free balancing bias per optimizer step (0: fixed).
    #[serde(default)]
    #[arg(non_negative)]
    pub balance_rate: f64,
    /// Multi-token prediction modules (`num_nextn_predict_layers`; 0 or 1), as DeepSeek-V3's:
    /// in training, one more block predicts the token after next, its loss an auxiliary loss
    /// `mtp` (weighted by `training.aux_loss_weights.mtp`) and logged as `mtp_loss`; off at
    /// inference and decode.
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
}

fn f32_name() -> String {
    "f32".into()
}

impl DeepseekV4Args {
    /// Block `i`'s attention.
    pub fn layer_type(&self, i: usize) -> AttentionType {
        self.layer_types
            .get(i)
            .copied()
            .unwrap_or(AttentionType::SlidingAttention)
    }

    /// Block `i`'s expert choice.
    pub fn mlp_type(&self, i: usize) -> MlpType {
        self.mlp_layer_types.get(i).copied().unwrap_or(MlpType::Moe)
    }

    /// Tokens per compressed block of an attention type (`None` for sliding-only).
    pub fn rate(&self, t: AttentionType) -> Option<usize> {
        match t {
            AttentionType::SlidingAttention => None,
            AttentionType::CompressedSparseAttention => Some(self.csa_rate),
            AttentionType::HeavilyCompressedAttention => Some(self.hca_rate),
        }
    }

    /// Refuses arguments the model cannot be built from, naming the key: the per-field checks,
    /// then what they cannot see.
    pub fn validate(&self) -> Result<(), String> {
        self.check()?;
        if self.rope_head_dim > self.head_dim.min(self.index_head_dim)
            || !self.rope_head_dim.is_multiple_of(2)
        {
            return Err(format!(
                "rope_head_dim ({}) must be even and at most head_dim ({}) and index_head_dim ({})",
                self.rope_head_dim, self.head_dim, self.index_head_dim
            ));
        }
        if !(self.n_heads * self.head_dim).is_multiple_of(self.o_groups) {
            return Err(format!(
                "o_groups ({}) must divide n_heads × head_dim ({})",
                self.o_groups,
                self.n_heads * self.head_dim
            ));
        }
        if self.top_k > self.n_experts {
            return Err(format!(
                "top_k ({}) asks for more experts per token than n_experts ({})",
                self.top_k, self.n_experts
            ));
        }
        for (name, len) in [
            ("layer_types", self.layer_types.len()),
            ("mlp_layer_types", self.mlp_layer_types.len()),
        ] {
            if len != self.n_layers {
                return Err(format!(
                    "{name} has {len} entries for {} layers",
                    self.n_layers
                ));
            }
        }
        if self.mtp_layers > 1 {
            return Err(format!(
                "mtp_layers = {} is not supported (0 or 1)",
                self.mtp_layers
            ));
        }
        Ok(())
    }
}

/// transformers' default schedule: two HCA blocks, then CSA and HCA alternating.
fn default_layer_types(n: usize) -> Vec<AttentionType> {
    (0..n)
        .map(|i| {
            if i >= 2 && (i - 2) % 2 == 1 {
                AttentionType::CompressedSparseAttention
            } else {
                AttentionType::HeavilyCompressedAttention
            }
        })
        .collect()
}

/// The first `hashed` of `n` blocks hash-routed, the rest learned (transformers' default: 3).
fn mlp_types(n: usize, hashed: usize) -> Vec<MlpType> {
    (0..n)
        .map(|i| {
            if i < hashed {
                MlpType::HashMoe
            } else {
                MlpType::Moe
            }
        })
        .collect()
}

/// Small enough that 300 steps of 8 x 256 tokens train in minutes on 2 cores, with every kind
/// of block: blocks of 4 (CSA, top 16 of 64) and 16 (HCA) tokens against a window of 32, two
/// residual streams, a hash-routed first block.
fn debugmodel() -> DeepseekV4Args {
    DeepseekV4Args {
        dim: 256,
        n_layers: 4,
        n_heads: 4,
        head_dim: 64,
        rope_head_dim: 16,
        q_lora_rank: 128,
        vocab_size: 8192,
        norm_eps: 1e-6,
        rope_theta: 10_000.0,
        compress_rope_theta: 160_000.0,
        compress_yarn: None,
        max_seq_len: 2048,
        layer_types: vec![
            AttentionType::SlidingAttention,
            AttentionType::CompressedSparseAttention,
            AttentionType::HeavilyCompressedAttention,
            AttentionType::CompressedSparseAttention,
        ],
        csa_rate: 4,
        hca_rate: 16,
        sliding_window: 32,
        o_groups: 2,
        o_lora_rank: 128,
        index_n_heads: 4,
        index_head_dim: 32,
        index_topk: 16,
        hc_mult: 2,
        hc_sinkhorn_iters: 10,
        hc_eps: 1e-6,
        mlp_layer_types: mlp_types(4, 1),
        n_experts: 8,
        top_k: 2,
        expert_ffn_dim: 256,
        n_shared_experts: 1,
        scoring: "sqrtsoftplus".into(),
        routed_scaling_factor: 1.5,
        swiglu_limit: 10.0,
        balance_rate: 1e-3,
        mtp_layers: 0,
        tie_embeddings: false,
        dtype: "f32".into(),
    }
}

/// transformers' `DeepseekV4Config()` defaults: the V4-Flash shape (43 blocks of 4096).
fn flash() -> DeepseekV4Args {
    DeepseekV4Args {
        dim: 4096,
        n_layers: 43,
        n_heads: 64,
        head_dim: 512,
        rope_head_dim: 64,
        q_lora_rank: 1024,
        vocab_size: 129_280,
        norm_eps: 1e-6,
        rope_theta: 10_000.0,
        compress_rope_theta: 160_000.0,
        compress_yarn: Some(YarnScaling {
            factor: 16.0,
            original_max_position_embeddings: 65536,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: Some(1.0),
            mscale: None,
            mscale_all_dim: None,
        }),
        max_seq_len: 1_048_576,
        layer_types: default_layer_types(43),
        csa_rate: 4,
        hca_rate: 128,
        sliding_window: 128,
        o_groups: 8,
        o_lora_rank: 1024,
        index_n_heads: 64,
        index_head_dim: 128,
        index_topk: 512,
        hc_mult: 4,
        hc_sinkhorn_iters: 20,
        hc_eps: 1e-6,
        mlp_layer_types: mlp_types(43, 3),
        n_experts: 256,
        top_k: 6,
        expert_ffn_dim: 2048,
        n_shared_experts: 1,
        scoring: "sqrtsoftplus".into(),
        routed_scaling_factor: 1.5,
        swiglu_limit: 10.0,
        balance_rate: 0.0,
        // The release has one MTP module; transformers (whose count this matches) builds none.
        mtp_layers: 0,
        tie_embeddings: false,
        dtype: "bf16".into(),
    }
}

anneal_plugin_api::flavors! {
    /// Flavor `name`.
    pub fn flavor -> DeepseekV4Args;
    "debugmodel" => debugmodel(),
    "deepseek_v4_flash" => flash(),
}

/// Arguments from a Hugging Face `config.json` of model type `deepseek_v4`. A key that is
/// absent takes transformers' default; a key of the wrong type is reported as such.
pub fn from_hf_config(c: &serde_json::Value) -> Result<DeepseekV4Args, String> {
    let f = HfConfig::new(c);
    if let Some(t) = f.str("model_type")? {
        if t != "deepseek_v4" {
            return Err(format!(
                "config.json: model_type '{t}' is not served by this plugin (deepseek_v4)"
            ));
        }
    }
    let mut a = DeepseekV4Args::from_hf(&f)?;
    if f.get("qk_rope_head_dim").is_none() {
        if let Some(p) = f.float("partial_rotary_factor")? {
            a.rope_head_dim = (a.head_dim as f64 * p) as usize;
        }
    }
    // DeepSeek's own config.json (before transformers' names) gives the rates as
    // `compress_rate_csa` / `compress_rate_hca`, the layer pattern as per-layer
    // `compress_ratios` (0, 4, 128) and the hash-routed blocks as `num_hash_layers`.
    let rates = match f.get("compress_rates") {
        Some(_) => Some(f.object("compress_rates")?),
        None => None,
    };
    let rate = |k: &str, legacy: &str, d: usize| -> Result<usize, String> {
        let nested = rates.as_ref().map(|r| r.uint(k)).transpose()?.flatten();
        Ok(f.uint(legacy)?.or(nested).unwrap_or(d))
    };
    a.csa_rate = rate("compressed_sparse_attention", "compress_rate_csa", 4)?;
    a.hca_rate = rate("heavily_compressed_attention", "compress_rate_hca", 128)?;
    if let (None, Some(ratios)) = (f.get("layer_types"), f.uint_list("compress_ratios")?) {
        a.layer_types = ratios
            .iter()
            .map(|r| match r {
                0 => Ok(AttentionType::SlidingAttention),
                4 => Ok(AttentionType::CompressedSparseAttention),
                128 => Ok(AttentionType::HeavilyCompressedAttention),
                r => Err(format!(
                    "config.json: compress_ratios holds {r}; expected 0, 4 or 128"
                )),
            })
            .collect::<Result<_, _>>()?;
    }
    a.layer_types.truncate(a.n_layers);
    if f.get("mlp_layer_types").is_none() {
        if let Some(h) = f.uint("num_hash_layers")? {
            a.mlp_layer_types = mlp_types(a.n_layers, h);
        }
    }
    // transformers 5 nests the two RoPEs as `rope_parameters.{main, compress}`.
    if let Some(comp) = c
        .pointer("/rope_parameters/compress")
        .filter(|v| v.is_object())
    {
        let wrapped = serde_json::json!({
            "rope_parameters": comp,
            "max_position_embeddings": c.get("max_position_embeddings"),
        });
        let r = HfConfig::new(&wrapped).rope(a.compress_rope_theta)?;
        a.compress_rope_theta = r.theta;
        a.compress_yarn = r.yarn;
    }
    if matches!(f.str("dtype")?.or(f.str("torch_dtype")?), Some("bfloat16")) {
        a.dtype = "bf16".into();
    }
    Ok(a)
}
