//! Kimi K3's arguments, its flavors and the reader of its Hugging Face `config.json`: each
//! argument declared once with its `config.json` key and its checks (the SDK's model kit).

use anneal_plugin_api::sdk::kit::kda::{KdaDecay, KdaShape};
use anneal_plugin_api::sdk::kit::mla::MlaShape;
use anneal_plugin_api::sdk::kit::{check, ModelArgs};
use anneal_plugin_api::sdk::HfConfig;
use serde::{Deserialize, Serialize};

/// Everything that defines a Kimi K3 model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct KimiK3Args {
    /// Hidden size.
    #[arg(hf = "hidden_size", min = 1)]
    pub dim: usize,
    /// Number of blocks.
    #[arg(hf = "num_hidden_layers", min = 1)]
    pub n_layers: usize,
    /// Vocabulary size.
    #[arg(hf = "vocab_size", min = 1)]
    pub vocab_size: usize,
    /// RMSNorm epsilon of the blocks, the residual mixes, the experts' latent and the final norm.
    #[arg(hf = "rms_norm_eps", default = 1e-5, positive)]
    pub norm_eps: f64,
    /// Longest sequence.
    #[arg(hf = "max_position_embeddings", default = 262_144, min = 1)]
    pub max_seq_len: usize,
    /// Hidden size of the dense blocks' SiTU-GLU feed-forward.
    #[arg(hf = "intermediate_size", min = 1)]
    pub ffn_dim: usize,
    /// Blocks per residual block: block `i` with `i % attn_res_block == 0` files the residual
    /// stream so far into the bank the later blocks attend over.
    #[arg(hf = "attn_res_block_size", default = 12, min = 1)]
    pub attn_res_block: usize,
    /// Each block's token mixer: Kimi Delta Attention or MLA.
    #[arg(hf = "layer_types", one_of("linear_attention", "full_attention"))]
    pub layer_types: Vec<String>,
    /// Each block's feed-forward: a dense SiTU-GLU or the latent mixture of experts.
    #[arg(hf = "mlp_layer_types", one_of("dense", "sparse"))]
    pub mlp_layer_types: Vec<String>,
    /// MLA heads.
    #[arg(hf = "num_attention_heads", min = 1)]
    pub n_heads: usize,
    /// Rank of MLA's query compression.
    #[arg(hf = "q_lora_rank", min = 1)]
    pub q_lora_rank: usize,
    /// Rank of MLA's key/value compression: the latent a token caches.
    #[arg(hf = "kv_lora_rank", min = 1)]
    pub kv_lora_rank: usize,
    /// Per-head query/key dims of MLA's per-head part.
    #[arg(hf = "qk_nope_head_dim", min = 1)]
    pub qk_nope_head_dim: usize,
    /// Per-head query/key dims of the key part shared by the heads (no RoPE is applied).
    #[arg(hf = "qk_rope_head_dim", min = 1)]
    pub qk_rope_head_dim: usize,
    /// Per-head value dims of MLA.
    #[arg(hf = "v_head_dim", min = 1)]
    pub v_head_dim: usize,
    /// KDA heads (queries, keys and values alike).
    #[arg(hf = "linear_attn_key_heads", min = 1)]
    pub kda_heads: usize,
    /// KDA dims per head (queries, keys and values alike).
    #[arg(hf = "linear_attn_key_head_dim", min = 1)]
    pub kda_head_dim: usize,
    /// Kernel of KDA's causal depthwise convolutions.
    #[arg(hf = "conv_kernel_size", default = 4, min = 1)]
    pub conv_kernel: usize,
    /// KDA's forget gate bounded in `(lb, 0)` by a sigmoid (`None`: Kimi Linear's
    /// softplus gate).
    #[serde(default)]
    #[arg(hf = "forget_gate_lower_bound")]
    pub forget_gate_lower_bound: Option<f64>,
    /// Routed experts per sparse block.
    #[arg(hf = "n_routed_experts", min = 1)]
    pub n_experts: usize,
    /// Experts each token is sent to.
    #[arg(hf = "num_experts_per_tok", min = 1)]
    pub top_k: usize,
    /// Expert groups; 1 routes over all experts.
    #[arg(hf = "n_group", default = 1, min = 1)]
    pub n_group: usize,
    /// Groups a token may choose from.
    #[arg(hf = "topk_group", default = 1, min = 1)]
    pub topk_group: usize,
    /// Renormalise the chosen experts' weights to sum to 1.
    #[arg(hf = "norm_topk_prob", default = true)]
    pub norm_topk_prob: bool,
    /// Factor on the routed experts' weights.
    #[arg(hf = "routed_scaling_factor", default = 1.0, positive)]
    pub routed_scaling_factor: f64,
    /// Shared experts every token goes through, fused into one of `n_shared · expert_ffn_dim`.
    #[arg(hf = "n_shared_experts", default = 0)]
    pub n_shared_experts: usize,
    /// Hidden size of one expert.
    #[arg(hf = "moe_intermediate_size", min = 1)]
    pub expert_ffn_dim: usize,
    /// The latent width the routed experts run in.
    #[arg(hf = "routed_expert_hidden_size", min = 1)]
    pub latent_dim: usize,
    /// SiTU's `β` (the gate's soft cap).
    #[arg(hf = "activation_situ_beta", default = 4.0, positive)]
    pub situ_beta: f64,
    /// SiTU's soft cap on the linear branch (`None`: none).
    #[serde(default)]
    #[arg(hf = "activation_situ_linear_beta")]
    pub situ_linear_beta: Option<f64>,
    /// Share the embedding table with the output projection.
    #[arg(hf = "tie_word_embeddings", default = false)]
    pub tie_embeddings: bool,
    /// Parameter dtype (`f32` or `bf16`).
    #[arg(default = f32_name(), one_of("f32", "bf16"))]
    pub dtype: String,
}

