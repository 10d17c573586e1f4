//! Model arguments, the named flavors and the reader of a Hugging Face `config.json`.

pub use anneal_plugin_api::sdk::kit::LayerType;
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::{HfConfig, YarnScaling};
use serde::{Deserialize, Serialize};

/// Everything that defines a gpt-oss model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct GptOssArgs {
    /// Hidden size.
    #[arg(hf = "hidden_size", min = 1)]
    pub dim: usize,
    /// Number of blocks.
    #[arg(hf = "num_hidden_layers", min = 1)]
    pub n_layers: usize,
    /// Query heads.
    #[arg(hf = "num_attention_heads")]
    pub n_heads: usize,
    /// Key/value heads.
    #[arg(hf = "num_key_value_heads", default = n_heads)]
    pub n_kv_heads: usize,
    /// Per-head size.
    #[arg(hf = "head_dim", default = dim / n_heads.max(1), min = 1, even)]
    pub head_dim: usize,
    /// Vocabulary size.
    #[arg(hf = "vocab_size", min = 1)]
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    #[arg(hf = "rms_norm_eps", default = 1e-5, non_negative)]
    pub norm_eps: f64,
    /// RoPE base.
    #[arg(rope = theta, default = 150_000.0)]
    pub rope_theta: f64,
    /// YaRN RoPE scaling (gpt-oss extends a 4k context 32×).
    #[serde(default)]
    #[arg(rope = yarn)]
    pub yarn: Option<YarnScaling>,
    /// Longest sequence.
    #[arg(hf = "max_position_embeddings", default = 131_072, min = 1)]
    pub max_seq_len: usize,
    /// Window of the sliding-attention layers.
    #[arg(hf = "sliding_window", default = 128, min = 1)]
    pub sliding_window: usize,
    /// Each block's attention; empty means alternating, sliding first (transformers' default).
    #[serde(default)]
    pub layer_types: Vec<LayerType>,
    /// Experts per block (`num_local_experts`).
    #[arg(hf = "num_local_experts", min = 1)]
    pub n_experts: usize,
    /// Experts each token is sent to (`num_experts_per_tok`).
    #[arg(hf = "num_experts_per_tok", default = 4, min = 1)]
    pub top_k: usize,
    /// Hidden size of one expert (`intermediate_size`).
    #[arg(hf = "intermediate_size", min = 1)]
    pub expert_ffn_dim: usize,
    /// Slope inside the experts' sigmoid (`swiglu_alpha`).
    #[arg(hf = "swiglu_alpha", default = 1.702, positive)]
    pub swiglu_alpha: f64,
    /// Clamp of the experts' gate and up products (`swiglu_limit`).
    #[arg(hf = "swiglu_limit", default = 7.0, positive)]
    pub swiglu_limit: f64,
    /// Coefficient of the load-balancing loss (0: none).
    #[serde(default)]
    #[arg(hf = "router_aux_loss_coef", default = 0.001, non_negative)]
    pub aux_loss_coef: f64,
    /// Aux-loss-free balancing: after each step every expert's routing bias moves by this much
    /// towards balance (0: off).
    #[serde(default)]
    #[arg(non_negative)]
    pub balance_rate: f64,
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

impl GptOssArgs {
    /// The attention of block `i`.
    pub fn layer_type(&self, i: usize) -> LayerType {
        match self.layer_types.get(i) {
            Some(t) => *t,
            None if i.is_multiple_of(2) => LayerType::SlidingAttention,
            None => LayerType::FullAttention,
        }
    }

