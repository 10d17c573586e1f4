//! The parameters of a DeepSeek-V4 model, each declared once: shape, init, placement and the
//! name it has in a checkpoint transformers saves (DeepSeek's own layout: `attn.wq_a`,
//! `ffn.experts.{e}.w1`, `hc_attn_fn`, ...), giving the handle `model.rs` fetches it with.
//! Also the costs.

use crate::config::{AttentionType, DeepseekV4Args, MlpType};
use crate::hf;
use anneal_plugin_api::sdk::{
    Decl, HfMap, Init, LayerScope, ModelSpec, Param, ParamSpec, ParamTable,
};

/// A hyper-connection's weights: `fn [(2 + N)·N, N·D]` (or `[N, N·D]` for the head),
/// `base` and the per-output `scale`.
pub struct HyperConnection {
    /// Projection of the flattened streams to the mixing logits.
    pub fn_: Param,
    /// Bias of the mixing logits.
    pub base: Param,
    /// Scales of the pre, post and comb logits (one for the head).
    pub scale: Param,
}

/// A compressor: gated pooling of `rate` tokens into one entry of `dim` (two series of `dim`
/// each for the overlapping CSA windows).
pub struct Compressor {
    /// Values `[width, D]`.
    pub wkv: Param,
    /// Gate logits `[width, D]`.
    pub wgate: Param,
    /// Per-slot gate bias `[rate, width]` (`ape`).
    pub ape: Param,
    /// RMSNorm of the pooled entry `[dim]`.
    pub norm: Param,
}

/// The lightning indexer of a CSA block.
pub struct Indexer {
    /// Its own compressor at `index_head_dim`.
    pub compressor: Compressor,
    /// Index queries from the query latent `[Hi·Di, q_lora_rank]`.
    pub wq_b: Param,
    /// Per-head weights of the scores `[Hi, D]`.
    pub weights_proj: Param,
}

/// A block's attention.
pub struct AttentionParams {
    /// `[H]` attention sinks.
    pub sinks: Param,
    /// Query down-projection `[q_lora_rank, D]`.
    pub wq_a: Param,
    /// RMSNorm of the query latent.
    pub q_norm: Param,
    /// Query up-projection `[H·Dh, q_lora_rank]`.
    pub wq_b: Param,
    /// The one key/value head `[Dh, D]`.
    pub wkv: Param,
    /// Its RMSNorm.
    pub kv_norm: Param,
    /// Grouped output projection, per group `[o_groups·o_lora_rank, H·Dh/o_groups]`.
    pub wo_a: Param,
    /// Output mixing `[D, o_groups·o_lora_rank]`.
    pub wo_b: Param,
    /// The compressor (CSA and HCA blocks).
    pub compressor: Option<Compressor>,
    /// The indexer (CSA blocks).
    pub indexer: Option<Indexer>,
}

/// A SwiGLU feed-forward `W2 · (SiLU(W1 x) ⊙ W3 x)`.
pub struct SwiGlu {
    /// Gate `[ffn, dim]`.
    pub w1: Param,
    /// Down projection `[dim, ffn]`.
    pub w2: Param,
    /// Up `[ffn, dim]`.
    pub w3: Param,
}

/// How a block chooses its experts.
pub enum Routing {
    /// The router's top-k, steered by an aux-loss-free bias (a buffer).
    Learned {
        /// `[E]` balancing bias.
        bias: Param,
    },
    /// A fixed table of experts per token id (a buffer, f32 `[vocab, top_k]`).
    Hash {
        /// `tid2eid`.
        table: Param,
    },
}

/// A block's mixture of experts.
pub struct MoeParams {
    /// Router `[E, D]` (its scores weigh the experts in both routings).
    pub router: Param,
    /// Expert choice.
    pub routing: Routing,
    /// Gates `[E, F, D]`.
    pub w1: Param,
    /// Downs `[E, D, F]`.
    pub w2: Param,
    /// Ups `[E, F, D]`.
    pub w3: Param,
    /// The shared expert.
    pub shared: SwiGlu,
}

/// The parameters of one block.
pub struct BlockParams {
    /// Hyper-connection around the attention.
    pub hc_attn: HyperConnection,
    /// RMSNorm before the attention.
    pub attention_norm: Param,
    /// The attention.
    pub attention: AttentionParams,
    /// Hyper-connection around the feed-forward.
    pub hc_ffn: HyperConnection,
    /// RMSNorm before the feed-forward.
    pub ffn_norm: Param,
    /// The feed-forward.
    pub ffn: MoeParams,
}

