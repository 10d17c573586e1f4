//! Model arguments and the named flavors: each argument is declared once, with its
//! `config.json` key and its checks (the SDK's model kit).

use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::{HfConfig, Llama3Scaling, YarnScaling};
use serde::{Deserialize, Serialize};

/// Everything that defines a Llama-family model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct LlamaArgs {
    /// Hidden size.
    #[arg(hf = "hidden_size", min = 1)]
    pub dim: usize,
    /// Number of blocks.
    #[arg(hf = "num_hidden_layers")]
    pub n_layers: usize,
    /// Query heads.
    #[arg(hf = "num_attention_heads")]
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    #[arg(hf = "num_key_value_heads", default = n_heads)]
    pub n_kv_heads: usize,
    /// Per-head size; `dim / n_heads` when absent (Qwen3 sets it explicitly).
    #[serde(default)]
    #[arg(hf = "head_dim")]
    pub head_dim: Option<usize>,
    /// Hidden size of the SwiGLU feed-forward.
    #[arg(hf = "intermediate_size", min = 1)]
    pub ffn_dim: usize,
    /// Vocabulary size.
    #[arg(hf = "vocab_size", min = 1)]
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    #[arg(hf = "rms_norm_eps", default = 1e-5, non_negative)]
    pub norm_eps: f64,
    /// RoPE base.
    #[arg(rope = theta, default = 10_000.0)]
    pub rope_theta: f64,
    /// Llama-3 RoPE scaling, if any.
    #[serde(default)]
    #[arg(rope = llama3)]
    pub rope_scaling: Option<Llama3Scaling>,
    /// YaRN RoPE scaling, if any (exclusive with `rope_scaling`).
    #[serde(default)]
    #[arg(rope = yarn)]
    pub yarn: Option<YarnScaling>,
    /// Longest sequence.
    #[arg(hf = "max_position_embeddings", default = 2048, min = 1)]
    pub max_seq_len: usize,
    /// Share the embedding table with the output projection.
    #[arg(hf = "tie_word_embeddings", default = false)]
    pub tie_embeddings: bool,
    /// Per-head RMSNorm of queries and keys (Qwen3).
    #[serde(default)]
    pub qk_norm: bool,
    /// Sliding-window size for the layers listed in `sliding_layers` (Qwen3 variants).
    #[serde(default)]
    #[arg(hf = "sliding_window", min = 1)]
    pub sliding_window: Option<usize>,
    /// Which layers use the sliding window (all, when `sliding_window` is set and this is empty).
    #[serde(default)]
    pub sliding_layers: Vec<usize>,
    /// Parameter dtype (`f32` or `bf16`).
    #[serde(default = "f32_name")]
    #[arg(default = f32_name(), one_of("f32", "bf16"))]
    pub dtype: String,
    /// Name written to Hugging Face `config.json` (`llama`, `qwen3` or `qwen3_moe`).
    #[serde(default = "llama_name")]
    pub hf_model_type: String,
    /// A mixture-of-experts feed-forward in the sparse layers (Qwen3-MoE).
    #[serde(default)]
    #[arg(nested)]
    pub moe: Option<MoeArgs>,
    /// Qwen3-VL's vision tower and image token (`None`: a text model).
    #[serde(default)]
    pub vision: Option<crate::vl::VlArgs>,
}

/// The mixture-of-experts feed-forward of Qwen3-MoE: a softmax top-k router over `n_experts`
/// SwiGLU experts, dropless.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct MoeArgs {
    /// Experts per sparse layer (`num_experts`).
    #[arg(hf = "num_experts", default = 0, min = 1)]
    pub n_experts: usize,
    /// Experts each token is sent to (`num_experts_per_tok`).
    #[arg(hf = "num_experts_per_tok", min = 1)]
    pub top_k: usize,
    /// Hidden size of one expert (`moe_intermediate_size`).
    #[arg(hf = "moe_intermediate_size", min = 1)]
    pub expert_ffn_dim: usize,
    /// Renormalise the chosen experts' weights to sum to 1 (`norm_topk_prob`).
    #[serde(default)]
    #[arg(hf = "norm_topk_prob", default = false)]
    pub norm_topk_prob: bool,
    /// Every `sparse_step`-th layer is sparse (`decoder_sparse_step`; layer `i` when
    /// `(i + 1) % sparse_step == 0`).
    #[serde(default = "one")]
    #[arg(hf = "decoder_sparse_step", default = 1, min = 1)]
    pub sparse_step: usize,
    /// Layers that keep the dense feed-forward (`mlp_only_layers`).
    #[serde(default)]
    #[arg(hf = "mlp_only_layers", default = vec![])]
    pub dense_layers: Vec<usize>,
    /// Coefficient of the load-balancing loss (0: none).
    #[serde(default)]
    #[arg(hf = "router_aux_loss_coef", default = 0.001, non_negative)]
    pub aux_loss_coef: f64,
    /// Aux-loss-free balancing (DeepSeek-V3): after each step every expert's routing bias moves
    /// by this much towards balance, `bias += u · sign(mean − tokens)` (mean-centred); 0: off.
    #[serde(default)]
    #[arg(non_negative)]
    pub balance_rate: f64,
}

