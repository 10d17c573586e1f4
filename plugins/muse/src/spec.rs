//! Muse Glimmer's parameters, each declared once with its shape, init, placement and name in a
//! transformers checkpoint (the decoder under `model.language_model.`, the tower under
//! `model.vision_tower.`, Spark's audio tower under `model.audio_tower.`), and the model's costs.

use crate::audio::{AudioTower, ConvBlock, Stage};
use crate::config::{AudioArgs, MuseArgs, SparkArgs, VisionArgs};
use crate::hf;
use crate::vision::{Block, Tower};
use anneal_plugin_api::sdk::kit::blocks::{GqaParams, Proj};
use anneal_plugin_api::sdk::{
    Decl, HfMap, Init, LayerScope, ModelSpec, ParallelSupport, Param, ParamSpec, ParamTable,
};

/// The parameters of one block.
pub struct BlockParams {
    /// Centred RMSNorm before attention.
    pub attention_norm: Param,
    /// Grouped-query attention with a separate sigmoid output gate `[n_heads · head_dim, dim]`.
    pub attention: GqaParams,
    /// Centred RMSNorm on the attention's output (Glimmer; Spark's has no gain).
    pub attention_post_norm: Option<Param>,
    /// Centred RMSNorm before the feed-forward.
    pub ffn_norm: Param,
    /// The feed-forward.
    pub ffn: FeedForward,
    /// RMSNorm on the feed-forward's output: centred (Glimmer), or of the input scaled by
    /// `1 + w` (Spark).
    pub ffn_post_norm: Param,
    /// Spark's residual gates after attention and after the feed-forward, `[dim]` each.
    pub residual_gates: Option<[Param; 2]>,
}

/// A block's feed-forward.
pub enum FeedForward {
    /// SwiGLU gate, up and down projections.
    Dense([Param; 3]),
    /// Muse Spark's mixture of experts in a latent width.
    Latent(LatentExperts),
}

/// Muse Spark's sparse feed-forward: a sigmoid router on the block's input, the input projected
/// into the latent width and normed, SwiGLU experts there with a shared norm on each expert's
/// output, the weighted sum projected back.
pub struct LatentExperts {
    /// Router `[n_experts, dim]`.
    pub router: Param,
    /// The routing bias that steers the choice only `[n_experts]` (a buffer).
    pub bias: Param,
    /// `[latent, dim]`.
    pub pre_proj: Param,
    /// Centred RMSNorm in the latent width.
    pub pre_norm: Param,
    /// Gates and ups `[n_experts, expert_ffn, latent]` (halves of `gate_up_proj`).
    pub gate: Param,
    /// See `gate`.
    pub up: Param,
    /// Down projections `[n_experts, latent, expert_ffn]`.
    pub down: Param,
    /// The input-scaled RMSNorm on every expert's output `[latent]`.
    pub post_norm: Param,
    /// `[dim, latent]`.
    pub post_proj: Param,
}

/// Every parameter of the model.
pub struct MuseParams {
    /// Token embeddings `[vocab, dim]` (normed without a gain after the lookup).
    pub tok_embeddings: Param,
    /// The blocks.
    pub layers: Vec<BlockParams>,
    /// Final RMSNorm (a plain gain, not centred).
    pub norm: Param,
    /// Output projection `[vocab, dim]` (the embedding table when tied).
    pub output: Param,
    /// The vision tower, adapter and projection.
    pub vision: Option<Tower>,
    /// Muse Spark's audio tower.
    pub audio: Option<AudioTower>,
}

/// Where the decoder's tensors live in a checkpoint of `a`.
fn text_prefix(a: &MuseArgs) -> &'static str {
    if a.vision.is_some() {
        "model.language_model"
    } else {
        "model"
    }
}

