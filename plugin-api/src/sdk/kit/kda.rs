//! Kimi Delta Attention (KDA; Kimi Linear, Kimi K3): the gated delta rule with a decay per key
//! channel, written with host ops.
//!
//! ```text
//! q, k, v = split(SiLU(CausalConv_K([W_q x, W_k x, W_v x])))      one depthwise conv, [B,T,H,D]
//! g       = −exp(A_log) · softplus(W_fb W_fa x + dt_bias)          log decay per channel [B,T,H,D]
//!         = lb · σ(exp(A_log) · (W_fb W_fa x + dt_bias))           with a lower bound lb < 0 (K3)
//! β       = σ(W_b x)                                               write strength [B,T,H]
//! S_t     = diag(e^{g_t}) S_{t−1};  S_t += k̂_t (β_t (v_t − S_tᵀ k̂_t))ᵀ;  o_t = S_tᵀ q̂_t / √D
//!           (q̂, k̂ L2-normalised over D)
//! out     = W_o · (w ⊙ RMSNorm(o) ⊙ σ(G x))                        gated RMSNorm per head
//! ```
//! `G` is the low-rank `W_gb W_ga` (Kimi Linear) or one full-rank matrix (Kimi K3). The
//! recurrence is the host's `gated_delta_rule` (chunked in training, the recurrent state and the
//! convolution's tail kept by the host when decoding). A plugin declares the parameters under
//! its checkpoint's names with [`declare`] and runs them with [`forward`].

use crate::sdk::{Ctx, Decl, DeltaRuleOpts, HfMap, Init, LayerScope, Param, Result, Tensor};

/// Rows per chunk of the host's chunked delta rule (for the FLOP count).
pub const CHUNK: usize = 64;

/// KDA's shapes: queries, keys and values have `n_heads` heads of `head_dim`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KdaShape {
    /// Heads.
    pub n_heads: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// Kernel of the causal depthwise convolution.
    pub conv_kernel: usize,
}

/// How the forget gate's projection becomes the log decay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KdaDecay {
    /// `−exp(A_log) · softplus(f + dt_bias)` (Kimi Linear).
    Softplus,
    /// `lb · σ(exp(A_log) · (f + dt_bias))`, bounded in `(lb, 0)` (Kimi K3's safe gate).
    LowerBound(f64),
}

/// The output gate's projection.
pub enum KdaOutputGate {
    /// `W_gb [H·D, D] · W_ga [D, dim]`.
    LowRank(Param, Param),
    /// `W_g [H·D, dim]`.
    Full(Param),
}

/// One KDA block's parameters.
pub struct KdaParams {
    /// `[H·D, dim]` each: the query, key and value projections.
    pub wq: Param,
    /// See `wq`.
    pub wk: Param,
    /// See `wq`.
    pub wv: Param,
    /// `[3·H·D, 1, K]`: the depthwise convolution over `[q, k, v]`.
    pub conv: Param,
    /// `H` values: the log of each head's decay rate.
    pub a_log: Param,
    /// `H·D` values: the bias inside the decay's gate.
    pub dt_bias: Param,
    /// `[D, dim]`, `[H·D, D]`: the low-rank forget-gate projection.
    pub f_a: Param,
    /// See `f_a`.
    pub f_b: Param,
    /// `[H, dim]`: the write strength β's projection.
    pub b_proj: Param,
    /// The output gate.
    pub out_gate: KdaOutputGate,
    /// `[D]`: the gated RMSNorm's weight, shared by the heads.
    pub o_norm: Param,
    /// `[dim, H·D]`.
    pub wo: Param,
}

/// Where a checkpoint keeps KDA's tensors (relative to the block), and the shapes it gives the
/// decay's parameters.
pub struct KdaHfNames<'a> {
    /// The three convolutions, `{p}` standing for `q`, `k`, `v`.
    pub conv: &'a str,
    /// The forget gate's two projections.
    pub forget: [&'a str; 2],
    /// β's projection.
    pub beta: &'a str,
    /// The output gate's projections: one name (full rank) or two (low rank).
    pub out_gate: &'a [&'a str],
    /// `A_log`'s shape (the `H` values).
    pub a_log_shape: &'a [usize],
    /// `dt_bias`'s shape (the `H·D` values).
    pub dt_bias_shape: &'a [usize],
}

