//! Model arguments and the named flavors.

use anneal_plugin_api::sdk::Llama3Scaling;
use serde::{Deserialize, Serialize};

/// Everything that defines a Llama-family model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaArgs {
    /// Hidden size.
    pub dim: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Per-head size; `dim / n_heads` when absent (Qwen3 sets it explicitly).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Hidden size of the SwiGLU feed-forward.
    pub ffn_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama-3 RoPE scaling, if any.
    #[serde(default)]
    pub rope_scaling: Option<Llama3Scaling>,
    /// Longest sequence.
    pub max_seq_len: usize,
    /// Share the embedding table with the output projection.
    pub tie_embeddings: bool,
    /// Per-head RMSNorm of queries and keys (Qwen3).
    #[serde(default)]
    pub qk_norm: bool,
    /// Sliding-window size for the layers listed in `sliding_layers` (Qwen3 variants).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Which layers use the sliding window (all, when `sliding_window` is set and this is empty).
    #[serde(default)]
    pub sliding_layers: Vec<usize>,
    /// Parameter dtype (`f32` or `bf16`).
    #[serde(default = "f32_name")]
    pub dtype: String,
    /// Name written to Hugging Face `config.json` (`llama` or `qwen3`).
    #[serde(default = "llama_name")]
    pub hf_model_type: String,
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

    /// The sliding window of layer `i`, if it has one.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        let w = self.sliding_window?;
        (self.sliding_layers.is_empty() || self.sliding_layers.contains(&i)).then_some(w)
    }

    /// Checks the arguments fit together.
    pub fn validate(&self) -> Result<(), String> {
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
        if !matches!(self.dtype.as_str(), "f32" | "bf16") {
            return Err(format!("dtype must be f32 or bf16, got {}", self.dtype));
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

/// The named flavors.
pub fn flavor(name: &str) -> Option<LlamaArgs> {
    let base = LlamaArgs {
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
        max_seq_len: 2048,
        tie_embeddings: false,
        qk_norm: false,
        sliding_window: None,
        sliding_layers: vec![],
        dtype: "f32".into(),
        hf_model_type: "llama".into(),
    };
    let qwen3 = |dim, n_layers, n_heads, ffn_dim, tie| LlamaArgs {
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
        ..base.clone()
    };
    Some(match name {
        "debugmodel" => base,
        "debugmodel_qwen3" => LlamaArgs {
            qk_norm: true,
            n_kv_heads: 2,
            hf_model_type: "qwen3".into(),
            norm_eps: 1e-6,
            ..base
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
            ..base
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
            ..base
        },
        "qwen3_0.6b" => qwen3(1024, 28, 16, 3072, true),
        "qwen3_8b" => qwen3(4096, 36, 32, 12_288, false),
        _ => return None,
    })
}

/// Flavor names, in the order `anneal plugins list` shows them.
pub const FLAVORS: &[&str] = &[
    "debugmodel",
    "debugmodel_qwen3",
    "llama3_1b",
    "llama3_8b",
    "qwen3_0.6b",
    "qwen3_8b",
];

/// Arguments from a Hugging Face `config.json` (`llama` and `qwen3` model types; RoPE settings
/// from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (earlier)).
pub fn from_hf_config(c: &serde_json::Value) -> Result<LlamaArgs, String> {
    let get = |k: &str| c.get(k).filter(|v| !v.is_null());
    let num = |k: &str| {
        get(k)
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| format!("config.json: missing integer '{k}'"))
    };
    let model_type = get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("llama")
        .to_string();
    if !matches!(model_type.as_str(), "llama" | "qwen3") {
        return Err(format!(
            "config.json: model_type '{model_type}' is not served by this plugin (llama, qwen3)"
        ));
    }
    let rope = get("rope_parameters").or_else(|| get("rope_scaling"));
    let theta = get("rope_theta")
        .or_else(|| rope.and_then(|r| r.get("rope_theta")))
        .and_then(|v| v.as_f64())
        .unwrap_or(10_000.0);
    let rope_type = rope
        .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let rope_scaling = match rope_type {
        "default" => None,
        "llama3" => {
            let r = rope.ok_or("config.json: llama3 rope without parameters")?;
            let f = |k: &str| {
                r.get(k)
                    .and_then(|v| v.as_f64())
                    .ok_or_else(|| format!("config.json: rope parameter '{k}' missing"))
            };
            Some(Llama3Scaling {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
            })
        }
        other => {
            return Err(format!(
                "config.json: rope type '{other}' is not supported (default, llama3)"
            ))
        }
    };
    let n_heads = num("num_attention_heads")?;
    let dim = num("hidden_size")?;
    let qwen = model_type == "qwen3";
    let sliding = get("use_sliding_window")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let args = LlamaArgs {
        dim,
        n_layers: num("num_hidden_layers")?,
        n_heads,
        n_kv_heads: num("num_key_value_heads").unwrap_or(n_heads),
        head_dim: num("head_dim").ok(),
        ffn_dim: num("intermediate_size")?,
        vocab_size: num("vocab_size")?,
        norm_eps: get("rms_norm_eps").and_then(|v| v.as_f64()).unwrap_or(1e-5),
        rope_theta: theta,
        rope_scaling,
        max_seq_len: num("max_position_embeddings").unwrap_or(2048),
        tie_embeddings: get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
        qk_norm: qwen,
        sliding_window: if sliding {
            num("sliding_window").ok()
        } else {
            None
        },
        sliding_layers: vec![],
        dtype: "f32".into(),
        hf_model_type: model_type,
    };
    if get("attention_bias")
        .and_then(|v| v.as_bool())
        .unwrap_or(false)
    {
        return Err("config.json: attention_bias = true is not supported".into());
    }
    args.validate()?;
    Ok(args)
}