fn one() -> usize {
    1
}

fn f32_name() -> String {
    "f32".into()
}

fn llama_name() -> String {
    "llama".into()
}

impl LlamaArgs {
    /// Per-head size.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.dim / self.n_heads)
    }

    /// The MoE settings of layer `i` when it is sparse.
    pub fn moe_of(&self, i: usize) -> Option<&MoeArgs> {
        let m = self.moe.as_ref()?;
        (!m.dense_layers.contains(&i) && (i + 1).is_multiple_of(m.sparse_step)).then_some(m)
    }

    /// The sliding window of layer `i`, if it has one.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        let w = self.sliding_window?;
        (self.sliding_layers.is_empty() || self.sliding_layers.contains(&i)).then_some(w)
    }

    /// Checks the arguments fit together.
    pub fn validate(&self) -> Result<(), String> {
        self.check()?;
        if let Some(l) = self.sliding_layers.iter().find(|&&l| l >= self.n_layers) {
            return Err(format!(
                "sliding_layers names layer {l}, the model has {} layers",
                self.n_layers
            ));
        }
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return Err(format!(
                "n_heads ({}) must be a positive multiple of n_kv_heads ({})",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim.is_none() && !self.dim.is_multiple_of(self.n_heads) {
            return Err(format!(
                "dim ({}) must be divisible by n_heads ({})",
                self.dim, self.n_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim()
            ));
        }
        if let Some(m) = &self.moe {
            m.validate(self.n_layers)?;
        }
        if let Some(v) = &self.vision {
            v.validate(&crate::vl::text_shape(self))?;
        }
        Ok(())
    }
}

impl MoeArgs {
    /// `n_experts` experts of `expert_ffn_dim` in every layer, `top_k` per token with their
    /// weights renormalised, a load-balancing loss of `aux_loss_coef`, no aux-loss-free bias.
    pub fn routed(
        n_experts: usize,
        top_k: usize,
        expert_ffn_dim: usize,
        aux_loss_coef: f64,
    ) -> Self {
        MoeArgs {
            n_experts,
            top_k,
            expert_ffn_dim,
            norm_topk_prob: true,
            sparse_step: 1,
            dense_layers: vec![],
            aux_loss_coef,
            balance_rate: 0.0,
        }
    }

    /// Checks what the per-field checks cannot: the top-k fits the experts and the dense
    /// layers the model's `n_layers`.
    pub fn validate(&self, n_layers: usize) -> Result<(), String> {
        self.check_at("moe.")?;
        if self.top_k > self.n_experts {
            return Err(format!(
                "moe.top_k (num_experts_per_tok) = {} asks for more experts per token than the {} experts (moe.n_experts)",
                self.top_k, self.n_experts
            ));
        }
        if let Some(l) = self.dense_layers.iter().find(|&&l| l >= n_layers) {
            return Err(format!(
                "moe.dense_layers names layer {l}, the model has {n_layers} layers"
            ));
        }
        Ok(())
    }
}

fn llama3_scaling(factor: f64) -> Option<Llama3Scaling> {
    Some(Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    })
}

/// The debug model: Llama 3's blocks at 8.4M parameters.
fn base() -> LlamaArgs {
    LlamaArgs {
        dim: 256,
        n_layers: 4,
        n_heads: 4,
        n_kv_heads: 4,
        head_dim: None,
        ffn_dim: 1024,
        vocab_size: 8192,
        norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: None,
        yarn: None,
        max_seq_len: 2048,
        tie_embeddings: false,
        qk_norm: false,
        sliding_window: None,
        sliding_layers: vec![],
        dtype: "f32".into(),
        hf_model_type: "llama".into(),
        moe: None,
        vision: None,
    }
}

