//! Model arguments, the named flavors and the reading of a Hugging Face `config.json`.

use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::vision::{TextShape, VisionArgs, VlArgs};
use anneal_plugin_api::sdk::HfConfig;
use serde::{Deserialize, Serialize};

/// What a block mixes its tokens with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Gated DeltaNet: a recurrent state of fixed size per sequence.
    LinearAttention,
    /// Output-gated softmax attention with a KV cache.
    FullAttention,
}

/// Everything that defines a Qwen3.5 (or Qwen3.5-MoE) model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct Qwen35Args {
    /// Hidden size.
    #[arg(hf = "hidden_size", min = 1)]
    pub dim: usize,
    /// Number of blocks.
    #[arg(hf = "num_hidden_layers", min = 1)]
    pub n_layers: usize,
    /// Query heads of the full-attention layers.
    #[arg(hf = "num_attention_heads", default = 16, min = 1)]
    pub n_heads: usize,
    /// Key/value heads of the full-attention layers.
    #[arg(hf = "num_key_value_heads", default = 4, min = 1)]
    pub n_kv_heads: usize,
    /// Per-head size of the full-attention layers.
    #[arg(hf = "head_dim", default = 256, min = 1)]
    pub head_dim: usize,
    /// Share of each full-attention head that RoPE rotates (`partial_rotary_factor`).
    #[arg(positive)]
    pub partial_rotary_factor: f64,
    /// Hidden size of the dense SwiGLU feed-forward (unused by the MoE model).
    pub ffn_dim: usize,
    /// Vocabulary size.
    #[arg(hf = "vocab_size", min = 1)]
    pub vocab_size: usize,
    /// RMSNorm epsilon (every norm, the gated one included).
    #[arg(hf = "rms_norm_eps", default = 1e-6, non_negative)]
    pub norm_eps: f64,
    /// RoPE base.
    #[arg(positive)]
    pub rope_theta: f64,
    /// Longest sequence.
    #[arg(hf = "max_position_embeddings", default = 32_768, min = 1)]
    pub max_seq_len: usize,
    /// Share the embedding table with the output projection.
    #[arg(hf = "tie_word_embeddings", default = false)]
    pub tie_embeddings: bool,
    /// Each block's token mixer; empty: every `full_attention_interval`-th block is full
    /// attention, the others linear.
    #[serde(default)]
    pub layer_types: Vec<LayerType>,
    /// The period of full-attention blocks when `layer_types` is empty.
    #[serde(default = "four")]
    #[arg(hf = "full_attention_interval", default = 4, min = 1, import_only)]
    pub full_attention_interval: usize,
    /// Kernel size of the causal convolution before the delta rule.
    #[arg(hf = "linear_conv_kernel_dim", default = 4, min = 1)]
    pub linear_conv_kernel: usize,
    /// Query/key heads of the linear-attention layers.
    #[arg(hf = "linear_num_key_heads", default = 16, min = 1)]
    pub linear_n_key_heads: usize,
    /// Value heads of the linear-attention layers (a multiple of the key heads).
    #[arg(hf = "linear_num_value_heads", default = 32, min = 1)]
    pub linear_n_value_heads: usize,
    /// Per-head query/key size of the linear-attention layers.
    #[arg(hf = "linear_key_head_dim", default = 128, min = 1)]
    pub linear_key_head_dim: usize,
    /// Per-head value size of the linear-attention layers.
    #[arg(hf = "linear_value_head_dim", default = 128, min = 1)]
    pub linear_value_head_dim: usize,
    /// Parameter dtype (`f32` or `bf16`).
    #[serde(default = "f32_name")]
    #[arg(default = f32_name(), one_of("f32", "bf16"))]
    pub dtype: String,
    /// The `model_type` of the Hugging Face checkpoint: `qwen3_5_text`, `qwen3_5_moe_text`, or
    /// `qwen3_5` / `qwen3_5_moe`, whose text model nests under `text_config` and keeps its
    /// tensors under `model.language_model.`.
    #[serde(default = "text_name")]
    #[arg(
        default = text_name(),
        one_of("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
    )]
    pub hf_model_type: String,
    /// A mixture of experts with a gated shared expert in every block (Qwen3.5-MoE).
    #[serde(default)]
    #[arg(nested)]
    pub moe: Option<MoeArgs>,
    /// The vision tower (without DeepStack), the image tokens and the MRoPE sections of a
    /// `qwen3_5` / `qwen3_5_moe` checkpoint with vision (`None`: a text model).
    #[serde(default)]
    pub vision: Option<VlArgs>,
}

