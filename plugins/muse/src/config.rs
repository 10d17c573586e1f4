//! Muse Glimmer's arguments, declared once with their `config.json` keys and checks (the SDK's
//! model kit), its flavors, and the reading of transformers' `muse_glimmer` config.

pub use anneal_plugin_api::sdk::kit::LayerType;
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::HfConfig;
use serde::{Deserialize, Serialize};

/// Everything that defines a Muse Glimmer decoder (`text_config`), and its vision tower.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct MuseArgs {
    /// Hidden size.
    #[arg(hf = "hidden_size", min = 1)]
    pub dim: usize,
    /// Number of blocks.
    #[arg(hf = "num_hidden_layers", min = 1)]
    pub n_layers: usize,
    /// Query heads.
    #[arg(hf = "num_attention_heads", default = 32, min = 1)]
    pub n_heads: usize,
    /// Key/value heads.
    #[arg(hf = "num_key_value_heads", default = 2, min = 1)]
    pub n_kv_heads: usize,
    /// Per-head size.
    #[arg(hf = "head_dim", default = 128, min = 2, even)]
    pub head_dim: usize,
    /// Hidden size of the SwiGLU feed-forward.
    #[arg(hf = "intermediate_size", min = 1)]
    pub ffn_dim: usize,
    /// Vocabulary size.
    #[arg(hf = "vocab_size", min = 1)]
    pub vocab_size: usize,
    /// Epsilon of the pre-norms, the scaleless QK-norm, the embedding norm and the final norm.
    #[arg(hf = "rms_norm_eps", default = 1e-5, non_negative)]
    pub norm_eps: f64,
    /// Epsilon of the sandwich norms on the attention's and feed-forward's outputs.
    #[arg(hf = "post_norm_eps", default = 1e-8, non_negative)]
    pub post_norm_eps: f64,
    /// RoPE base of the layers with positions.
    #[arg(rope = theta, default = 10_000.0)]
    pub rope_theta: f64,
    /// Longest sequence.
    #[arg(hf = "max_position_embeddings", default = 131_072, min = 1)]
    pub max_seq_len: usize,
    /// Window of the sliding-attention layers.
    #[arg(hf = "sliding_window", default = 2048, min = 1)]
    pub sliding_window: usize,
    /// Each block's attention; empty: full attention on every 4th block counted back from the
    /// last, sliding elsewhere (transformers' default).
    #[serde(default)]
    #[arg(hf = "layer_types", json, default = vec![])]
    pub layer_types: Vec<LayerType>,
    /// Each block's RoPE base, 0 for no positions (NoPE); empty: NoPE exactly on the
    /// full-attention pattern's blocks. transformers rotates every other block by `rope_theta`
    /// whatever base it lists.
    #[serde(default)]
    #[arg(hf = "layer_rope_theta", json, default = vec![])]
    pub layer_rope_theta: Vec<f64>,
    /// Queries are multiplied by this after the scaleless QK-norm.
    #[arg(hf = "qk_scale_factor", default = 3.87, positive)]
    pub qk_scale_factor: f64,
    /// Logits are multiplied by this before the soft-cap.
    #[arg(hf = "output_multiplier", default = 0.196_116_135_138_184_04, positive)]
    pub output_multiplier: f64,
    /// Logits are soft-capped to `c · tanh(z / c)`.
    #[arg(hf = "final_logit_softcapping", default = 20.0, positive)]
    pub logit_softcap: f64,
    /// Share the embedding table with the output projection.
    #[arg(hf = "tie_word_embeddings", default = false)]
    pub tie_embeddings: bool,
    /// Parameter dtype (`f32` or `bf16`).
    #[serde(default = "f32_name")]
    #[arg(default = f32_name(), one_of("f32", "bf16"))]
    pub dtype: String,
    /// The vision tower, adapter and projection a `muse_glimmer` checkpoint carries (`None`: a
    /// text model, exported as `muse_glimmer_text`).
    #[serde(default)]
    pub vision: Option<VisionArgs>,
    /// Muse Spark's blocks: gated residuals, a gain-free norm on each head's output, and
    /// mixtures of experts in a latent width (`None`: Muse Glimmer).
    #[serde(default)]
    #[arg(nested)]
    pub spark: Option<SparkArgs>,
    /// Muse Spark's raw-waveform audio tower (`audio.rs`), which puts a forward's audio clips in
    /// their placeholders.
    #[serde(default)]
    pub audio: Option<AudioArgs>,
}