/// Every parameter of the model.
pub struct DeepseekV4Params {
    /// Token embeddings `[vocab, dim]`.
    pub tok_embeddings: Param,
    /// The blocks.
    pub layers: Vec<BlockParams>,
    /// The head's collapse of the streams.
    pub hc_head: HyperConnection,
    /// Final RMSNorm.
    pub norm: Param,
    /// Output projection `[vocab, dim]` (the embedding table when tied).
    pub output: Param,
    /// The multi-token prediction module, when `mtp_layers` is 1.
    pub mtp: Option<MtpParams>,
}

/// DeepSeek-V4's multi-token prediction module (depth 1): from the main model's streams at
/// `i` and the embedding of token `i + 1`, one more block predicts token `i + 2` through the
/// shared embedding and output projection (as DeepSeek-V3's, with the streams kept apart).
pub struct MtpParams {
    /// RMSNorm of the next token's embedding.
    pub enorm: Param,
    /// RMSNorm of the main model's streams.
    pub hnorm: Param,
    /// `[dim, dim]`: the normalised embedding into the block's input (added to every stream).
    pub e_proj: Param,
    /// `[dim, dim]`: each normalised stream into the block's input.
    pub h_proj: Param,
    /// The block.
    pub block: BlockParams,
    /// Its own collapse of the streams before the shared output projection.
    pub hc_head: HyperConnection,
    /// RMSNorm before the shared output projection.
    pub norm: Param,
}

fn linear(l: &mut LayerScope<'_>, name: &str, shape: [usize; 2], std: f64, hf: &str) -> Param {
    l.add(Decl::new(name, shape).normal(std).hf_name(hf))
}

fn norm(l: &mut LayerScope<'_>, name: &str, n: usize, hf: &str) -> Param {
    l.add(Decl::new(name, [n]).ones().dtype("f32").hf_name(hf))
}

fn hyper_connection(
    l: &mut LayerScope<'_>,
    at: &str,
    hf: &str,
    a: &DeepseekV4Args,
) -> HyperConnection {
    let n = a.hc_mult;
    let rows = (2 + n) * n;
    // transformers keeps these in f32 whatever the model's dtype, as for the norms.
    HyperConnection {
        fn_: l.add(
            Decl::new(&format!("{at}.fn"), [rows, n * a.dim])
                .normal(0.02)
                .dtype("f32")
                .replicated()
                .hf_name(&format!("{hf}_fn")),
        ),
        base: l.add(
            Decl::new(&format!("{at}.base"), [rows])
                .dtype("f32")
                .hf_name(&format!("{hf}_base")),
        ),
        scale: l.add(
            Decl::new(&format!("{at}.scale"), [3])
                .ones()
                .dtype("f32")
                .hf_name(&format!("{hf}_scale")),
        ),
    }
}

fn compressor(
    l: &mut LayerScope<'_>,
    at: &str,
    hf: &str,
    d: usize,
    dim: usize,
    rate: usize,
    overlap: bool,
) -> Compressor {
    let width = if overlap { 2 * dim } else { dim };
    Compressor {
        wkv: linear(
            l,
            &format!("{at}.wkv.weight"),
            [width, d],
            0.02,
            &format!("{hf}.wkv.weight"),
        ),
        wgate: linear(
            l,
            &format!("{at}.wgate.weight"),
            [width, d],
            0.02,
            &format!("{hf}.wgate.weight"),
        ),
        ape: l.add(
            Decl::new(&format!("{at}.ape"), [rate, width])
                .dtype("f32")
                .replicated()
                .hf_name(&format!("{hf}.ape")),
        ),
        norm: norm(
            l,
            &format!("{at}.norm.weight"),
            dim,
            &format!("{hf}.norm.weight"),
        ),
    }
}