    /// The sliding window of block `i`, if it has one.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        (self.layer_type(i) == LayerType::SlidingAttention).then_some(self.sliding_window)
    }

    /// Checks the arguments fit together, naming the one that does not.
    pub fn validate(&self) -> Result<(), String> {
        self.check()?;
        if self.top_k > self.n_experts {
            return Err(format!(
                "top_k (num_experts_per_tok) = {} asks for more experts per token than the {} experts (n_experts)",
                self.top_k, self.n_experts
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
        if !self.layer_types.is_empty() && self.layer_types.len() != self.n_layers {
            return Err(format!(
                "layer_types lists {} layers, the model has {}",
                self.layer_types.len(),
                self.n_layers
            ));
        }
        Ok(())
    }
}

/// gpt-oss's YaRN: a 4096-token context stretched 32×.
fn gpt_oss_yarn() -> Option<YarnScaling> {
    Some(YarnScaling {
        factor: 32.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: false,
        attention_factor: None,
        mscale: None,
        mscale_all_dim: None,
    })
}

/// A released size: `n_layers` blocks of `n_experts` experts.
fn released(n_layers: usize, n_experts: usize) -> GptOssArgs {
    GptOssArgs {
        dim: 2880,
        n_layers,
        n_heads: 64,
        n_kv_heads: 8,
        head_dim: 64,
        vocab_size: 201_088,
        norm_eps: 1e-5,
        rope_theta: 150_000.0,
        yarn: gpt_oss_yarn(),
        max_seq_len: 131_072,
        sliding_window: 128,
        layer_types: vec![],
        n_experts,
        top_k: 4,
        expert_ffn_dim: 2880,
        swiglu_alpha: 1.702,
        swiglu_limit: 7.0,
        aux_loss_coef: 0.0,
        balance_rate: 0.0,
        tie_embeddings: false,
        dtype: "bf16".into(),
    }
}

anneal_plugin_api::flavors! {
    /// The named flavors.
    pub fn flavor -> GptOssArgs;
    // The debug Llama's size (hidden 256, 4 blocks, 4 heads) with gpt-oss's blocks: 8
    // experts of 256, top 2, a 128-token window on blocks 0 and 2.
    "debugmodel" => GptOssArgs {
        dim: 256,
        n_layers: 4,
        n_heads: 4,
        n_kv_heads: 2,
        vocab_size: 8192,
        max_seq_len: 2048,
        n_experts: 8,
        top_k: 2,
        expert_ffn_dim: 256,
        aux_loss_coef: 0.001,
        dtype: "f32".into(),
        ..released(4, 8)
    },
    "gpt_oss_20b" => released(24, 32),
    "gpt_oss_120b" => released(36, 128),
}

/// Arguments from a Hugging Face `gpt_oss` `config.json`. A key that is absent takes
/// transformers' default; a key of the wrong type is reported as such.
pub fn from_hf_config(c: &serde_json::Value) -> Result<GptOssArgs, String> {
    let f = HfConfig::new(c);
    let model_type = f.str("model_type")?.unwrap_or("gpt_oss");
    if model_type != "gpt_oss" {
        return Err(format!(
            "config.json: model_type '{model_type}' is not served by this plugin (gpt_oss)"
        ));
    }
    if f.bool("attention_bias")? == Some(false) {
        return Err("config.json: gpt_oss without attention biases is not supported".into());
    }
    let mut args = GptOssArgs::from_hf(&f)?;
    if f.rope(args.rope_theta)?.llama3.is_some() {
        return Err("config.json: gpt_oss with llama3 rope scaling is not supported".into());
    }
    if let Some(names) = f.str_list("layer_types")? {
        args.layer_types = names
            .iter()
            .map(|n| match *n {
                "sliding_attention" => Ok(LayerType::SlidingAttention),
                "full_attention" => Ok(LayerType::FullAttention),
                other => Err(format!(
                    "config.json: layer_types: '{other}' is not sliding_attention or full_attention"
                )),
            })
            .collect::<Result<_, _>>()?;
    }
    // The router's load-balancing loss counts only when transformers would add it.
    if !f.bool("output_router_logits")?.unwrap_or(false) {
        args.aux_loss_coef = 0.0;
    }
    args.validate().map_err(|e| format!("config.json: {e}"))?;
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> serde_json::Value {
        json!({
            "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 40, "num_local_experts": 4, "num_experts_per_tok": 2,
            "vocab_size": 100, "sliding_window": 4,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
                "original_max_position_embeddings": 4096}
        })
    }

    #[test]
    fn a_tiny_config_reads_with_alternating_layers() {
        let a = from_hf_config(&tiny()).unwrap();
        assert_eq!(
            (a.window_of(0), a.window_of(1), a.window_of(2)),
            (Some(4), None, Some(4))
        );
        assert!(!a.yarn.as_ref().unwrap().truncate);
        let mut c = tiny();
        c["layer_types"] = json!(["full_attention", "full_attention", "sliding_attention"]);
        let a = from_hf_config(&c).unwrap();
        assert_eq!((a.window_of(0), a.window_of(2)), (None, Some(4)));
    }

    #[test]
    fn bad_configs_name_the_key() {
        for (k, v, want) in [
            ("num_experts_per_tok", json!(5), "more experts per token"),
            (
                "layer_types",
                json!(["full_attention"]),
                "layer_types lists 1",
            ),
            ("layer_types", json!(["local"]), "'local'"),
            ("swiglu_limit", json!(-1.0), "swiglu_limit"),
            (
                "sliding_window",
                json!("4"),
                "'sliding_window' has the wrong type",
            ),
            ("model_type", json!("llama"), "not served by this plugin"),
        ] {
            let mut c = tiny();
            c[k] = v;
            let e = from_hf_config(&c).unwrap_err();
            assert!(e.contains(want), "{k}: {e}");
        }
    }
}