/// What Muse Spark adds to Muse Glimmer's decoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct SparkArgs {
    /// Routed experts per sparse block (`num_local_experts`).
    #[arg(hf = "num_local_experts", default = 256, min = 1)]
    pub n_experts: usize,
    /// Experts each token is sent to (`num_experts_per_tok`).
    #[arg(hf = "num_experts_per_tok", default = 8, min = 1)]
    pub top_k: usize,
    /// Hidden size of one expert (`moe_intermediate_size`).
    #[arg(hf = "moe_intermediate_size", default = 4096, min = 1)]
    pub expert_ffn_dim: usize,
    /// The latent width the experts run in (`moe_hidden_size`).
    #[arg(hf = "moe_hidden_size", default = 4096, min = 1)]
    pub latent_dim: usize,
    /// The chosen experts' weights, renormalised, are multiplied by this.
    #[arg(hf = "routed_scaling_factor", default = 1.0, positive)]
    pub routed_scaling_factor: f64,
    /// The residual gates' temperature.
    #[arg(hf = "residual_gate_temperature", default = 0.3, positive)]
    pub residual_gate_temperature: f64,
    /// Each block's feed-forward, `dense` or `sparse`; empty: every block sparse.
    #[serde(default)]
    #[arg(hf = "mlp_layer_types", default = vec![], one_of("dense", "sparse"))]
    pub mlp_layer_types: Vec<String>,
}

/// Muse Spark's audio tower (`audio_config`): a pyramid of strided patch embeddings and causal
/// depthwise convolution blocks over the raw waveform, then a projection into the decoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct AudioArgs {
    /// Samples folded into one step by each stage.
    #[arg(hf = "patch_sizes", default = vec![16, 6, 5, 4], min = 1)]
    pub patch_sizes: Vec<usize>,
    /// Each stage's width.
    #[arg(hf = "hidden_sizes", default = vec![256, 512, 1024, 2048], min = 1)]
    pub hidden_sizes: Vec<usize>,
    /// Convolution blocks per stage.
    #[arg(hf = "depths", default = vec![2, 2, 2, 2])]
    pub depths: Vec<usize>,
    /// A stage's MLP width over its hidden width.
    #[arg(hf = "mlp_ratio", default = 4.0, positive)]
    pub mlp_ratio: f64,
    /// Kernel of the depthwise causal convolutions.
    #[arg(hf = "conv_kernel_size", default = 7, min = 1)]
    pub conv_kernel_size: usize,
    /// Its norms' epsilon.
    #[arg(hf = "rms_norm_eps", default = 1e-6, non_negative)]
    pub norm_eps: f64,
    /// The MLPs' activation: `gelu` (exact, by erf), the only one transformers' checkpoints use.
    #[serde(default = "gelu_name")]
    #[arg(hf = "hidden_act", default = gelu_name(), one_of("gelu"))]
    pub hidden_act: String,
    /// The audio placeholder token (`audio_token_id`, top level).
    pub audio_token_id: usize,
}

impl AudioArgs {
    /// Waveform samples one audio token takes: the product of the stages' patch sizes (1920,
    /// 80 ms at 24 kHz, for the released tower).
    pub fn samples_per_token(&self) -> usize {
        self.patch_sizes.iter().product()
    }
}

