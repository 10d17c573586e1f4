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
}

/// Muse Glimmer's vision tower (`vision_config`) and what joins it to the decoder. Its weights
/// are declared, loaded and exported; its forward is not written yet, so images are refused.
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

    /// Checks the arguments fit together, naming the one that does not.
    pub fn validate(&self) -> Result<(), String> {
        self.check()?;
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

anneal_plugin_api::flavors! {
    /// The named flavors.
    pub fn flavor -> MuseArgs;
    "debugmodel" => debugmodel(),
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
        "muse_glimmer" => top.object("text_config")?,
        "muse_glimmer_text" => HfConfig::new(c),
        other => {
            return Err(format!(
                "config.json: model_type '{other}' is not served by this plugin (muse_glimmer, muse_glimmer_text)"
            ))
        }
    };
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
    if model_type == "muse_glimmer" {
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