/// Declares every parameter: N(0,1) embeddings, truncated normal projections (depth-scaled for
/// those writing into the residual stream), zeros for the centred norms' gains.
pub fn declare(a: &MuseArgs) -> (MuseParams, Vec<ParamSpec>) {
    let (d, hd, f) = (a.dim, a.head_dim, a.ffn_dim);
    let (q_dim, kv_dim) = (a.n_heads * hd, a.n_kv_heads * hd);
    let prefix = text_prefix(a);
    let mut t = ParamTable::new(&a.dtype);
    let tok_embeddings = t.add(
        Decl::new("tok_embeddings.weight", [a.vocab_size, d])
            .normal(1.0)
            .vocab()
            .hf_name(&format!("{prefix}.embed_tokens.weight")),
    );
    let layers = (0..a.n_layers)
        .map(|i| {
            let std = 0.02;
            let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
            let mut l = t.layer(i, &format!("layers.{i}"), &format!("{prefix}.layers.{i}"));
            let attention_norm = centred_norm(&mut l, d, "attention_norm", "input_layernorm");
            let attention_post_norm = a.spark.is_none().then(|| {
                centred_norm(&mut l, d, "attention_post_norm", "post_attention_layernorm")
            });
            let ffn_norm = centred_norm(&mut l, d, "ffn_norm", "pre_feedforward_layernorm");
            let ffn_post_norm =
                centred_norm(&mut l, d, "ffn_post_norm", "post_feedforward_layernorm");
            let residual_gates = a.spark.is_some().then(|| {
                [
                    "post_attention_residual_gate",
                    "post_feedforward_residual_gate",
                ]
                .map(|g| {
                    l.add(
                        Decl::new(&format!("{g}.gate"), [d])
                            .init(Init::Zeros)
                            .dtype("f32")
                            .hf_name(&format!("{g}.gate")),
                    )
                })
            });
            let attention = GqaParams {
                wq: Proj::new(linear(
                    &mut l,
                    "attention.wq",
                    [q_dim, d],
                    std,
                    "self_attn.q_proj",
                    true,
                )),
                wk: Proj::new(linear(
                    &mut l,
                    "attention.wk",
                    [kv_dim, d],
                    std,
                    "self_attn.k_proj",
                    true,
                )),
                wv: Proj::new(linear(
                    &mut l,
                    "attention.wv",
                    [kv_dim, d],
                    std,
                    "self_attn.v_proj",
                    true,
                )),
                gate: Some(Proj::new(linear(
                    &mut l,
                    "attention.gate",
                    [q_dim, d],
                    std,
                    "self_attn.gate_proj",
                    true,
                ))),
                wo: Proj::new(linear(
                    &mut l,
                    "attention.wo",
                    [d, q_dim],
                    depth_std,
                    "self_attn.o_proj",
                    false,
                )),
                qk_norm: None,
                sinks: None,
            };
            let ffn = match &a.spark {
                Some(sp) if a.is_sparse(i) => {
                    FeedForward::Latent(declare_experts(&mut l, sp, d, std, depth_std))
                }
                _ => FeedForward::Dense([
                    linear(
                        &mut l,
                        "feed_forward.w1",
                        [f, d],
                        std,
                        "mlp.gate_proj",
                        true,
                    ),
                    linear(&mut l, "feed_forward.w3", [f, d], std, "mlp.up_proj", true),
                    linear(
                        &mut l,
                        "feed_forward.w2",
                        [d, f],
                        depth_std,
                        "mlp.down_proj",
                        false,
                    ),
                ]),
            };
            BlockParams {
                attention_norm,
                attention,
                attention_post_norm,
                ffn_norm,
                ffn,
                ffn_post_norm,
                residual_gates,
            }
        })
        .collect();
    let norm = t.add(
        Decl::new("norm.weight", [d])
            .ones()
            .hf_name(&format!("{prefix}.norm.weight")),
    );
    let output = if a.tie_embeddings {
        tok_embeddings.clone()
    } else {
        t.add(
            Decl::new("output.weight", [a.vocab_size, d])
                .trunc_normal((d as f64).powf(-0.5))
                .column()
                .hf_name("lm_head.weight"),
        )
    };
    let vision = a.vision.as_ref().map(|v| declare_tower(&mut t, v, d));
    let audio = a.audio.as_ref().map(|au| declare_audio(&mut t, au, d));
    let params = MuseParams {
        tok_embeddings,
        layers,
        norm,
        output,
        vision,
        audio,
    };
    (params, t.into_specs())
}