/// Muse Glimmer's vision tower (`vision_config`) and what joins it to the decoder. Its weights
/// are declared, loaded and exported; its forward is `vision.rs`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ModelArgs)]
#[serde(deny_unknown_fields)]
pub struct VisionArgs {
    /// Patch side in pixels.
    #[arg(hf = "patch_size", default = 14, min = 1)]
    pub patch_size: usize,
    /// Frames per patch.
    #[arg(hf = "patch_temporal", default = 2, min = 1)]
    pub patch_temporal: usize,
    /// Rows of the learned position table.
    #[arg(hf = "pos_emb_height", default = 32, min = 1)]
    pub pos_emb_height: usize,
    /// Columns of the learned position table.
    #[arg(hf = "pos_emb_width", default = 32, min = 1)]
    pub pos_emb_width: usize,
    /// Blocks.
    #[arg(hf = "num_hidden_layers", default = 50, min = 1)]
    pub depth: usize,
    /// Width.
    #[arg(hf = "hidden_size", default = 1536, min = 1)]
    pub hidden_size: usize,
    /// Heads.
    #[arg(hf = "num_attention_heads", default = 16, min = 1)]
    pub num_heads: usize,
    /// Hidden size of each block's MLP.
    #[arg(hf = "intermediate_size", default = 8960, min = 1)]
    pub intermediate_size: usize,
    /// Patches merged per side into one decoder token.
    #[arg(hf = "merge_size", default = 2, min = 1)]
    pub merge_size: usize,
    /// LayerNorm epsilon.
    #[arg(hf = "layer_norm_eps", default = 1e-5, non_negative)]
    pub layer_norm_eps: f64,
    /// Each block's attention (`window_attention`, `full_attention`); empty: transformers'
    /// default (full on every 4th block and the last).
    #[serde(default)]
    #[arg(hf = "layer_types", default = vec![])]
    pub layer_types: Vec<String>,
    /// The base of the 2-D (axial) RoPE (`rope_parameters.rope_theta`).
    #[arg(positive)]
    pub rope_theta: f64,
    /// Width after the merge (`out_hidden_size`, top level).
    pub out_hidden_size: usize,
    /// Width of the adapter (`projector_hidden_size`, top level).
    pub projector_hidden_size: usize,
    /// The image placeholder token (`image_token_id`, top level).
    pub image_token_id: usize,
    /// The video placeholder token (`video_token_id`, top level).
    pub video_token_id: usize,
}

fn f32_name() -> String {
    "f32".into()
}

fn gelu_name() -> String {
    "gelu".into()
}

impl MuseArgs {
    /// Block `i`'s attention.
    pub fn layer_type(&self, i: usize) -> LayerType {
        match self.layer_types.get(i) {
            Some(t) => *t,
            None if (self.n_layers - 1 - i).is_multiple_of(4) => LayerType::FullAttention,
            None => LayerType::SlidingAttention,
        }
    }

    /// The sliding window of block `i`, if it has one.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        (self.layer_type(i) == LayerType::SlidingAttention).then_some(self.sliding_window)
    }

    /// Whether block `i` takes positions (RoPE) or none (NoPE).
    pub fn has_rope(&self, i: usize) -> bool {
        match self.layer_rope_theta.get(i) {
            Some(theta) => *theta != 0.0,
            None => !(self.n_layers - 1 - i).is_multiple_of(4),
        }
    }

    /// Whether block `i` runs Muse Spark's mixture of experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.spark
            .as_ref()
            .is_some_and(|s| s.mlp_layer_types.get(i).is_none_or(|t| t == "sparse"))
    }

    /// The checkpoint's `model_type`.
    pub fn model_type(&self) -> &'static str {
        match (&self.spark, &self.vision) {
            (Some(_), _) => "muse_spark",
            (None, Some(_)) => "muse_glimmer",
            (None, None) => "muse_glimmer_text",
        }
    }

    /// Checks the arguments fit together, naming the one that does not.
    pub fn validate(&self) -> Result<(), String> {
        self.check()?;
        if let Some(s) = &self.spark {
            if s.top_k > s.n_experts {
                return Err(format!(
                    "spark.top_k (num_experts_per_tok) = {} asks for more experts per token than the {} experts",
                    s.top_k, s.n_experts
                ));
            }
            if !s.mlp_layer_types.is_empty() && s.mlp_layer_types.len() != self.n_layers {
                return Err(format!(
                    "spark.mlp_layer_types lists {} blocks, the model has {}",
                    s.mlp_layer_types.len(),
                    self.n_layers
                ));
            }
        }
        if let Some(a) = &self.audio {
            a.check_at("audio.")?;
            if a.patch_sizes.len() != a.hidden_sizes.len() || a.depths.len() != a.hidden_sizes.len()
            {
                return Err(
                    "audio.patch_sizes, hidden_sizes and depths must list one entry per stage"
                        .into(),
                );
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "n_heads ({}) must be a multiple of n_kv_heads ({})",
                self.n_heads, self.n_kv_heads
            ));
        }
        for (name, len) in [
            ("layer_types", self.layer_types.len()),
            ("layer_rope_theta", self.layer_rope_theta.len()),
        ] {
            if len != 0 && len != self.n_layers {
                return Err(format!(
                    "{name} lists {len} blocks, the model has {}",
                    self.n_layers
                ));
            }
        }
        if let Some(t) = self
            .layer_rope_theta
            .iter()
            .find(|t| !t.is_finite() || **t < 0.0)
        {
            return Err(format!(
                "layer_rope_theta holds {t}: 0 (NoPE) or a base > 0"
            ));
        }
        if let Some(v) = &self.vision {
            v.check_at("vision.")?;
            if !v.hidden_size.is_multiple_of(v.num_heads) {
                return Err(format!(
                    "vision.hidden_size ({}) must be a multiple of vision.num_heads ({})",
                    v.hidden_size, v.num_heads
                ));
            }
            if v.out_hidden_size != v.hidden_size * v.merge_size * v.merge_size {
                return Err(format!(
                    "vision.out_hidden_size ({}) must be vision.hidden_size × merge_size² ({})",
                    v.out_hidden_size,
                    v.hidden_size * v.merge_size * v.merge_size
                ));
            }
            if v.image_token_id >= self.vocab_size || v.video_token_id >= self.vocab_size {
                return Err(format!(
                    "vision.image_token_id ({}) and video_token_id ({}) must be below vocab_size ({})",
                    v.image_token_id, v.video_token_id, self.vocab_size
                ));
            }
        }
        Ok(())
    }
}

