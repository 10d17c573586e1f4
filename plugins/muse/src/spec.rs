//! Muse Glimmer's parameters, each declared once with its shape, init, placement and name in a
//! transformers checkpoint (the decoder under `model.language_model.`, the tower under
//! `model.vision_tower.`), and the model's costs.

use crate::config::{MuseArgs, VisionArgs};
use crate::hf;
use crate::vision::{Block, Tower};
use anneal_plugin_api::sdk::kit::blocks::{GqaParams, Proj};
use anneal_plugin_api::sdk::{
    Decl, Init, ModelSpec, ParallelSupport, Param, ParamSpec, ParamTable,
};

/// The parameters of one block.
pub struct BlockParams {
    /// Centred RMSNorm before attention.
    pub attention_norm: Param,
    /// Grouped-query attention with a separate sigmoid output gate `[n_heads · head_dim, dim]`.
    pub attention: GqaParams,
    /// Centred RMSNorm on the attention's output.
    pub attention_post_norm: Param,
    /// Centred RMSNorm before the feed-forward.
    pub ffn_norm: Param,
    /// SwiGLU gate, up and down projections.
    pub ffn: [Param; 3],
    /// Centred RMSNorm on the feed-forward's output.
    pub ffn_post_norm: Param,
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
            let mut norm = |name: &str, hf: &str| {
                l.add(
                    Decl::new(&format!("{name}.weight"), [d])
                        .init(Init::Zeros)
                        .hf_name(&format!("{hf}.weight")),
                )
            };
            let attention_norm = norm("attention_norm", "input_layernorm");
            let attention_post_norm = norm("attention_post_norm", "post_attention_layernorm");
            let ffn_norm = norm("ffn_norm", "pre_feedforward_layernorm");
            let ffn_post_norm = norm("ffn_post_norm", "post_feedforward_layernorm");
            let mut linear = |name: &str, shape: [usize; 2], std: f64, hf: &str, col: bool| {
                let decl = Decl::new(&format!("{name}.weight"), shape)
                    .trunc_normal(std)
                    .hf_name(&format!("{hf}.weight"));
                l.add(if col { decl.column() } else { decl.row() })
            };
            let attention = GqaParams {
                wq: Proj::new(linear(
                    "attention.wq",
                    [q_dim, d],
                    std,
                    "self_attn.q_proj",
                    true,
                )),
                wk: Proj::new(linear(
                    "attention.wk",
                    [kv_dim, d],
                    std,
                    "self_attn.k_proj",
                    true,
                )),
                wv: Proj::new(linear(
                    "attention.wv",
                    [kv_dim, d],
                    std,
                    "self_attn.v_proj",
                    true,
                )),
                gate: Some(Proj::new(linear(
                    "attention.gate",
                    [q_dim, d],
                    std,
                    "self_attn.gate_proj",
                    true,
                ))),
                wo: Proj::new(linear(
                    "attention.wo",
                    [d, q_dim],
                    depth_std,
                    "self_attn.o_proj",
                    false,
                )),
                qk_norm: None,
                sinks: None,
            };
            let ffn = [
                linear("feed_forward.w1", [f, d], std, "mlp.gate_proj", true),
                linear("feed_forward.w3", [f, d], std, "mlp.up_proj", true),
                linear("feed_forward.w2", [d, f], depth_std, "mlp.down_proj", false),
            ];
            BlockParams {
                attention_norm,
                attention,
                attention_post_norm,
                ffn_norm,
                ffn,
                ffn_post_norm,
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
    let params = MuseParams {
        tok_embeddings,
        layers,
        norm,
        output,
        vision,
    };
    (params, t.into_specs())
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
    let dense = n(&|p| !p.name.starts_with("vision.") && p.name != "tok_embeddings.weight");
    let attn = 12.0 * (a.n_layers * a.n_heads * a.head_dim * a.max_seq_len) as f64;
    ModelSpec {
        architecture: "muse".into(),
        n_layers: a.n_layers,
        vocab_size: a.vocab_size,
        max_seq_len: a.max_seq_len,
        flops_per_token: 6.0 * dense as f64 + attn,
        active_params: None,
        kv_cache: vec![Some((a.n_kv_heads, a.head_dim)); a.n_layers],
        hf: Some(hf::adapter(a)),
        params,
        // Checked under TP(2): the gate splits by heads with the queries; the QK-norm has no
        // gains to split.
        parallel: ParallelSupport { tensor: true },
    }
}