/// A centred RMSNorm's gain `[d]` (zeros: `1 + w` starts at 1).
fn centred_norm(l: &mut LayerScope<'_>, d: usize, name: &str, hf: &str) -> Param {
    l.add(
        Decl::new(&format!("{name}.weight"), [d])
            .init(Init::Zeros)
            .hf_name(&format!("{hf}.weight")),
    )
}

/// A projection `{name}.weight` of `shape`, split by its output (`col`) or input under tensor
/// parallelism.
fn linear(
    l: &mut LayerScope<'_>,
    name: &str,
    shape: [usize; 2],
    std: f64,
    hf: &str,
    col: bool,
) -> Param {
    let decl = Decl::new(&format!("{name}.weight"), shape)
        .trunc_normal(std)
        .hf_name(&format!("{hf}.weight"));
    l.add(if col { decl.column() } else { decl.row() })
}

/// A sparse block's experts under `mlp.`: stacked `[n_experts, ..]` with `expert_dim` 0, the
/// gates and ups the halves of transformers' fused `gate_up_proj`.
fn declare_experts(
    l: &mut LayerScope<'_>,
    sp: &SparkArgs,
    d: usize,
    std: f64,
    depth_std: f64,
) -> LatentExperts {
    let (e, f, m) = (sp.n_experts, sp.expert_ffn_dim, sp.latent_dim);
    let mut norm = |name: &str, hf: &str| {
        l.add(
            Decl::new(name, [m])
                .init(Init::Zeros)
                .replicated()
                .hf_name(hf),
        )
    };
    let (pre_norm, post_norm) = (
        norm("moe.pre_norm.weight", "mlp.pre_expert_norm.weight"),
        norm(
            "moe.post_norm.weight",
            "mlp.experts.post_expert_norm.weight",
        ),
    );
    let mut add = |d: Decl| l.add(d);
    let stacked = |name: &str, shape: [usize; 3], std: f64, hf: HfMap| {
        Decl::new(name, shape)
            .trunc_normal(std)
            .expert_dim(0)
            .hf(hf)
    };
    let fused = |part| HfMap::one("mlp.experts.gate_up_proj").part(1, part, 2, false);
    LatentExperts {
        router: add(Decl::new("moe.router.weight", [e, d])
            .trunc_normal(std)
            .replicated()
            .hf_name("mlp.gate.weight")),
        bias: add(Decl::new("moe.router.bias", [e])
            .init(Init::Zeros)
            .buffer()
            .hf_name("mlp.gate.e_score_correction_bias")),
        pre_proj: add(Decl::new("moe.pre_proj.weight", [m, d])
            .trunc_normal(std)
            .replicated()
            .hf_name("mlp.pre_expert_proj.weight")),
        pre_norm,
        gate: add(stacked("moe.gate", [e, f, m], std, fused(0))),
        up: add(stacked("moe.up", [e, f, m], std, fused(1))),
        down: add(stacked(
            "moe.down",
            [e, m, f],
            depth_std,
            HfMap::one("mlp.experts.down_proj"),
        )),
        post_norm,
        post_proj: add(Decl::new("moe.post_proj.weight", [d, m])
            .trunc_normal(depth_std)
            .replicated()
            .hf_name("mlp.post_expert_proj.weight")),
    }
}