/// The debug model: 4 blocks of 256 (block 3 full attention without positions, 0-2 RoPE with a
/// window of 128), 4 heads of 64, 2 KV heads, and a tiny vision tower.
fn debugmodel() -> MuseArgs {
    MuseArgs {
        dim: 256,
        n_layers: 4,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        ffn_dim: 768,
        vocab_size: 8192,
        norm_eps: 1e-5,
        post_norm_eps: 1e-8,
        rope_theta: 10_000.0,
        max_seq_len: 2048,
        sliding_window: 128,
        layer_types: vec![],
        layer_rope_theta: vec![],
        qk_scale_factor: 3.87,
        // 1/sqrt(dim / 256), as the released model's.
        output_multiplier: 1.0,
        logit_softcap: 20.0,
        tie_embeddings: false,
        dtype: "f32".into(),
        spark: None,
        audio: None,
        vision: Some(VisionArgs {
            depth: 2,
            hidden_size: 64,
            num_heads: 2,
            intermediate_size: 128,
            pos_emb_height: 8,
            pos_emb_width: 8,
            out_hidden_size: 256,
            projector_hidden_size: 128,
            image_token_id: 5,
            video_token_id: 6,
            ..released_tower()
        }),
    }
}

/// transformers' `MuseGlimmerVisionConfig()` with the top level's defaults.
fn released_tower() -> VisionArgs {
    VisionArgs {
        patch_size: 14,
        patch_temporal: 2,
        pos_emb_height: 32,
        pos_emb_width: 32,
        depth: 50,
        hidden_size: 1536,
        num_heads: 16,
        intermediate_size: 8960,
        merge_size: 2,
        layer_norm_eps: 1e-5,
        layer_types: vec![],
        rope_theta: 10_000.0,
        out_hidden_size: 6144,
        projector_hidden_size: 4096,
        image_token_id: 200_092,
        video_token_id: 200_091,
    }
}

/// transformers' `MuseSparkAudioConfig()`.
fn released_audio() -> AudioArgs {
    AudioArgs {
        patch_sizes: vec![16, 6, 5, 4],
        hidden_sizes: vec![256, 512, 1024, 2048],
        depths: vec![2, 2, 2, 2],
        mlp_ratio: 4.0,
        conv_kernel_size: 7,
        norm_eps: 1e-6,
        hidden_act: gelu_name(),
        audio_token_id: 200_038,
    }
}