/// A released Qwen3 size.
fn qwen3(dim: usize, n_layers: usize, n_heads: usize, ffn_dim: usize, tie: bool) -> LlamaArgs {
    LlamaArgs {
        dim,
        n_layers,
        n_heads,
        n_kv_heads: 8,
        head_dim: Some(128),
        ffn_dim,
        vocab_size: 151_936,
        norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        max_seq_len: 40_960,
        tie_embeddings: tie,
        qk_norm: true,
        dtype: "bf16".into(),
        hf_model_type: "qwen3".into(),
        ..base()
    }
}

anneal_plugin_api::flavors! {
    /// The named flavors.
    pub fn flavor -> LlamaArgs;
    "debugmodel" => base(),
    "debugmodel_qwen3" => LlamaArgs {
        qk_norm: true,
        n_kv_heads: 2,
        hf_model_type: "qwen3".into(),
        norm_eps: 1e-6,
        ..base()
    },
    "debugmodel_qwen3_moe" => LlamaArgs {
        qk_norm: true,
        n_kv_heads: 2,
        hf_model_type: "qwen3_moe".into(),
        norm_eps: 1e-6,
        moe: Some(MoeArgs::routed(8, 2, 256, 0.001)),
        ..base()
    },
    "debugmodel_mixtral" => LlamaArgs {
        n_kv_heads: 2,
        ffn_dim: 256,
        rope_theta: 1_000_000.0,
        hf_model_type: "mixtral".into(),
        moe: Some(MoeArgs::routed(8, 2, 256, 0.001)),
        ..base()
    },
    "llama3_1b" => LlamaArgs {
        dim: 2048,
        n_layers: 16,
        n_heads: 32,
        n_kv_heads: 8,
        ffn_dim: 8192,
        vocab_size: 128_256,
        rope_scaling: llama3_scaling(32.0),
        max_seq_len: 131_072,
        tie_embeddings: true,
        dtype: "bf16".into(),
        ..base()
    },
    "llama3_8b" => LlamaArgs {
        dim: 4096,
        n_layers: 32,
        n_heads: 32,
        n_kv_heads: 8,
        ffn_dim: 14_336,
        vocab_size: 128_256,
        rope_scaling: llama3_scaling(8.0),
        max_seq_len: 131_072,
        dtype: "bf16".into(),
        ..base()
    },
    "qwen3_0.6b" => qwen3(1024, 28, 16, 3072, true),
    "qwen3_8b" => qwen3(4096, 36, 32, 12_288, false),
    "qwen3_30b_a3b" => LlamaArgs {
        n_kv_heads: 4,
        max_seq_len: 40_960,
        moe: Some(MoeArgs::routed(128, 8, 768, 0.001)),
        hf_model_type: "qwen3_moe".into(),
        ..qwen3(2048, 48, 32, 6144, false)
    },
    "mixtral_8x7b" => LlamaArgs {
        dim: 4096,
        n_layers: 32,
        n_heads: 32,
        n_kv_heads: 8,
        ffn_dim: 14_336,
        vocab_size: 32_000,
        rope_theta: 1_000_000.0,
        max_seq_len: 32_768,
        dtype: "bf16".into(),
        hf_model_type: "mixtral".into(),
        moe: Some(MoeArgs::routed(8, 2, 14_336, 0.02)),
        ..base()
    },
    "debugmodel_vl" => crate::vl::flavor("debugmodel_vl")?,
    "qwen3_vl_2b" => crate::vl::flavor("qwen3_vl_2b")?,
    "qwen3_vl_8b" => crate::vl::flavor("qwen3_vl_8b")?,
    "qwen3_vl_30b_a3b" => crate::vl::flavor("qwen3_vl_30b_a3b")?,
}