/// The audio tower's parameters under transformers' names (`model.audio_tower.`): unit norm
/// gains, zero biases, truncated normal matrices and kernels.
fn declare_audio(t: &mut ParamTable, au: &AudioArgs, text_dim: usize) -> AudioTower {
    let mut width = 1;
    let mut stages = vec![];
    for (s, (&h, (&p, &depth))) in au
        .hidden_sizes
        .iter()
        .zip(au.patch_sizes.iter().zip(&au.depths))
        .enumerate()
    {
        let stage = format!("audio_tower.layers.{s}");
        let patch = audio_proj(
            t,
            &format!("{stage}.patch_embedder.proj"),
            vec![h, width * p],
        );
        let patch_norm = audio_param(t, &format!("{stage}.patch_embedder.norm.weight"), vec![h]);
        let inner = (h as f64 * au.mlp_ratio) as usize;
        let blocks = (0..depth)
            .map(|b| {
                let block = format!("{stage}.conv_blocks.{b}");
                let conv = audio_proj(t, &format!("{block}.conv"), vec![h, 1, au.conv_kernel_size]);
                ConvBlock {
                    conv: conv.weight,
                    conv_bias: conv.bias.expect("declared with a bias"),
                    norm: audio_param(t, &format!("{block}.norm.weight"), vec![h]),
                    mlp: [
                        audio_proj(t, &format!("{block}.mlp.fc1"), vec![inner, h]),
                        audio_proj(t, &format!("{block}.mlp.fc2"), vec![h, inner]),
                    ],
                }
            })
            .collect();
        stages.push(Stage {
            patch,
            patch_norm,
            blocks,
        });
        width = h;
    }
    AudioTower {
        stages,
        norm: audio_param(t, "audio_tower.norm.weight", vec![width]),
        proj: audio_proj(t, "audio_tower.proj", vec![text_dim, width]),
        post_proj_norm: audio_param(t, "audio_tower.post_proj_norm.weight", vec![text_dim]),
    }
}

/// One of the audio tower's tensors, `model.{name}` in a checkpoint, whole on every rank.
fn audio_param(t: &mut ParamTable, name: &str, shape: Vec<usize>) -> Param {
    let decl = Decl::new(name, shape.clone())
        .replicated()
        .hf_name(&format!("model.{name}"));
    t.add(match (shape.len(), name.ends_with(".bias")) {
        (1, true) => decl.init(Init::Zeros),
        (1, false) => decl.ones(),
        _ => decl.trunc_normal(0.02),
    })
}

/// The audio tower's `{name}.weight` of `shape` with its bias.
fn audio_proj(t: &mut ParamTable, name: &str, shape: Vec<usize>) -> Proj {
    let bias_shape = vec![shape[0]];
    let weight = audio_param(t, &format!("{name}.weight"), shape);
    Proj {
        weight,
        bias: Some(audio_param(t, &format!("{name}.bias"), bias_shape)),
    }
}