anneal_plugin_api::flavors! {
    /// The named flavors.
    pub fn flavor -> MuseArgs;
    "debugmodel" => debugmodel(),
    // The debug model as Muse Spark: blocks 1 and 3 sparse (8 experts of 128, top 2, in a
    // latent width of 128), 0 and 2 dense, gated residuals; a tiny audio tower.
    "debugmodel_spark" => MuseArgs {
        spark: Some(SparkArgs {
            n_experts: 8,
            top_k: 2,
            expert_ffn_dim: 128,
            latent_dim: 128,
            routed_scaling_factor: 1.0,
            residual_gate_temperature: 0.3,
            mlp_layer_types: ["dense", "sparse", "dense", "sparse"].map(String::from).to_vec(),
        }),
        audio: Some(AudioArgs {
            patch_sizes: vec![8, 4],
            hidden_sizes: vec![32, 64],
            depths: vec![1, 1],
            audio_token_id: 7,
            ..released_audio()
        }),
        ..debugmodel()
    },
    // transformers' `MuseSparkConfig()` defaults: the released Muse Spark Open.
    "muse_spark_open" => MuseArgs {
        dim: 8192,
        n_layers: 62,
        n_heads: 128,
        n_kv_heads: 16,
        head_dim: 64,
        ffn_dim: 16_384,
        vocab_size: 202_048,
        rope_theta: 500_000.0,
        max_seq_len: 1_048_576,
        sliding_window: 2048,
        qk_scale_factor: 5.473_006_486_387_5,
        output_multiplier: 0.176_776_695_296_636_9,
        dtype: "bf16".into(),
        vision: Some(released_tower()),
        spark: Some(SparkArgs {
            n_experts: 256,
            top_k: 8,
            expert_ffn_dim: 4096,
            latent_dim: 4096,
            routed_scaling_factor: 1.0,
            residual_gate_temperature: 0.3,
            mlp_layer_types: vec![],
        }),
        audio: Some(released_audio()),
        ..debugmodel()
    },
    // transformers' `MuseGlimmerConfig()` defaults: the released 30B.
    "muse_glimmer_30b" => MuseArgs {
        dim: 6656,
        n_layers: 52,
        n_heads: 32,
        n_kv_heads: 2,
        head_dim: 128,
        ffn_dim: 19_968,
        vocab_size: 202_048,
        max_seq_len: 131_072,
        sliding_window: 2048,
        output_multiplier: 0.196_116_135_138_184_04,
        dtype: "bf16".into(),
        vision: Some(released_tower()),
        ..debugmodel()
    },
}

/// Arguments from a Hugging Face `config.json`: `muse_glimmer` (the decoder's keys under
/// `text_config`, the tower's under `vision_config`) or `muse_glimmer_text`. A key that is
/// absent takes transformers' default; a key of the wrong type is reported as such.
pub fn from_hf_config(c: &serde_json::Value) -> Result<MuseArgs, String> {
    let top = HfConfig::new(c);
    let model_type = top.str("model_type")?.unwrap_or("muse_glimmer");
    let f = match model_type {
        "muse_glimmer" | "muse_spark" => top.object("text_config")?,
        "muse_glimmer_text" | "muse_spark_text" => HfConfig::new(c),
        other => {
            return Err(format!(
                "config.json: model_type '{other}' is not served by this plugin (muse_glimmer, muse_glimmer_text, muse_spark, muse_spark_text)"
            ))
        }
    };
    let spark = model_type.starts_with("muse_spark");
    let rope = f.rope(10_000.0)?;
    if rope.llama3.is_some() || rope.yarn.is_some() {
        return Err("config.json: only the default rope type is supported".into());
    }
    if f.bool("attention_bias")?.unwrap_or(false) {
        return Err("config.json: attention_bias = true is not supported".into());
    }
    for key in ["hidden_activation", "hidden_act"] {
        if let Some(act) = f.str(key)? {
            if act != "silu" {
                return Err(format!(
                    "config.json: {key} '{act}' is not supported (silu)"
                ));
            }
        }
    }
    let mut args = MuseArgs::from_hf(&f)?;
    if spark {
        args.spark = Some(SparkArgs::from_hf(&f)?);
    }
    if spark && top.get("audio_config").is_some() {
        let mut audio = AudioArgs::from_hf(&top.object("audio_config")?)?;
        audio.audio_token_id = top.uint("audio_token_id")?.unwrap_or(200_038);
        args.audio = Some(audio);
    }
    if matches!(model_type, "muse_glimmer" | "muse_spark") {
        let v = top.object("vision_config")?;
        let mut vision = VisionArgs::from_hf(&v)?;
        vision.rope_theta = match v.get("rope_parameters") {
            Some(_) => v.object("rope_parameters")?.float("rope_theta")?,
            None => None,
        }
        .unwrap_or(10_000.0);
        vision.out_hidden_size = top.uint("out_hidden_size")?.unwrap_or(6144);
        vision.projector_hidden_size = top.uint("projector_hidden_size")?.unwrap_or(4096);
        vision.image_token_id = top.uint("image_token_id")?.unwrap_or(200_092);
        vision.video_token_id = top.uint("video_token_id")?.unwrap_or(200_091);
        if let Some(act) = top.str("projector_hidden_act")? {
            if act != "gelu" {
                return Err(format!(
                    "config.json: projector_hidden_act '{act}' is not supported (gelu)"
                ));
            }
        }
        args.vision = Some(vision);
    }
    args.validate().map_err(|e| format!("config.json: {e}"))?;
    Ok(args)
}