/// Declares block scope `l`'s KDA parameters under `attention.` (Hugging Face names under
/// `self_attn.`): truncated normal projections (`depth_std` for the output, which writes into
/// the residual stream), the convolution uniform in `±1/√K` (PyTorch's `Conv1d` default), and
/// the decay as FLA initialises it: `A_log = ln U(1, 16)` and `dt_bias` the inverse softplus of
/// a log-uniform `dt ∈ [1e-3, 0.1]`, here drawn directly as `U(ln 1e-3, ln 0.1)` (the inverse
/// softplus of a small `dt` is `ln dt` to within 5%).
pub fn declare(
    l: &mut LayerScope,
    dim: usize,
    k: &KdaShape,
    names: &KdaHfNames,
    depth_std: f64,
) -> KdaParams {
    let (h, d) = (k.n_heads, k.head_dim);
    let hd = h * d;
    let std = 0.02;
    let mut linear = |name: &str, hf: &str, shape: [usize; 2], std: f64, col: bool| {
        let decl = Decl::new(&format!("attention.{name}.weight"), shape)
            .trunc_normal(std)
            .hf_name(&format!("self_attn.{hf}.weight"));
        l.add(if col { decl.column() } else { decl.row() })
    };
    let (wq, wk, wv) = (
        linear("q_proj", "q_proj", [hd, dim], std, true),
        linear("k_proj", "k_proj", [hd, dim], std, true),
        linear("v_proj", "v_proj", [hd, dim], std, true),
    );
    let (f_a, f_b) = (
        linear("f_a_proj", names.forget[0], [d, dim], std, false),
        linear("f_b_proj", names.forget[1], [hd, d], std, true),
    );
    let b_proj = linear("b_proj", names.beta, [h, dim], std, true);
    let out_gate = match names.out_gate {
        [full] => KdaOutputGate::Full(linear("g_proj", full, [hd, dim], std, true)),
        [a, b, ..] => KdaOutputGate::LowRank(
            linear("g_a_proj", a, [d, dim], std, false),
            linear("g_b_proj", b, [hd, d], std, true),
        ),
        [] => KdaOutputGate::Full(linear("g_proj", "g_proj", [hd, dim], std, true)),
    };
    let wo = linear("o_proj", "o_proj", [dim, hd], depth_std, false);
    let bound = (k.conv_kernel as f64).powf(-0.5);
    let conv = l.add(
        Decl::new("attention.conv1d.weight", [3 * hd, 1, k.conv_kernel])
            .init(Init::Uniform {
                lo: -bound,
                hi: bound,
            })
            .hf(HfMap::concat(
                ["q", "k", "v"]
                    .iter()
                    .map(|p| format!("self_attn.{}", names.conv.replace("{p}", p)))
                    .collect(),
                0,
            )),
    );
    let a_log = l.add(
        Decl::new("attention.A_log", names.a_log_shape.to_vec())
            .init(Init::Uniform {
                lo: 0.0,
                hi: 16f64.ln(),
            })
            .replicated()
            .hf_name("self_attn.A_log"),
    );
    let dt_bias = l.add(
        Decl::new("attention.dt_bias", names.dt_bias_shape.to_vec())
            .init(Init::Uniform {
                lo: 1e-3f64.ln(),
                hi: 0.1f64.ln(),
            })
            .hf_name("self_attn.dt_bias"),
    );
    let o_norm = l.add(
        Decl::new("attention.o_norm.weight", [d])
            .ones()
            .hf_name("self_attn.o_norm.weight"),
    );
    KdaParams {
        wq,
        wk,
        wv,
        conv,
        a_log,
        dt_bias,
        f_a,
        f_b,
        b_proj,
        out_gate,
        o_norm,
        wo,
    }
}

/// `y` in f32 (the decay is computed in float, as transformers does).
fn f32<'h>(y: Tensor<'h>) -> Result<Tensor<'h>> {
    if y.dtype()? == "f32" {
        Ok(y)
    } else {
        y.to_dtype("f32")
    }
}

