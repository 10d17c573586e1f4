//! Model arguments, the named flavors and the reading of a Hugging Face `config.json`
//! (transformers' `deepseek_v4`).

use anneal_plugin_api::sdk::{checks, HfConfig, YarnScaling};
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

/// Everything that defines a DeepSeek-V4 model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeepseekV4Args {
    /// Hidden size.
    pub dim: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Query heads (one key/value head is shared by all).
    pub n_heads: usize,
    /// Per-head size of queries, keys and values.
    pub head_dim: usize,
    /// The trailing dims of each head that RoPE rotates (`qk_rope_head_dim`).
    pub rope_head_dim: usize,
    /// Rank of the low-rank query projection.
    pub q_lora_rank: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// RoPE base of the sliding-window blocks.
    pub rope_theta: f64,
    /// RoPE base of the compressed blocks, their compressors and indexers.
    pub compress_rope_theta: f64,
    /// YaRN scaling of the compressed blocks' RoPE.
    #[serde(default)]
    pub compress_yarn: Option<YarnScaling>,
    /// Longest sequence.
    pub max_seq_len: usize,
    /// Each block's attention.
    pub layer_types: Vec<AttentionType>,
    /// Tokens per compressed block in CSA blocks.
    pub csa_rate: usize,
    /// Tokens per compressed block in HCA blocks.
    pub hca_rate: usize,
    /// The sliding window (tokens, including the query's own).
    pub sliding_window: usize,
    /// Head groups of the grouped output projection.
    pub o_groups: usize,
    /// Per-group rank of the grouped output projection.
    pub o_lora_rank: usize,
    /// The indexer's query heads.
    pub index_n_heads: usize,
    /// The indexer's head size.
    pub index_head_dim: usize,
    /// Compressed blocks each query keeps in CSA blocks.
    pub index_topk: usize,
    /// Residual streams of the hyper-connections.
    pub hc_mult: usize,
    /// Sinkhorn iterations of the residual mixing matrix.
    pub hc_sinkhorn_iters: usize,
    /// Floor of the hyper-connection weights and Sinkhorn's denominators.
    pub hc_eps: f64,
    /// Each block's expert choice.
    pub mlp_layer_types: Vec<MlpType>,
    /// Routed experts per block.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Hidden size of one expert, the shared one included (`moe_intermediate_size`).
    pub expert_ffn_dim: usize,
    /// `n_shared_experts` of the config (transformers builds one shared expert whatever it says).
    pub n_shared_experts: usize,
    /// Router scores: `sqrtsoftplus`, `softmax` or `sigmoid`.
    pub scoring: String,
    /// Factor on the routing weights.
    pub routed_scaling_factor: f64,
    /// Clamp of the experts' gate (above) and up (both sides) products.
    pub swiglu_limit: f64,
    /// Step of the aux-loss-free balancing bias per optimizer step (0: fixed).
    #[serde(default)]
    pub balance_rate: f64,
    /// Multi-token prediction modules (`num_nextn_predict_layers`; 0 or 1), as DeepSeek-V3's:
    /// in training, one more block predicts the token after next, its loss an auxiliary loss
    /// `mtp` (weighted by `training.aux_loss_weights.mtp`) and logged as `mtp_loss`; off at
    /// inference and decode.
    #[serde(default)]
    pub mtp_layers: usize,
    /// Share the embedding table with the output projection.
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Parameter dtype (`f32` or `bf16`).
    #[serde(default = "f32_name")]
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

    /// Refuses arguments the model cannot be built from, naming the key.
    pub fn validate(&self) -> Result<(), String> {
        checks::at_least_one(&[
            ("dim", self.dim),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("head_dim", self.head_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("vocab_size", self.vocab_size),
            ("max_seq_len", self.max_seq_len),
            ("csa_rate", self.csa_rate),
            ("hca_rate", self.hca_rate),
            ("sliding_window", self.sliding_window),
            ("o_groups", self.o_groups),
            ("o_lora_rank", self.o_lora_rank),
            ("index_n_heads", self.index_n_heads),
            ("index_head_dim", self.index_head_dim),
            ("index_topk", self.index_topk),
            ("hc_mult", self.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
            ("n_experts", self.n_experts),
            ("top_k", self.top_k),
            ("expert_ffn_dim", self.expert_ffn_dim),
        ])?;
        checks::finite_non_negative(&[
            ("norm_eps", self.norm_eps),
            ("hc_eps", self.hc_eps),
            ("balance_rate", self.balance_rate),
        ])?;
        checks::finite_positive(&[
            ("rope_theta", self.rope_theta),
            ("compress_rope_theta", self.compress_rope_theta),
            ("routed_scaling_factor", self.routed_scaling_factor),
            ("swiglu_limit", self.swiglu_limit),
        ])?;
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
        if !["sqrtsoftplus", "softmax", "sigmoid"].contains(&self.scoring.as_str()) {
            return Err(format!(
                "scoring '{}' is not one of sqrtsoftplus, softmax, sigmoid",
                self.scoring
            ));
        }
        if self.mtp_layers > 1 {
            return Err(format!(
                "mtp_layers = {} is not supported (0 or 1)",
                self.mtp_layers
            ));
        }
        if !["f32", "bf16"].contains(&self.dtype.as_str()) {
            return Err(format!("dtype '{}' is not f32 or bf16", self.dtype));
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

/// transformers' default: the first three blocks hash-routed, the rest learned.
fn default_mlp_types(n: usize) -> Vec<MlpType> {
    (0..n)
        .map(|i| {
            if i < 3 {
                MlpType::HashMoe
            } else {
                MlpType::Moe
            }
        })
        .collect()
}

/// The named flavors.
pub const FLAVORS: &[&str] = &["debugmodel", "deepseek_v4_flash"];

/// Flavor `name`.
pub fn flavor(name: &str) -> Option<DeepseekV4Args> {
    // Small enough that 300 steps of 8 x 256 tokens train in minutes on 2 cores, with every
    // kind of block: blocks of 4 (CSA, top 16 of 64) and 16 (HCA) tokens against a window of
    // 32, two residual streams, a hash-routed first block.
    let debug = DeepseekV4Args {
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
        mlp_layer_types: vec![MlpType::HashMoe, MlpType::Moe, MlpType::Moe, MlpType::Moe],
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
    };
    let yarn = YarnScaling {
        factor: 16.0,
        original_max_position_embeddings: 65536,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: Some(1.0),
        mscale: None,
        mscale_all_dim: None,
    };
    // transformers' `DeepseekV4Config()` defaults: the V4-Flash shape (43 blocks of 4096).
    let flash = DeepseekV4Args {
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
        compress_yarn: Some(yarn),
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
        mlp_layer_types: default_mlp_types(43),
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
    };
    Some(match name {
        "debugmodel" => debug,
        "deepseek_v4_flash" => flash,
        _ => return None,
    })
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
    let n_layers = f.uint("num_hidden_layers")?.unwrap_or(43);
    let head_dim = f.uint("head_dim")?.unwrap_or(512);
    let rope_head_dim = match f.uint("qk_rope_head_dim")? {
        Some(r) => r,
        None => {
            let factor = f.float("partial_rotary_factor")?.unwrap_or(64.0 / 512.0);
            (head_dim as f64 * factor) as usize
        }
    };
    let rates = match f.get("compress_rates") {
        Some(_) => Some(f.object("compress_rates")?),
        None => None,
    };
    // DeepSeek's own config.json (before transformers' names) gives the rates as
    // `compress_rate_csa` / `compress_rate_hca`, the layer pattern as per-layer
    // `compress_ratios` (0, 4, 128) and the hash-routed blocks as `num_hash_layers`.
    let rate = |k: &str, legacy: &str, d: usize| -> Result<usize, String> {
        if let Some(r) = f.uint(legacy)? {
            return Ok(r);
        }
        Ok(match &rates {
            Some(r) => r.uint(k)?.unwrap_or(d),
            None => d,
        })
    };
    let layer_types = match (f.str_list("layer_types")?, f.uint_list("compress_ratios")?) {
        (Some(v), _) => v
            .iter()
            .map(|s| serde_json::from_value(serde_json::Value::String(s.to_string())))
            .collect::<Result<Vec<AttentionType>, _>>()
            .map_err(|e| format!("config.json: layer_types: {e}"))?,
        (None, Some(ratios)) => ratios
            .iter()
            .map(|r| match r {
                0 => Ok(AttentionType::SlidingAttention),
                4 => Ok(AttentionType::CompressedSparseAttention),
                128 => Ok(AttentionType::HeavilyCompressedAttention),
                r => Err(format!(
                    "config.json: compress_ratios holds {r}; expected 0, 4 or 128"
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        (None, None) => default_layer_types(n_layers),
    };
    let layer_types: Vec<AttentionType> = layer_types.into_iter().take(n_layers).collect();
    let mlp_layer_types = match f.str_list("mlp_layer_types")? {
        Some(v) => v
            .iter()
            .map(|s| serde_json::from_value(serde_json::Value::String(s.to_string())))
            .collect::<Result<Vec<MlpType>, _>>()
            .map_err(|e| format!("config.json: mlp_layer_types: {e}"))?,
        None => match f.uint("num_hash_layers")? {
            Some(h) => (0..n_layers)
                .map(|i| {
                    if i < h {
                        MlpType::HashMoe
                    } else {
                        MlpType::Moe
                    }
                })
                .collect(),
            None => default_mlp_types(n_layers),
        },
    };
    let rope_theta = f.float("rope_theta")?.unwrap_or(10_000.0);
    let mut compress_rope_theta = f.float("compress_rope_theta")?.unwrap_or(160_000.0);
    let mut compress_yarn = None;
    // transformers 5 nests the two RoPEs as `rope_parameters.{main, compress}`.
    if let Some(rp) = c.get("rope_parameters").filter(|v| v.is_object()) {
        if let Some(comp) = rp.get("compress").filter(|v| v.is_object()) {
            let wrapped = serde_json::json!({
                "rope_parameters": comp,
                "max_position_embeddings": c.get("max_position_embeddings"),
            });
            let r = HfConfig::new(&wrapped).rope(compress_rope_theta)?;
            compress_rope_theta = r.theta;
            compress_yarn = r.yarn;
        }
    }
    let tie = f.bool("tie_word_embeddings")?.unwrap_or(false);
    let dtype = match f.str("dtype")?.or(f.str("torch_dtype")?) {
        Some("bfloat16") => "bf16",
        _ => "f32",
    };
    Ok(DeepseekV4Args {
        dim: f.uint("hidden_size")?.unwrap_or(4096),
        n_layers,
        n_heads: f.uint("num_attention_heads")?.unwrap_or(64),
        head_dim,
        rope_head_dim,
        q_lora_rank: f.uint("q_lora_rank")?.unwrap_or(1024),
        vocab_size: f.uint("vocab_size")?.unwrap_or(129_280),
        norm_eps: f.float("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        compress_rope_theta,
        compress_yarn,
        max_seq_len: f.uint("max_position_embeddings")?.unwrap_or(1_048_576),
        layer_types,
        csa_rate: rate("compressed_sparse_attention", "compress_rate_csa", 4)?,
        hca_rate: rate("heavily_compressed_attention", "compress_rate_hca", 128)?,
        sliding_window: f.uint("sliding_window")?.unwrap_or(128),
        o_groups: f.uint("o_groups")?.unwrap_or(8),
        o_lora_rank: f.uint("o_lora_rank")?.unwrap_or(1024),
        index_n_heads: f.uint("index_n_heads")?.unwrap_or(64),
        index_head_dim: f.uint("index_head_dim")?.unwrap_or(128),
        index_topk: f.uint("index_topk")?.unwrap_or(512),
        hc_mult: f.uint("hc_mult")?.unwrap_or(4),
        hc_sinkhorn_iters: f.uint("hc_sinkhorn_iters")?.unwrap_or(20),
        hc_eps: f.float("hc_eps")?.unwrap_or(1e-6),
        mlp_layer_types,
        n_experts: f.uint("n_routed_experts")?.unwrap_or(256),
        top_k: f.uint("num_experts_per_tok")?.unwrap_or(6),
        expert_ffn_dim: f.uint("moe_intermediate_size")?.unwrap_or(2048),
        n_shared_experts: f.uint("n_shared_experts")?.unwrap_or(1),
        scoring: f.str("scoring_func")?.unwrap_or("sqrtsoftplus").to_string(),
        routed_scaling_factor: f.float("routed_scaling_factor")?.unwrap_or(1.5),
        swiglu_limit: f.float("swiglu_limit")?.unwrap_or(10.0),
        balance_rate: 0.0,
        // transformers' checkpoints carry no MTP weights (it drops DeepSeek's `mtp.*` on load),
        // whatever `num_nextn_predict_layers` says.
        mtp_layers: 0,
        tie_embeddings: tie,
        dtype: dtype.into(),
    })
}