/// Arguments from a Hugging Face `config.json` (`llama`, `qwen3`, `qwen3_moe` and `mixtral`
/// model types). A key that is absent takes its default (or is reported missing when there is
/// none); a key of the wrong type is reported as such, never silently defaulted.
pub fn from_hf_config(c: &serde_json::Value) -> Result<LlamaArgs, String> {
    let f = HfConfig::new(c);
    let model_type = f.str("model_type")?.unwrap_or("llama").to_string();
    if model_type == "qwen3_vl" || model_type == "qwen3_vl_moe" {
        return crate::vl::from_hf_config(c);
    }
    if !matches!(
        model_type.as_str(),
        "llama" | "qwen3" | "qwen3_moe" | "mixtral"
    ) {
        return Err(format!(
            "config.json: model_type '{model_type}' is not served by this plugin (llama, qwen3, qwen3_moe, mixtral, qwen3_vl, qwen3_vl_moe)"
        ));
    }
    let mixtral = model_type == "mixtral";
    let mut args = LlamaArgs::from_hf(&f)?;
    args.qk_norm = matches!(model_type.as_str(), "qwen3" | "qwen3_moe");
    // Mixtral applies `sliding_window` whenever it is set; Qwen3 only with `use_sliding_window`.
    if !(mixtral || f.bool("use_sliding_window")?.unwrap_or(false)) {
        args.sliding_window = None;
    }
    args.moe = match model_type.as_str() {
        "qwen3_moe" => Some(moe_from_hf(&f, args.n_layers, false)?),
        "mixtral" => Some(moe_from_hf(&f, args.n_layers, true)?),
        _ => None,
    };
    args.hf_model_type = model_type;
    if f.bool("attention_bias")?.unwrap_or(false) {
        return Err("config.json: attention_bias = true is not supported".into());
    }
    args.validate().map_err(|e| format!("config.json: {e}"))?;
    Ok(args)
}

/// The expert settings of a `qwen3_moe` or (`mixtral = true`) `mixtral` `config.json`. Mixtral
/// routes in every layer over experts of `intermediate_size`, renormalising the top-k weights. The
/// load-balancing loss counts only when transformers would add it (`output_router_logits`).
fn moe_from_hf(f: &HfConfig<'_>, n_layers: usize, mixtral: bool) -> Result<MoeArgs, String> {
    let mut m = if mixtral {
        MoeArgs::routed(
            0,
            f.need_uint("num_experts_per_tok")?,
            f.need_uint("intermediate_size")?,
            f.float("router_aux_loss_coef")?.unwrap_or(0.001),
        )
    } else {
        MoeArgs::from_hf(f)?
    };
    // transformers 5 writes `num_local_experts`; earlier Qwen3-MoE configs `num_experts`.
    m.n_experts = match f.uint("num_local_experts")? {
        Some(n) => n,
        None => f.need_uint("num_experts")?,
    };
    if !f.bool("output_router_logits")?.unwrap_or(false) {
        m.aux_loss_coef = 0.0;
    }
    m.validate(n_layers)
        .map_err(|e| format!("config.json: {e}"))?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> serde_json::Value {
        json!({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "vocab_size": 100, "rms_norm_eps": 1e-5, "max_position_embeddings": 64
        })
    }

    fn with(k: &str, v: serde_json::Value) -> serde_json::Value {
        let mut c = tiny();
        c[k] = v;
        c
    }

    #[test]
    fn a_tiny_config_reads() {
        let a = from_hf_config(&tiny()).unwrap();
        assert_eq!((a.dim, a.n_kv_heads, a.max_seq_len), (64, 2, 64));
    }

    #[test]
    fn wrong_types_are_not_reported_as_missing_nor_defaulted() {
        for (k, v, found) in [
            ("hidden_size", json!("64"), "a string"),
            ("num_key_value_heads", json!(2.5), "a fractional number"),
            ("head_dim", json!(-8), "a negative integer"),
            ("rms_norm_eps", json!("1e-5"), "a string"),
            ("tie_word_embeddings", json!(1), "an integer"),
            ("rope_scaling", json!([1, 2]), "an array"),
        ] {
            let e = from_hf_config(&with(k, v)).unwrap_err();
            assert!(
                e.contains(&format!("'{k}' has the wrong type"))
                    && e.contains(found)
                    && !e.contains("missing"),
                "{k}: {e}"
            );
        }
        let mut c = tiny();
        c.as_object_mut().unwrap().remove("hidden_size");
        let e = from_hf_config(&c).unwrap_err();
        assert!(e.contains("missing integer 'hidden_size'"), "{e}");
        let c = with(
            "rope_scaling",
            json!({"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        );
        let e = from_hf_config(&c).unwrap_err();
        assert!(
            e.contains("'rope_scaling.factor' has the wrong type"),
            "{e}"
        );
    }

    #[test]
    fn values_out_of_range_are_refused() {
        for (k, v, what) in [
            ("rms_norm_eps", json!(-1e-5), "rms_norm_eps"),
            ("rope_theta", json!(0.0), "rope_theta"),
            ("hidden_size", json!(0), "dim"),
            ("vocab_size", json!(0), "vocab_size"),
        ] {
            let e = from_hf_config(&with(k, v)).unwrap_err();
            assert!(e.contains(what), "{k}: {e}");
        }
    }
}