fn f32_name() -> String {
    "f32".into()
}

impl KimiK3Args {
    /// Whether block `i` is Kimi Delta Attention (else MLA).
    pub fn is_kda(&self, i: usize) -> bool {
        self.layer_types
            .get(i)
            .is_some_and(|t| t == "linear_attention")
    }

    /// Whether block `i` routes over experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.mlp_layer_types.get(i).is_some_and(|t| t == "sparse")
    }

    /// Whether block `i` files the residual stream into the bank.
    pub fn opens_block(&self, i: usize) -> bool {
        i.is_multiple_of(self.attn_res_block)
    }

    /// KDA's shapes.
    pub fn kda_shape(&self) -> KdaShape {
        KdaShape {
            n_heads: self.kda_heads,
            head_dim: self.kda_head_dim,
            conv_kernel: self.conv_kernel,
        }
    }

    /// KDA's decay gate.
    pub fn kda_decay(&self) -> KdaDecay {
        match self.forget_gate_lower_bound {
            Some(lb) => KdaDecay::LowerBound(lb),
            None => KdaDecay::Softplus,
        }
    }

    /// MLA's shapes.
    pub fn mla_shape(&self) -> MlaShape {
        MlaShape {
            n_heads: self.n_heads,
            q_lora_rank: Some(self.q_lora_rank),
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
        }
    }

    /// Checks the arguments fit together, naming the one that does not: the per-field checks,
    /// then what they cannot see.
    pub fn validate(&self) -> Result<(), String> {
        self.check()?;
        for (what, list) in [
            ("layer_types", &self.layer_types),
            ("mlp_layer_types", &self.mlp_layer_types),
        ] {
            if list.len() != self.n_layers {
                return Err(format!(
                    "{what} lists {} blocks, the model has {} (n_layers)",
                    list.len(),
                    self.n_layers
                ));
            }
        }
        if let Some(lb) = self.forget_gate_lower_bound {
            if !(lb.is_finite() && lb < 0.0) {
                return Err(format!(
                    "forget_gate_lower_bound = {lb} must be below 0 (the log decay lies in (lb, 0))"
                ));
            }
        }
        if let Some(c) = self.situ_linear_beta {
            if !(c.is_finite() && c > 0.0) {
                return Err(format!("situ_linear_beta = {c} must be positive"));
            }
        }
        check::group_routing(
            self.n_experts,
            self.top_k,
            self.n_group,
            self.topk_group,
            ["n_experts", "top_k"],
        )?;
        Ok(())
    }
}

/// The layer pattern of the released model: MLA in blocks 3, 7, .., 91 and the last (0-based),
/// KDA elsewhere; the first block dense.
fn released_layer_types(n_layers: usize) -> (Vec<String>, Vec<String>) {
    let mla = |i: usize| i % 4 == 3 || i + 1 == n_layers;
    let mixers = (0..n_layers)
        .map(|i| {
            if mla(i) {
                "full_attention"
            } else {
                "linear_attention"
            }
            .to_string()
        })
        .collect();
    let ffns = (0..n_layers)
        .map(|i| if i == 0 { "dense" } else { "sparse" }.to_string())
        .collect();
    (mixers, ffns)
}