/// Qwen3.5-MoE's feed-forward: a softmax top-k router over SwiGLU experts (the chosen weights
/// renormalised) plus a shared SwiGLU expert scaled by `sigmoid(shared_expert_gate · x)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct MoeArgs {
    /// Routed experts per block (`num_experts`).
    #[arg(hf = "num_experts", default = 256, min = 1)]
    pub n_experts: usize,
    /// Experts each token is sent to (`num_experts_per_tok`).
    #[arg(hf = "num_experts_per_tok", default = 8, min = 1)]
    pub top_k: usize,
    /// Hidden size of one routed expert (`moe_intermediate_size`).
    #[arg(hf = "moe_intermediate_size", default = 512, min = 1)]
    pub expert_ffn_dim: usize,
    /// Hidden size of the shared expert (`shared_expert_intermediate_size`).
    #[arg(hf = "shared_expert_intermediate_size", default = 512, min = 1)]
    pub shared_ffn_dim: usize,
    /// Coefficient of the load-balancing loss (0: none).
    #[serde(default)]
    #[arg(hf = "router_aux_loss_coef", default = 0.001, non_negative)]
    pub aux_loss_coef: f64,
}

fn four() -> usize {
    4
}

fn f32_name() -> String {
    "f32".into()
}

fn text_name() -> String {
    "qwen3_5_text".into()
}

impl Qwen35Args {
    /// Block `i`'s token mixer.
    pub fn layer_type(&self, i: usize) -> LayerType {
        match self.layer_types.get(i) {
            Some(t) => *t,
            None if (i + 1).is_multiple_of(self.full_attention_interval) => {
                LayerType::FullAttention
            }
            None => LayerType::LinearAttention,
        }
    }

    /// How many blocks are of type `t`.
    pub fn count(&self, t: LayerType) -> usize {
        (0..self.n_layers)
            .filter(|&i| self.layer_type(i) == t)
            .count()
    }