/// The vision tower's, adapter's and projection's parameters: transformers' names, zero biases,
/// unit LayerNorm gains, truncated normal matrices.
fn declare_tower(t: &mut ParamTable, v: &VisionArgs, text_dim: usize) -> Tower {
    let (h, std) = (v.hidden_size, 0.02);
    let mut add = |name: &str, shape: Vec<usize>, hf: &str| {
        // Whole on every tensor-parallel rank: the tower is small beside the decoder.
        let decl = Decl::new(name, shape.clone()).hf_name(hf).replicated();
        t.add(match (shape.len(), name.ends_with(".bias")) {
            (1, true) => decl.init(Init::Zeros),
            (1, false) => decl.ones(),
            _ => decl.trunc_normal(std),
        })
    };
    let tower = "model.vision_tower";
    let patch_dim = v.patch_temporal * 3 * v.patch_size * v.patch_size;
    let patch = add(
        "vision.patch_embedding.weight",
        vec![h, patch_dim],
        &format!("{tower}.patch_embedder.patch_embedding.weight"),
    );
    let positions = add(
        "vision.position_embedding.weight",
        vec![v.pos_emb_height * v.pos_emb_width, h],
        &format!("{tower}.patch_embedder.position_embedding_table.weight"),
    );
    // A weight (a LayerNorm's gain, or a matrix) with its bias.
    let mut with_bias = |name: &str, shape: Vec<usize>, hf: &str| {
        let bias = add(
            &format!("{name}.bias"),
            vec![shape[0]],
            &format!("{hf}.bias"),
        );
        let weight = add(&format!("{name}.weight"), shape, &format!("{hf}.weight"));
        (weight, bias)
    };
    let proj = |(weight, bias): (Param, Param)| Proj {
        weight,
        bias: Some(bias),
    };
    let ln_pre = with_bias("vision.ln_pre", vec![h], &format!("{tower}.ln_pre"));
    let blocks = (0..v.depth)
        .map(|j| {
            let (ours, theirs) = (format!("vision.layers.{j}"), format!("{tower}.layers.{j}"));
            let mut part = |name: &str, shape: Vec<usize>| {
                with_bias(
                    &format!("{ours}.{name}"),
                    shape,
                    &format!("{theirs}.{name}"),
                )
            };
            Block {
                norm1: part("norm1", vec![h]),
                qkv: [
                    proj(part("attn.q_proj", vec![h, h])),
                    proj(part("attn.k_proj", vec![h, h])),
                    proj(part("attn.v_proj", vec![h, h])),
                ],
                proj: proj(part("attn.proj", vec![h, h])),
                norm2: part("norm2", vec![h]),
                mlp: [
                    proj(part("mlp.fc1", vec![v.intermediate_size, h])),
                    proj(part("mlp.fc2", vec![h, v.intermediate_size])),
                ],
            }
        })
        .collect();
    let ln_post = with_bias("vision.ln_post", vec![h], &format!("{tower}.ln_post"));
    let p = v.projector_hidden_size;
    let adapter = [
        add(
            "vision.adapter.fc1.weight",
            vec![p, v.out_hidden_size],
            "model.vision_adapter.fc1.weight",
        ),
        add(
            "vision.adapter.fc2.weight",
            vec![p, p],
            "model.vision_adapter.fc2.weight",
        ),
    ];
    let projection = add(
        "vision.projection.weight",
        vec![text_dim, p],
        "model.vision_projection.weight",
    );
    Tower {
        patch,
        positions,
        ln_pre,
        blocks,
        ln_post,
        adapter,
        projection,
    }
}

/// Every parameter's spec.
pub fn params(a: &MuseArgs) -> Vec<ParamSpec> {
    declare(a).1
}

/// The full spec: parameters, layers, KV-cache needs, FLOPs and the Hugging Face config.
pub fn model_spec(a: &MuseArgs, params: Vec<ParamSpec>) -> ModelSpec {
    let n = |pred: &dyn Fn(&ParamSpec) -> bool| -> usize {
        params
            .iter()
            .filter(|p| pred(p))
            .map(|p| p.shape.iter().product::<usize>())
            .sum()
    };
    // 6 FLOPs per parameter per token for the matmuls a text token goes through (not the
    // embedding lookup, not the tower), plus attention scores and values.
    let dense = n(&|p| {
        !p.name.starts_with("vision.")
            && !p.name.starts_with("audio_tower.")
            && p.name != "tok_embeddings.weight"
    });
    // Of a sparse block's experts, a token goes through top-k.
    let idle: usize = (0..a.n_layers)
        .filter(|&i| a.is_sparse(i))
        .filter_map(|_| a.spark.as_ref())
        .map(|sp| (sp.n_experts - sp.top_k) * 3 * sp.expert_ffn_dim * sp.latent_dim)
        .sum();
    let dense = dense - idle;
    let attn = 12.0 * (a.n_layers * a.n_heads * a.head_dim * a.max_seq_len) as f64;
    ModelSpec {
        architecture: "muse".into(),
        n_layers: a.n_layers,
        vocab_size: a.vocab_size,
        max_seq_len: a.max_seq_len,
        flops_per_token: 6.0 * dense as f64 + attn,
        context_flops_per_token: attn / a.max_seq_len.max(1) as f64,
        active_params: (idle > 0).then(|| n(&|_| true) - idle),
        kv_cache: vec![Some((a.n_kv_heads, a.head_dim)); a.n_layers],
        hf: Some(hf::adapter(a)),
        params,
        // Checked under TP(2): the gate splits by heads with the queries; the QK-norm has no
        // gains to split. Muse Spark's latent experts are not split yet.
        parallel: ParallelSupport {
            tensor: a.spark.is_none(),
            experts_outside_moe_op: a.spark.is_some(),
        },
    }
}