fn attention(
    a: &DeepseekV4Args,
    l: &mut LayerScope<'_>,
    i: usize,
    depth_std: f64,
) -> AttentionParams {
    let (d, h, hd, rq) = (a.dim, a.n_heads, a.head_dim, a.q_lora_rank);
    let t = a.layer_type(i);
    let main_compressor = a.rate(t).map(|rate| {
        let overlap = t == AttentionType::CompressedSparseAttention;
        compressor(
            l,
            "attention.compressor",
            "attn.compressor",
            d,
            hd,
            rate,
            overlap,
        )
    });
    let indexer = (t == AttentionType::CompressedSparseAttention).then(|| Indexer {
        compressor: compressor(
            l,
            "attention.indexer.compressor",
            "attn.indexer.compressor",
            d,
            a.index_head_dim,
            a.csa_rate,
            true,
        ),
        wq_b: linear(
            l,
            "attention.indexer.wq_b.weight",
            [a.index_n_heads * a.index_head_dim, rq],
            0.02,
            "attn.indexer.wq_b.weight",
        ),
        weights_proj: linear(
            l,
            "attention.indexer.weights_proj.weight",
            [a.index_n_heads, d],
            0.02,
            "attn.indexer.weights_proj.weight",
        ),
    });
    let group_in = h * hd / a.o_groups;
    let gr = a.o_groups * a.o_lora_rank;
    AttentionParams {
        sinks: l.add(
            Decl::new("attention.sinks", [h])
                .dtype("f32")
                .hf_name("attn.attn_sink"),
        ),
        wq_a: linear(
            l,
            "attention.wq_a.weight",
            [rq, d],
            0.02,
            "attn.wq_a.weight",
        ),
        q_norm: norm(l, "attention.q_norm.weight", rq, "attn.q_norm.weight"),
        wq_b: linear(
            l,
            "attention.wq_b.weight",
            [h * hd, rq],
            0.02,
            "attn.wq_b.weight",
        ),
        wkv: linear(l, "attention.wkv.weight", [hd, d], 0.02, "attn.wkv.weight"),
        kv_norm: norm(l, "attention.kv_norm.weight", hd, "attn.norm.weight"),
        wo_a: linear(
            l,
            "attention.wo_a.weight",
            [gr, group_in],
            0.02,
            "attn.wo_a.weight",
        ),
        wo_b: linear(
            l,
            "attention.wo_b.weight",
            [d, gr],
            depth_std,
            "attn.wo_b.weight",
        ),
        compressor: main_compressor,
        indexer,
    }
}

fn moe(a: &DeepseekV4Args, l: &mut LayerScope<'_>, i: usize, depth_std: f64) -> MoeParams {
    let (d, e, f) = (a.dim, a.n_experts, a.expert_ffn_dim);
    let mut experts = |name: &str, shape: [usize; 3], std: f64, hf: &str| {
        l.add(
            Decl::new(name, shape)
                .normal(std)
                .expert_dim(0)
                .hf(HfMap::stack(hf, e)),
        )
    };
    let w1 = experts(
        "ffn.experts.w1",
        [e, f, d],
        0.02,
        "ffn.experts.{e}.w1.weight",
    );
    let w3 = experts(
        "ffn.experts.w3",
        [e, f, d],
        0.02,
        "ffn.experts.{e}.w3.weight",
    );
    let w2 = experts(
        "ffn.experts.w2",
        [e, d, f],
        depth_std,
        "ffn.experts.{e}.w2.weight",
    );
    let router = l.add(
        Decl::new("ffn.router.weight", [e, d])
            .normal(0.02)
            .replicated()
            .hf_name("ffn.gate.weight"),
    );
    let routing = match a.mlp_type(i) {
        MlpType::Moe => Routing::Learned {
            bias: l.add(
                Decl::new("ffn.router.balance_bias", [e])
                    .dtype("f32")
                    .buffer()
                    .hf_name("ffn.gate.bias"),
            ),
        },
        // Expert ids are small integers, exact in f32; a fresh model draws each token's
        // experts uniformly (transformers starts from all zeros and expects a checkpoint's).
        MlpType::HashMoe => Routing::Hash {
            table: l.add(
                Decl::new("ffn.router.tid2eid", [a.vocab_size, a.top_k])
                    .init(Init::Uniform {
                        lo: 0.0,
                        hi: e as f64 - 1e-3,
                    })
                    .dtype("f32")
                    .buffer()
                    .hf_name("ffn.gate.tid2eid"),
            ),
        },
    };
    let shared = SwiGlu {
        w1: linear(
            l,
            "ffn.shared.w1.weight",
            [f, d],
            0.02,
            "ffn.shared_experts.w1.weight",
        ),
        w3: linear(
            l,
            "ffn.shared.w3.weight",
            [f, d],
            0.02,
            "ffn.shared_experts.w3.weight",
        ),
        w2: linear(
            l,
            "ffn.shared.w2.weight",
            [d, f],
            depth_std,
            "ffn.shared_experts.w2.weight",
        ),
    };
    MoeParams {
        router,
        routing,
        w1,
        w2,
        w3,
        shared,
    }
}