/// Kimi K3 as released: hidden 7168, 93 blocks (24 MLA, 69 KDA), 96 MLA heads over a 512-rank
/// latent (queries through 1536), 96 KDA heads of 128 with the forget gate bounded by −5,
/// 896 experts of 3072 (top 16) in a 3584-wide latent plus two shared, SiTU(4, 25), residual
/// blocks of 12.
pub fn kimi_k3() -> KimiK3Args {
    let n_layers = 93;
    let (layer_types, mlp_layer_types) = released_layer_types(n_layers);
    KimiK3Args {
        dim: 7168,
        n_layers,
        vocab_size: 163_840,
        norm_eps: 1e-5,
        max_seq_len: 262_144,
        ffn_dim: 33_792,
        attn_res_block: 12,
        layer_types,
        mlp_layer_types,
        n_heads: 96,
        q_lora_rank: 1536,
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        kda_heads: 96,
        kda_head_dim: 128,
        conv_kernel: 4,
        forget_gate_lower_bound: Some(-5.0),
        n_experts: 896,
        top_k: 16,
        n_group: 1,
        topk_group: 1,
        norm_topk_prob: true,
        routed_scaling_factor: 1.0,
        n_shared_experts: 2,
        expert_ffn_dim: 3072,
        latent_dim: 3584,
        situ_beta: 4.0,
        situ_linear_beta: Some(25.0),
        tie_embeddings: false,
        dtype: "bf16".into(),
    }
}

/// The debug Kimi K3: hidden 256, 6 blocks in residual blocks of 2 (KDA of 4 heads of 64 in
/// blocks 0–2 and 4, MLA of 4 heads in 3 and 5), block 0 dense, then 8 experts of 128 (top 2)
/// in a 128-wide latent plus one shared.
pub fn debugmodel() -> KimiK3Args {
    let s = |l: &[&str]| l.iter().map(|t| t.to_string()).collect::<Vec<_>>();
    KimiK3Args {
        dim: 256,
        n_layers: 6,
        vocab_size: 8192,
        max_seq_len: 2048,
        ffn_dim: 512,
        attn_res_block: 2,
        layer_types: s(&[
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ]),
        mlp_layer_types: s(&["dense", "sparse", "sparse", "sparse", "sparse", "sparse"]),
        n_heads: 4,
        q_lora_rank: 64,
        kv_lora_rank: 32,
        qk_nope_head_dim: 32,
        qk_rope_head_dim: 16,
        v_head_dim: 32,
        kda_heads: 4,
        kda_head_dim: 64,
        n_experts: 8,
        top_k: 2,
        n_shared_experts: 1,
        expert_ffn_dim: 128,
        latent_dim: 128,
        dtype: "f32".into(),
        ..kimi_k3()
    }
}

anneal_plugin_api::flavors! {
    /// The named flavors.
    pub fn flavor -> KimiK3Args;
    "debugmodel" => debugmodel(),
    "kimi_k3" => kimi_k3(),
}

/// Arguments from a Hugging Face `kimi_k3` `config.json`.
pub fn from_hf_config(c: &serde_json::Value) -> Result<KimiK3Args, String> {
    let f = HfConfig::new(c);
    match f.str("model_type")? {
        Some("kimi_k3") | None => {}
        Some(other) => {
            return Err(format!(
                "config.json: model_type '{other}' is not served by this plugin (kimi_k3)"
            ))
        }
    }
    if f.bool("attention_bias")?.unwrap_or(false) {
        return Err("config.json: attention_bias = true is not supported".into());
    }
    if let Some(act) = f.str("hidden_act")? {
        if act != "situ" {
            return Err(format!(
                "config.json: hidden_act '{act}' is not supported (situ)"
            ));
        }
    }
    if f.bool("use_full_rank_output_gate")? == Some(false) {
        return Err("config.json: use_full_rank_output_gate = false is not supported (KDA's output gate is one full-rank projection)".into());
    }
    let args = KimiK3Args::from_hf(&f)?;
    for (key, want, what) in [
        (
            "num_key_value_heads",
            args.n_heads,
            "num_attention_heads (MLA expands the latent into one key/value head per query head)",
        ),
        (
            "linear_attn_value_heads",
            args.kda_heads,
            "linear_attn_key_heads (KDA's decay is per key channel)",
        ),
        (
            "linear_attn_value_head_dim",
            args.kda_head_dim,
            "linear_attn_key_head_dim (KDA's decay is per key channel)",
        ),
    ] {
        if let Some(v) = f.uint(key)? {
            if v != want {
                return Err(format!(
                    "config.json: {key} = {v} must equal {what} = {want}"
                ));
            }
        }
    }
    args.validate().map_err(|e| format!("config.json: {e}"))?;
    Ok(args)
}