    /// The leading dims of each full-attention head that RoPE rotates.
    pub fn rot_dim(&self) -> usize {
        // transformers: int(head_dim * partial_rotary_factor).
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Query/key width of a linear-attention layer (`key_dim`).
    pub fn linear_key_dim(&self) -> usize {
        self.linear_n_key_heads * self.linear_key_head_dim
    }

    /// Value width of a linear-attention layer (`value_dim`).
    pub fn linear_value_dim(&self) -> usize {
        self.linear_n_value_heads * self.linear_value_head_dim
    }

    /// Channels of the causal convolution: queries, keys and values together.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }

    /// The sizes the vision settings must fit.
    pub fn text_shape(&self) -> TextShape {
        TextShape {
            dim: self.dim,
            n_layers: self.n_layers,
            rotary_pairs: self.rot_dim() / 2,
            vocab_size: self.vocab_size,
        }
    }

    /// Whether the checkpoint nests the text model (`qwen3_5`, `qwen3_5_moe`).
    pub fn nested(&self) -> bool {
        matches!(self.hf_model_type.as_str(), "qwen3_5" | "qwen3_5_moe")
    }

    /// Checks the arguments fit together.
    pub fn validate(&self) -> Result<(), String> {
        self.check()?;
        if self.moe.is_none() && self.ffn_dim == 0 {
            return Err("ffn_dim must be at least 1".into());
        }
        if self.partial_rotary_factor > 1.0 {
            return Err(format!(
                "partial_rotary_factor = {} must be at most 1",
                self.partial_rotary_factor
            ));
        }
        let rot = self.rot_dim();
        if rot == 0 || !rot.is_multiple_of(2) {
            return Err(format!(
                "head_dim ({}) x partial_rotary_factor ({}) = {rot} rotated dims: must be even and at least 2",
                self.head_dim, self.partial_rotary_factor
            ));
        }
        if !self.layer_types.is_empty() && self.layer_types.len() != self.n_layers {
            return Err(format!(
                "layer_types lists {} blocks, the model has {} layers",
                self.layer_types.len(),
                self.n_layers
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "n_heads ({}) must be a multiple of n_kv_heads ({})",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self
            .linear_n_value_heads
            .is_multiple_of(self.linear_n_key_heads)
        {
            return Err(format!(
                "linear_n_value_heads ({}) must be a multiple of linear_n_key_heads ({})",
                self.linear_n_value_heads, self.linear_n_key_heads
            ));
        }
        if let Some(m) = self.moe.as_ref().filter(|m| m.top_k > m.n_experts) {
            return Err(format!(
                "moe.top_k (num_experts_per_tok) = {} asks for more experts per token than the {} experts (moe.n_experts)",
                m.top_k, m.n_experts
            ));
        }
        if let Some(v) = &self.vision {
            if !self.nested() {
                return Err(format!(
                    "vision: a model with a vision tower is a qwen3_5 or qwen3_5_moe checkpoint,                      not hf_model_type '{}'",
                    self.hf_model_type
                ));
            }
            if !v.vision.deepstack_visual_indexes.is_empty() {
                return Err(
                    "vision.vision.deepstack_visual_indexes: Qwen3.5's tower has no DeepStack"
                        .into(),
                );
            }
            v.validate(&self.text_shape())?;
        }
        Ok(())
    }
}

/// Small enough that 300 steps of 8 x 256 tokens train in minutes on 2 cores: 3 Gated
/// DeltaNet blocks and 1 full-attention block, as Qwen3.5 interleaves them.
fn debug() -> Qwen35Args {
    Qwen35Args {
        dim: 256,
        n_layers: 4,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        partial_rotary_factor: 0.25,
        ffn_dim: 768,
        vocab_size: 8192,
        norm_eps: 1e-6,
        rope_theta: 10_000_000.0,
        max_seq_len: 2048,
        tie_embeddings: false,
        layer_types: vec![],
        full_attention_interval: 4,
        linear_conv_kernel: 4,
        linear_n_key_heads: 2,
        linear_n_value_heads: 4,
        linear_key_head_dim: 64,
        linear_value_head_dim: 64,
        dtype: "f32".into(),
        hf_model_type: "qwen3_5_text".into(),
        moe: None,
        vision: None,
    }
}

/// transformers' `Qwen3_5TextConfig()` defaults: the Qwen3.5-9B shape.
fn qwen3_5_9b() -> Qwen35Args {
    Qwen35Args {
        dim: 4096,
        n_layers: 32,
        n_heads: 16,
        n_kv_heads: 4,
        head_dim: 256,
        ffn_dim: 12_288,
        vocab_size: 248_320,
        max_seq_len: 32_768,
        linear_n_key_heads: 16,
        linear_n_value_heads: 32,
        linear_key_head_dim: 128,
        linear_value_head_dim: 128,
        dtype: "bf16".into(),
        ..debug()
    }
}

/// transformers' `Qwen3_5MoeTextConfig()` defaults: the Qwen3.5-35B-A3B shape.
fn qwen3_5_35b_a3b() -> Qwen35Args {
    Qwen35Args {
        dim: 2048,
        n_layers: 40,
        n_kv_heads: 2,
        ffn_dim: 0,
        hf_model_type: "qwen3_5_moe_text".into(),
        moe: Some(MoeArgs {
            n_experts: 256,
            top_k: 8,
            expert_ffn_dim: 512,
            shared_ffn_dim: 512,
            aux_loss_coef: 0.0,
        }),
        ..qwen3_5_9b()
    }
}

anneal_plugin_api::flavors! {
    /// The named flavors.
    pub fn flavor -> Qwen35Args;
    "debugmodel" => debug(),
    "debugmodel_moe" => Qwen35Args {
        hf_model_type: "qwen3_5_moe_text".into(),
        ffn_dim: 0,
        moe: Some(MoeArgs {
            n_experts: 8,
            top_k: 2,
            expert_ffn_dim: 256,
            shared_ffn_dim: 256,
            aux_loss_coef: 0.001,
        }),
        ..debug()
    },
    "qwen3_5_9b" => qwen3_5_9b(),
    "qwen3_5_35b_a3b" => qwen3_5_35b_a3b(),
    // The same with transformers' `Qwen3_5VisionConfig()` tower, as
    // `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` build them.
    "qwen3_5_9b_vl" => with_tower(qwen3_5_9b(), "qwen3_5"),
    "qwen3_5_35b_a3b_vl" => with_tower(qwen3_5_35b_a3b(), "qwen3_5_moe"),
}

/// `text` with transformers' default Qwen3.5 vision tower (27 blocks of 1152, patch 16, no
/// DeepStack) merging into its width, and the Qwen3.5 vocabulary's image tokens.
fn with_tower(text: Qwen35Args, model_type: &str) -> Qwen35Args {
    let vision = VisionArgs {
        depth: 27,
        hidden_size: 1152,
        num_heads: 16,
        intermediate_size: 4304,
        out_hidden_size: text.dim,
        patch_size: 16,
        temporal_patch_size: 2,
        in_channels: 3,
        spatial_merge_size: 2,
        num_position_embeddings: 2304,
        deepstack_visual_indexes: Vec::new(),
        hidden_act: "gelu_pytorch_tanh".into(),
        rope_theta: 10_000.0,
    };
    Qwen35Args {
        hf_model_type: model_type.into(),
        vision: Some(VlArgs {
            vision,
            image_token_id: 248_056,
            mrope_section: vec![11, 11, 10],
            video_token_id: Some(248_057),
            vision_start_token_id: Some(248_053),
            vision_end_token_id: Some(248_054),
        }),
        ..text
    }
}

/// Arguments from a Hugging Face `config.json` of model type `qwen3_5_text`,
/// `qwen3_5_moe_text`, or `qwen3_5` / `qwen3_5_moe` (the text model's keys under
/// `text_config`; `tie_word_embeddings` at the top level; with a `vision_config`, the vision
/// tower and image tokens of `Qwen3_5ForConditionalGeneration`). A key that is absent takes
/// transformers' default; a key of the wrong type is reported as such.
pub fn from_hf_config(c: &serde_json::Value) -> Result<Qwen35Args, String> {
    let top = HfConfig::new(c);
    let model_type = top.str("model_type")?.unwrap_or("qwen3_5_text").to_string();
    let nested = match model_type.as_str() {
        "qwen3_5_text" | "qwen3_5_moe_text" => false,
        "qwen3_5" | "qwen3_5_moe" => true,
        other => {
            return Err(format!(
                "config.json: model_type '{other}' is not served by this plugin (qwen3_5_text, qwen3_5_moe_text, qwen3_5, qwen3_5_moe)"
            ))
        }
    };
    let f = if nested {
        top.object("text_config")?
    } else {
        HfConfig::new(c)
    };
    let moe = model_type.starts_with("qwen3_5_moe");
    let rope = f.rope(10_000.0)?;
    if rope.llama3.is_some() || rope.yarn.is_some() {
        return Err("config.json: only the default rope type is supported".into());
    }
    if f.bool("attention_bias")?.unwrap_or(false) {
        return Err("config.json: attention_bias = true is not supported".into());
    }
    if let Some(act) = f.str("hidden_act")? {
        if act != "silu" {
            return Err(format!(
                "config.json: hidden_act '{act}' is not supported (silu)"
            ));
        }
    }
    let mut args = Qwen35Args::from_hf(&f)?;
    args.rope_theta = rope.theta;
    // transformers 5 keeps the factor in `rope_parameters`; older configs at the top level.
    let partial = match f.get("rope_parameters") {
        Some(_) => f
            .object("rope_parameters")?
            .float("partial_rotary_factor")?,
        None => None,
    };
    args.partial_rotary_factor = match partial {
        Some(p) => p,
        None => f.float("partial_rotary_factor")?.unwrap_or(0.25),
    };
    if let Some(list) = f.str_list("layer_types")? {
        args.layer_types = list
            .iter()
            .map(|t| match *t {
                "linear_attention" => Ok(LayerType::LinearAttention),
                "full_attention" => Ok(LayerType::FullAttention),
                other => Err(format!(
                    "config.json: layer_types holds '{other}' (linear_attention or full_attention)"
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
    }
    // The nested configs tie at the top level (`Qwen3_5Config.tie_word_embeddings`).
    if let (Some(t), true) = (top.bool("tie_word_embeddings")?, nested) {
        args.tie_embeddings = t;
    }
    if moe {
        // transformers' MoE default has 2 key/value heads, not 4; no dense feed-forward.
        args.n_kv_heads = f.uint("num_key_value_heads")?.unwrap_or(2);
        let mut m = MoeArgs::from_hf(&f)?;
        // transformers adds the balancing loss only with `output_router_logits`.
        if !f.bool("output_router_logits")?.unwrap_or(false) {
            m.aux_loss_coef = 0.0;
        }
        args.moe = Some(m);
    } else {
        args.ffn_dim = f.need_uint("intermediate_size")?;
    }
    args.hf_model_type = model_type;
    // transformers' `Qwen3_5ForConditionalGeneration`: the tower, the image tokens and the MRoPE
    // sections (transformers' default when absent); its tower has no DeepStack, whatever the
    // config says.
    if nested && top.get("vision_config").is_some() {
        let mut vl = VlArgs::from_hf(&top, &f, &[11, 11, 10])?;
        vl.vision.deepstack_visual_indexes.clear();
        args.vision = Some(vl);
    }
    args.validate().map_err(|e| format!("config.json: {e}"))?;
    Ok(args)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> serde_json::Value {
        json!({
            "model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 112, "vocab_size": 96,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5}
        })
    }

    #[test]
    fn a_tiny_config_reads_with_transformers_defaults() {
        let a = from_hf_config(&tiny()).unwrap();
        assert_eq!((a.dim, a.rot_dim(), a.conv_dim()), (64, 8, 96));
        let types: Vec<LayerType> = (0..4).map(|i| a.layer_type(i)).collect();
        assert_eq!(
            types,
            [
                LayerType::LinearAttention,
                LayerType::LinearAttention,
                LayerType::LinearAttention,
                LayerType::FullAttention
            ]
        );
        assert_eq!((a.linear_conv_kernel, a.norm_eps), (4, 1e-6));
        assert!(!a.nested() && a.moe.is_none());
    }

    #[test]
    fn nested_configs_read_the_text_config_and_tie_at_the_top() {
        let mut text = tiny();
        for (k, v) in [
            ("model_type", json!("qwen3_5_moe_text")),
            ("num_experts", json!(4)),
            ("num_experts_per_tok", json!(2)),
            ("moe_intermediate_size", json!(8)),
            ("shared_expert_intermediate_size", json!(12)),
            ("tie_word_embeddings", json!(false)),
            (
                "layer_types",
                json!([
                    "full_attention",
                    "linear_attention",
                    "full_attention",
                    "linear_attention"
                ]),
            ),
        ] {
            text[k] = v;
        }
        let c =
            json!({"model_type": "qwen3_5_moe", "tie_word_embeddings": true, "text_config": text});
        let a = from_hf_config(&c).unwrap();
        assert!(a.nested() && a.tie_embeddings);
        assert_eq!(a.moe.as_ref().unwrap().shared_ffn_dim, 12);
        assert_eq!(a.layer_type(0), LayerType::FullAttention);
        assert_eq!(a.count(LayerType::LinearAttention), 2);
    }

    /// A `Qwen3_5ForConditionalGeneration` config as transformers writes it, trimmed.
    pub(crate) fn with_vision() -> serde_json::Value {
        let mut text = tiny();
        text["model_type"] = json!("qwen3_5_text");
        text["rope_parameters"]["mrope_section"] = json!([2, 1, 1]);
        text["rope_parameters"]["mrope_interleaved"] = json!(true);
        json!({
            "model_type": "qwen3_5", "tie_word_embeddings": false, "text_config": text,
            "image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 92,
            "vision_end_token_id": 93,
            "vision_config": {
                "model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 16, "num_heads": 2,
                "intermediate_size": 32, "out_hidden_size": 64, "patch_size": 16,
                "num_position_embeddings": 16,
                "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}
            }
        })
    }

    #[test]
    fn a_config_with_vision_reads_the_tower_without_deepstack() {
        let a = from_hf_config(&with_vision()).unwrap();
        let vl = a.vision.as_ref().unwrap();
        assert_eq!(
            (vl.image_token_id, vl.vision_start_token_id),
            (90, Some(92))
        );
        assert_eq!(vl.mrope_section, [2, 1, 1]);
        assert_eq!((vl.vision.depth, vl.vision.out_hidden_size), (2, 64));
        // transformers' Qwen3.5 tower has no DeepStack, even if the config lists some.
        let mut c = with_vision();
        c["vision_config"]["deepstack_visual_indexes"] = json!([0]);
        let a = from_hf_config(&c).unwrap();
        assert!(a.vision.unwrap().vision.deepstack_visual_indexes.is_empty());
        // Without sections, transformers' default (for 64 rotated dims).
        let mut c = with_vision();
        c["text_config"]["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("mrope_section");
        let e = from_hf_config(&c).unwrap_err();
        assert!(e.contains("[11, 11, 10]"), "{e}");
        // A text-only nested config stays text-only.
        let mut c = with_vision();
        c.as_object_mut().unwrap().remove("vision_config");
        assert!(from_hf_config(&c).unwrap().vision.is_none());
    }

    #[test]
    fn bad_vision_configs_are_refused_by_key() {
        for (pointer, value, key) in [
            (
                "/vision_config/out_hidden_size",
                json!(48),
                "out_hidden_size",
            ),
            ("/vision_config/num_heads", json!(3), "num_heads"),
            ("/image_token_id", json!(96), "image_token_id"),
            (
                "/text_config/rope_parameters/mrope_section",
                json!([2, 2, 1]),
                "mrope_section",
            ),
            (
                "/text_config/rope_parameters/mrope_interleaved",
                json!(false),
                "mrope_interleaved",
            ),
        ] {
            let mut c = with_vision();
            *c.pointer_mut(pointer).unwrap() = value;
            let e = from_hf_config(&c).expect_err(pointer);
            assert!(e.contains(key), "{pointer}: {e}");
        }
        let mut c = with_vision();
        c.as_object_mut().unwrap().remove("image_token_id");
        let e = from_hf_config(&c).unwrap_err();
        assert!(e.contains("image_token_id"), "{e}");
        // Arguments given directly: a tower needs the nested checkpoint type, and no DeepStack.
        let mut a = from_hf_config(&with_vision()).unwrap();
        a.hf_model_type = "qwen3_5_text".into();
        assert!(a.validate().unwrap_err().contains("hf_model_type"));
        let mut a = from_hf_config(&with_vision()).unwrap();
        if let Some(v) = &mut a.vision {
            v.vision.deepstack_visual_indexes = vec![0];
        }
        assert!(a.validate().unwrap_err().contains("DeepStack"));
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        for (k, v, what) in [
            (
                "hidden_size",
                json!("64"),
                "'hidden_size' has the wrong type",
            ),
            ("rms_norm_eps", json!(-1e-5), "rms_norm_eps"),
            ("linear_num_value_heads", json!(3), "linear_n_value_heads"),
            ("layer_types", json!(["linear_attention"]), "layer_types"),
            ("layer_types", json!(["x", "y", "z", "w"]), "'x'"),
            ("model_type", json!("llama"), "not served"),
            ("hidden_act", json!("gelu"), "hidden_act"),
        ] {
            let mut c = tiny();
            c[k] = v;
            let e = from_hf_config(&c).unwrap_err();
            assert!(e.contains(what), "{k}: {e}");
        }
        let mut c = tiny();
        c["rope_parameters"]["partial_rotary_factor"] = json!(0.1);
        let e = from_hf_config(&c).unwrap_err();
        assert!(e.contains("rotated dims"), "{e}");
    }
}