/// Block `i`'s parameters in scope `l`: its attention type and routing are those of `i`
/// (a block past the last, as the MTP block is, slides and routes by the learned router).
fn block(a: &DeepseekV4Args, l: &mut LayerScope<'_>, i: usize) -> BlockParams {
    let d = a.dim;
    let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
    BlockParams {
        hc_attn: hyper_connection(l, "hc_attn", "hc_attn", a),
        attention_norm: norm(l, "attention_norm.weight", d, "attn_norm.weight"),
        attention: attention(a, l, i, depth_std),
        hc_ffn: hyper_connection(l, "hc_ffn", "hc_ffn", a),
        ffn_norm: norm(l, "ffn_norm.weight", d, "ffn_norm.weight"),
        ffn: moe(a, l, i, depth_std),
    }
}

/// The declarations of a head's collapse of the streams (`fn [N, N·D]`, `base [N]`, `scale
/// [1]`) named `{at}.fn`, ... and `{hf}fn`, ...
fn head_connection(a: &DeepseekV4Args, at: &str, hf: &str) -> [Decl; 3] {
    let n = a.hc_mult;
    [
        Decl::new(&format!("{at}.fn"), [n, n * a.dim])
            .normal(0.02)
            .dtype("f32")
            .replicated()
            .hf_name(&format!("{hf}fn")),
        Decl::new(&format!("{at}.base"), [n])
            .dtype("f32")
            .hf_name(&format!("{hf}base")),
        Decl::new(&format!("{at}.scale"), [1])
            .ones()
            .dtype("f32")
            .hf_name(&format!("{hf}scale")),
    ]
}

/// The MTP module after the blocks (scope index `n_layers`), named as DeepSeek's checkpoints
/// name it (`mtp.0.*`; transformers defines no MTP module and drops `mtp.*` when it loads).
/// Its block is the one DeepSeek's release puts there: `compress_ratios` ends with a 0 for it,
/// so it attends over the sliding window only, and it routes by the learned router.
fn mtp(a: &DeepseekV4Args, t: &mut ParamTable) -> MtpParams {
    let (d, i) = (a.dim, a.n_layers);
    let block = block(a, &mut t.layer(i, "mtp.block", "mtp.0"), i);
    let mut l = t.layer(i, "mtp", "mtp.0");
    let [fn_, base, scale] = head_connection(a, "hc_head", "hc_head_");
    MtpParams {
        enorm: norm(&mut l, "enorm.weight", d, "enorm.weight"),
        hnorm: norm(&mut l, "hnorm.weight", d, "hnorm.weight"),
        e_proj: linear(&mut l, "e_proj.weight", [d, d], 0.02, "e_proj.weight"),
        h_proj: linear(&mut l, "h_proj.weight", [d, d], 0.02, "h_proj.weight"),
        block,
        hc_head: HyperConnection {
            fn_: l.add(fn_),
            base: l.add(base),
            scale: l.add(scale),
        },
        norm: norm(&mut l, "norm.weight", d, "norm.weight"),
    }
}

/// Declares every parameter, initialised as transformers does (normal 0.02 matrices, ones for
/// norms and hyper-connection scales, zeros for sinks, biases and `ape`), the projections that
/// write into the residual streams depth-scaled.
pub fn declare(a: &DeepseekV4Args) -> (DeepseekV4Params, Vec<ParamSpec>) {
    let d = a.dim;
    let mut t = ParamTable::new(&a.dtype);
    let tok_embeddings = t.token_embedding(a.vocab_size, d);
    let layers = (0..a.n_layers)
        .map(|i| {
            let mut l = t.layer(i, &format!("layers.{i}"), &format!("model.layers.{i}"));
            block(a, &mut l, i)
        })
        .collect();
    let [fn_, base, scale] = head_connection(a, "hc_head", "model.hc_head.hc_");
    let hc_head = HyperConnection {
        fn_: t.add(fn_),
        base: t.add(base),
        scale: t.add(scale),
    };
    let mtp = (a.mtp_layers > 0).then(|| mtp(a, &mut t));
    let norm = t.add(
        Decl::new("norm.weight", [d])
            .ones()
            .dtype("f32")
            .hf_name("model.norm.weight"),
    );
    let output = if a.tie_embeddings {
        tok_embeddings.clone()
    } else {
        t.add(
            Decl::new("output.weight", [a.vocab_size, d])
                .trunc_normal((d as f64).powf(-0.5))
                .column()
                .hf_name("head.weight"),
        )
    };
    let params = DeepseekV4Params {
        tok_embeddings,
        layers,
        hc_head,
        norm,
        output,
        mtp,
    };
    (params, t.into_specs())
}