/// KDA of block `index` on `x [B, T, dim]`; `eps` is the gated RMSNorm's (the model's
/// `rms_norm_eps`).
pub fn forward<'h>(
    ctx: &Ctx<'h>,
    p: &KdaParams,
    k: &KdaShape,
    decay: KdaDecay,
    index: usize,
    x: &Tensor<'h>,
    eps: f64,
) -> Result<Tensor<'h>> {
    let (b, t) = {
        let s = x.shape()?;
        (s[0] as i64, s[1] as i64)
    };
    let (h, d) = (k.n_heads as i64, k.head_dim as i64);
    let hd = (h * d) as usize;
    let heads_btd = |y: &Tensor<'h>| y.reshape(&[b, t, h, d]);
    let cache_layer = ctx.use_cache.then_some(index);

    // One convolution over [q, k, v], so decode keeps one tail of K−1 inputs per layer.
    let qkv_btc = ctx.host.cat(
        &[
            &x.linear(&ctx.w(&p.wq)?)?,
            &x.linear(&ctx.w(&p.wk)?)?,
            &x.linear(&ctx.w(&p.wv)?)?,
        ],
        2,
    )?;
    let w_conv = ctx
        .w(&p.conv)?
        .reshape(&[3 * hd as i64, k.conv_kernel as i64])?;
    let qkv_btc = qkv_btc.causal_conv1d(&w_conv, true, cache_layer)?;
    let q_bthd = heads_btd(&qkv_btc.narrow(2, 0, hd)?)?;
    let k_bthd = heads_btd(&qkv_btc.narrow(2, hd, hd)?)?;
    let v_bthd = heads_btd(&qkv_btc.narrow(2, 2 * hd, hd)?)?;

    let rate_h1 = f32(ctx.w(&p.a_log)?.reshape(&[h, 1])?)?.unary("exp")?;
    let f_bthd = heads_btd(
        &f32(x.linear(&ctx.w(&p.f_a)?)?.linear(&ctx.w(&p.f_b)?)?)?
            .add(&f32(ctx.w(&p.dt_bias)?.reshape(&[h * d])?)?)?,
    )?;
    let g_bthd = match decay {
        KdaDecay::Softplus => f_bthd.unary("softplus")?.mul(&rate_h1.scale(-1.0)?)?,
        KdaDecay::LowerBound(lb) => f_bthd.mul(&rate_h1)?.unary("sigmoid")?.scale(lb)?,
    };
    let beta_bth = x.linear(&ctx.w(&p.b_proj)?)?.unary("sigmoid")?;

    let opts = DeltaRuleOpts {
        scale: None,
        qk_l2norm: true,
        cache_layer,
    };
    let o_bthd = q_bthd.gated_delta_rule(&k_bthd, &v_bthd, &g_bthd, &beta_bth, &opts)?;
    let gate = match &p.out_gate {
        KdaOutputGate::LowRank(a, g_b) => x.linear(&ctx.w(a)?)?.linear(&ctx.w(g_b)?)?,
        KdaOutputGate::Full(w) => x.linear(&ctx.w(w)?)?,
    };
    o_bthd
        .rms_norm(&ctx.w(&p.o_norm)?, eps)?
        .mul(&heads_btd(&gate)?.unary("sigmoid")?)?
        .reshape(&[b, t, h * d])?
        .linear(&ctx.w(&p.wo)?)
}

/// Training FLOPs per token of the chunked delta rule in one KDA block (forward and backward,
/// 3× the forward like the 6-per-parameter rule), beyond the projections and the convolution
/// (which the parameter count covers). Per head and chunk of `C` tokens, with `Dk = Dv = D`:
/// the intra-chunk products `(k β e^g)(k e^−g)ᵀ` and `(q e^g)(k e^−g)ᵀ` (2·2C²D), the
/// triangular solve (⅔C³), applying its inverse to `v β` and `k β e^g` (2·2C²D), the
/// intra-chunk output (2C²D), and three products with the `[D, D]` state (reading it with
/// `q` and with `w`, updating it: 3·2CD²).
pub fn train_flops_per_token(k: &KdaShape) -> f64 {
    let (c, d) = (CHUNK as f64, k.head_dim as f64);
    let per_chunk = 10.0 * c * c * d + 2.0 / 3.0 * c * c * c + 6.0 * c * d * d;
    3.0 * k.n_heads as f64 * per_chunk / c
}