/// Parameters a token does not go through: the experts it is not routed to.
/// The MTP block counts among them: it trains, so its experts cost like a block's.
pub fn idle_params(a: &DeepseekV4Args) -> usize {
    (a.n_layers + a.mtp_layers) * (a.n_experts - a.top_k) * 3 * a.dim * a.expert_ffn_dim
}

/// Keys (window plus compressed blocks) one query of block `i` attends to, averaged over the
/// positions of a sequence of `s` tokens, and the compressed blocks its indexer scores.
pub fn attended(a: &DeepseekV4Args, i: usize, s: usize) -> (f64, f64) {
    let s = s as f64;
    let w = (a.sliding_window as f64).min(s);
    match a.layer_type(i) {
        AttentionType::SlidingAttention => (w, 0.0),
        AttentionType::HeavilyCompressedAttention => (w + s / a.hca_rate as f64 / 2.0, 0.0),
        AttentionType::CompressedSparseAttention => {
            let blocks = s / a.csa_rate as f64 / 2.0;
            (w + blocks.min(a.index_topk as f64), blocks)
        }
    }
}

/// Training FLOPs per token of block `i`'s attention core at sequence length `s`: scores and
/// values over the keys it attends to (`4 · H · Dh` per key forward, three times that with the
/// backward), plus the indexer's scores over the compressed blocks (`2 · Hi · Di` per block,
/// forward only: the top-k choice passes no gradient).
pub fn attention_flops(a: &DeepseekV4Args, i: usize, s: usize) -> f64 {
    let (keys, blocks) = attended(a, i, s);
    12.0 * (a.n_heads * a.head_dim) as f64 * keys
        + 2.0 * (a.index_n_heads * a.index_head_dim) as f64 * blocks
}

/// The full spec: parameters, layers, cache needs, FLOPs and the Hugging Face config.
///
/// Training FLOPs per token: 6 per trained parameter a token goes through (the embedding
/// lookup excluded unless it is the output head too), plus [`attention_flops`] per block at
/// `max_seq_len`, the MTP module's included (it trains).
pub fn model_spec(a: &DeepseekV4Args, params: Vec<ParamSpec>) -> ModelSpec {
    let n: usize = params
        .iter()
        .filter(|p| p.trainable)
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let idle = idle_params(a);
    let lookup = if a.tie_embeddings {
        0
    } else {
        a.vocab_size * a.dim
    };
    // The MTP module runs the shared output projection a second time.
    let dense = (n - lookup - idle + a.mtp_layers * a.vocab_size * a.dim) as f64;
    let attn: f64 = (0..a.n_layers + a.mtp_layers)
        .map(|i| attention_flops(a, i, a.max_seq_len))
        .sum();
    // What a token goes through when the model runs: the MTP module trains only.
    let mtp: usize = params
        .iter()
        .filter(|p| p.trainable && p.name.starts_with("mtp."))
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let mtp_idle = a.mtp_layers * (a.n_experts - a.top_k) * 3 * a.dim * a.expert_ffn_dim;
    ModelSpec {
        architecture: "deepseek_v4".into(),
        n_layers: a.n_layers,
        vocab_size: a.vocab_size,
        max_seq_len: a.max_seq_len,
        flops_per_token: 6.0 * dense + attn,
        // Compressed attention grows with the context, but not linearly: counted at
        // `max_seq_len` whatever the run's length.
        context_flops_per_token: 0.0,
        active_params: Some(n - idle - (mtp - mtp_idle)),
        // What a plain KV cache of this model holds: one shared key/value head per layer.
        // Decode keeps its own, smaller caches instead (`decode.rs`, [`decode_cache_bytes`]),
        // so estimates from this are upper bounds.
        kv_cache: vec![Some((1, a.head_dim)); a.n_layers],
        hf: Some(hf::adapter(a)),
        parallel: Default::default(),
        params,
    }
}
