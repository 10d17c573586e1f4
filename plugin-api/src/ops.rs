//! Host ops, declared once for both sides of the boundary. Each op is a struct of typed
//! attributes: the SDK builds it and sends [`OpAttrs::to_attrs`]; the host reads it back with
//! [`OpAttrs::from_attrs`], which names the op, the attribute and the type on a mismatch. The
//! wire format stays a positional [`Attr`] list, so the boundary's layout does not change when
//! an op is added; adding one touches this table, the SDK method, and the host's dispatch arm.

use crate::abi::{Attr, Handle};
use abi_stable::std_types::RVec;

/// A value that travels as one positional [`Attr`].
pub trait AttrValue: Sized {
    /// What it is, for messages.
    const KIND: &'static str;
    /// As an attribute.
    fn to_attr(&self) -> Attr;
    /// From an attribute (`None` when the caller sent fewer attributes).
    fn from_attr(a: Option<&Attr>) -> Option<Self>;
}

impl AttrValue for bool {
    const KIND: &'static str = "a bool";
    fn to_attr(&self) -> Attr {
        Attr::Bool(*self)
    }
    fn from_attr(a: Option<&Attr>) -> Option<Self> {
        match a {
            Some(Attr::Bool(v)) => Some(*v),
            _ => None,
        }
    }
}

impl AttrValue for i64 {
    const KIND: &'static str = "an integer";
    fn to_attr(&self) -> Attr {
        Attr::Int(*self)
    }
    fn from_attr(a: Option<&Attr>) -> Option<Self> {
        match a {
            Some(Attr::Int(v)) => Some(*v),
            _ => None,
        }
    }
}

impl AttrValue for f64 {
    const KIND: &'static str = "a number";
    fn to_attr(&self) -> Attr {
        Attr::Float(*self)
    }
    fn from_attr(a: Option<&Attr>) -> Option<Self> {
        match a {
            Some(Attr::Float(v)) => Some(*v),
            Some(Attr::Int(v)) => Some(*v as f64),
            _ => None,
        }
    }
}

impl AttrValue for Vec<i64> {
    const KIND: &'static str = "a list of integers";
    fn to_attr(&self) -> Attr {
        Attr::Ints(RVec::from(self.clone()))
    }
    fn from_attr(a: Option<&Attr>) -> Option<Self> {
        match a {
            Some(Attr::Ints(v)) => Some(v.to_vec()),
            _ => None,
        }
    }
}

impl AttrValue for String {
    const KIND: &'static str = "a string";
    fn to_attr(&self) -> Attr {
        Attr::Str(self.as_str().into())
    }
    fn from_attr(a: Option<&Attr>) -> Option<Self> {
        match a {
            Some(Attr::Str(v)) => Some(v.to_string()),
            _ => None,
        }
    }
}

impl AttrValue for Handle {
    const KIND: &'static str = "a tensor";
    fn to_attr(&self) -> Attr {
        Attr::Tensor(*self)
    }
    fn from_attr(a: Option<&Attr>) -> Option<Self> {
        match a {
            Some(Attr::Tensor(h)) => Some(*h),
            _ => None,
        }
    }
}

/// Optional attributes travel as [`Attr::None`] when absent; a missing trailing one reads as
/// absent too.
impl<T: AttrValue> AttrValue for Option<T> {
    const KIND: &'static str = T::KIND;
    fn to_attr(&self) -> Attr {
        self.as_ref().map_or(Attr::None, T::to_attr)
    }
    fn from_attr(a: Option<&Attr>) -> Option<Self> {
        match a {
            None | Some(Attr::None) => Some(None),
            some => T::from_attr(some).map(Some),
        }
    }
}

/// The attributes of one host op.
pub trait OpAttrs: Sized {
    /// The op's name on the wire.
    const OP: &'static str;
    /// As the positional list sent across.
    fn to_attrs(&self) -> Vec<Attr>;
    /// Read back; the error names the op, the attribute and what it should be.
    fn from_attrs(attrs: &[Attr]) -> Result<Self, String>;
}

/// Declares host ops: `Name = "wire_name" { field: Type, ... }`, each a struct with public
/// fields in wire order, implementing [`OpAttrs`], with `Name::OP` usable as a `match` pattern.
macro_rules! host_ops {
    ($( $(#[$doc:meta])* $name:ident = $op:literal { $( $(#[$fdoc:meta])* $field:ident : $ty:ty ),* $(,)? } )*) => {
        $(
            $(#[$doc])*
            #[derive(Clone, Debug, PartialEq)]
            pub struct $name { $( $(#[$fdoc])* pub $field: $ty, )* }

            impl $name {
                /// The op's name on the wire.
                pub const OP: &'static str = $op;
            }

            impl OpAttrs for $name {
                const OP: &'static str = $op;
                fn to_attrs(&self) -> Vec<Attr> {
                    vec![$( AttrValue::to_attr(&self.$field) ),*]
                }
                #[allow(unused_mut, unused_variables, unused_assignments)]
                fn from_attrs(attrs: &[Attr]) -> Result<Self, String> {
                    let mut i = 0usize;
                    $(
                        let $field = <$ty as AttrValue>::from_attr(attrs.get(i)).ok_or_else(|| {
                            format!(
                                "{}: attribute {} ({}) must be {}, got {:?}",
                                $op, i, stringify!($field), <$ty as AttrValue>::KIND, attrs.get(i)
                            )
                        })?;
                        i += 1;
                    )*
                    Ok($name { $($field),* })
                }
            }
        )*

        /// The name of every host op declared here (elementwise unary ops such as `exp` and
        /// `silu` are called by name and take no attributes).
        pub const OPS: &[&str] = &[$($op),*];
    };
}

host_ops! {
    /// `x + y` (broadcasting).
    Add = "add" {}
    /// `x - y` (broadcasting).
    Sub = "sub" {}
    /// `x * y` (broadcasting).
    Mul = "mul" {}
    /// `x / y` (broadcasting).
    Div = "div" {}
    /// Elementwise maximum.
    Maximum = "maximum" {}
    /// Elementwise minimum.
    Minimum = "minimum" {}
    /// `silu(gate) * up` (inputs: gate, up).
    Swiglu = "swiglu" {}
    /// `x @ y`.
    Matmul = "matmul" {}
    /// `x @ wᵀ` for a `[out, in]` weight.
    Linear = "linear" {}
    /// Overwrites input 0 with input 1, in place.
    Assign = "assign" {}
    /// Rows of the table (input 0) at integer ids (input 1).
    Embedding = "embedding" {}
    /// `cond ? a : b` (inputs: cond, a, b).
    Where = "where" {}
    /// Rows of `x [N, K]` grouped by `counts [E]` times `w [E, K, M]` (inputs: x, w, counts).
    GroupedMatmul = "grouped_matmul" {}
    /// [`GroupedMatmul`] with each expert's weight stored `[out, in]`: `w [E, M, K]`, row block
    /// `e` of `x` times `w[e]ᵀ` (inputs: x, w, counts).
    GroupedMatmulNt = "grouped_matmul_nt" {}
    /// The MoE router on `logits [N, E]` (inputs: logits, then an optional `[E]` balancing bias
    /// that steers the choice only): (weights `[N, k]` f32, experts `[N, k]` i64, scores
    /// `[N, E]` f32). `score` is `softmax` or `sigmoid`.
    MoeRoute = "moe_route" {
        num_experts: i64,
        top_k: i64,
        score: String,
        renormalize: bool,
        route_scale: f64,
        n_group: Option<i64>,
        topk_group: Option<i64>,
    }
    /// Token rows of `x [N, D]` in expert order for the choices `experts [N, k]` (inputs: x,
    /// experts): `[N·k, D]`, the stable sort of `sort_by_expert`.
    MoeDispatch = "moe_dispatch" { num_experts: i64 }
    /// Expert outputs `[N·k, D]` in expert order back to token order, weighted (inputs: y,
    /// weights `[N, k]`, experts `[N, k]`): `[N, D]`.
    MoeCombine = "moe_combine" { num_experts: i64 }
    /// The dropless MoE feed-forward layer (inputs: x `[.., D]`, router, gate, up, down; shapes
    /// as the engine's `moe_ffn`, `[.., out, in]` when `out_in`). Outputs: (out, tokens per
    /// expert `[E]` f32, load imbalance (max / mean) and router entropy as f32 scalars, then the
    /// weighted auxiliary load-balancing loss when `aux_loss_coef` is not 0). With `clamp_alpha`
    /// and `clamp_limit` the experts use GPT-OSS's clamped SwiGLU.
    MoeFfn = "moe_ffn" {
        num_experts: i64,
        top_k: i64,
        score: String,
        renormalize: bool,
        route_scale: f64,
        aux_loss_coef: f64,
        out_in: bool,
        clamp_alpha: Option<f64>,
        clamp_limit: Option<f64>,
        router_bias: Option<Handle>,
        balance_bias: Option<Handle>,
        gate_bias: Option<Handle>,
        up_bias: Option<Handle>,
        down_bias: Option<Handle>,
        shared_gate: Option<Handle>,
        shared_up: Option<Handle>,
        shared_down: Option<Handle>,
        n_group: Option<i64>,
        topk_group: Option<i64>,
    }
    /// `x * mul + add` with scalars.
    Affine = "affine" { mul: f64, add: f64 }
    /// `x ^ exponent`.
    Pow = "pow" { exponent: f64 }
    /// `x` limited to `[min, max]`.
    Clamp = "clamp" { min: f64, max: f64 }
    /// A view with a new shape (one dim may be -1).
    Reshape = "reshape" { shape: Vec<i64> }
    /// A view with dims `a` and `b` swapped.
    Transpose = "transpose" { a: i64, b: i64 }
    /// A view with dims reordered.
    Permute = "permute" { perm: Vec<i64> }
    /// Sum over `dims`.
    Sum = "sum" { dims: Vec<i64>, keepdim: bool }
    /// Mean over `dims`.
    Mean = "mean" { dims: Vec<i64>, keepdim: bool }
    /// Variance over `dims` with `correction` (1 = unbiased).
    Var = "var" { dims: Vec<i64>, correction: i64, keepdim: bool }
    /// Maximum over `dim`.
    Max = "max" { dim: i64, keepdim: bool }
    /// Minimum over `dim`.
    Min = "min" { dim: i64, keepdim: bool }
    /// Index of the maximum over `dim` (i64).
    Argmax = "argmax" { dim: i64, keepdim: bool }
    /// Conversion to a dtype by name (`f32`, `bf16`).
    ToDtype = "to_dtype" { dtype: String }
    /// Softmax over `dim`.
    Softmax = "softmax" { dim: i64 }
    /// Log-softmax over `dim`.
    LogSoftmax = "log_softmax" { dim: i64 }
    /// RMSNorm over the last dim (inputs: x, weight).
    RmsNorm = "rms_norm" { eps: f64 }
    /// LayerNorm over the last dim (inputs: x, weight), with an optional bias.
    LayerNorm = "layer_norm" { eps: f64, bias: Option<Handle> }
    /// Rotary embedding of `[B, H, T, D]` (inputs: x, positions), with optional Llama-3
    /// frequency scaling (all four values or none) or YaRN scaling (`yarn_factor` and
    /// `yarn_original_max_positions` at least).
    Rope = "rope" {
        theta: f64,
        rot_dim: i64,
        interleaved: bool,
        llama3_factor: Option<f64>,
        llama3_low_freq_factor: Option<f64>,
        llama3_high_freq_factor: Option<f64>,
        llama3_original_max_positions: Option<i64>,
        yarn_factor: Option<f64>,
        yarn_original_max_positions: Option<i64>,
        yarn_beta_fast: Option<f64>,
        yarn_beta_slow: Option<f64>,
        yarn_truncate: Option<bool>,
        yarn_attention_factor: Option<f64>,
        yarn_mscale: Option<f64>,
        yarn_mscale_all_dim: Option<f64>,
    }
    /// Scaled dot-product attention (inputs: q, k, v, positions); with `cache_layer` the host
    /// appends k, v to that layer's KV cache and attends over everything cached. `sinks`
    /// (`[Hq]`, trained) join every row's softmax denominator without a value (gpt-oss).
    /// `value_from_key = n`: the values are the keys' first `n` features (MLA's latent), so a
    /// cache keeps the keys only.
    Attention = "attention" {
        causal: bool,
        sliding_window: Option<i64>,
        scale: Option<f64>,
        softcap: Option<f64>,
        cache_layer: Option<i64>,
        sinks: Option<Handle>,
        value_from_key: Option<i64>,
    }
    /// Appends input 0 to layer `layer`'s inference cache `name` along `dim` and returns all
    /// that is cached (a latent cache); without a cache in this forward, returns the input.
    CacheAppend = "cache_append" { layer: i64, name: String, dim: i64 }
    /// Layer `layer`'s inference state `name` (a recurrent state): one output when it is set,
    /// none otherwise (the sequence's first call, or no cache in this forward).
    StateGet = "state_get" { layer: i64, name: String }
    /// Replaces layer `layer`'s inference state `name` with input 0; nothing without a cache.
    StateSet = "state_set" { layer: i64, name: String }
    /// The gated delta rule (inputs: q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`, the log-decay g
    /// `[B, T, Hv]` per head or `[B, T, Hv, Dk]` per key channel, beta `[B, T, Hv]`): the output
    /// `[B, T, Hv, Dv]`. `scale` multiplies q (`Dk^-0.5` when absent); `qk_l2norm` normalizes q
    /// and k first. With `cache_layer` the host keeps that layer's recurrent state across calls.
    GatedDeltaRule = "gated_delta_rule" {
        scale: Option<f64>,
        qk_l2norm: bool,
        cache_layer: Option<i64>,
    }
    /// Causal depthwise convolution along the sequence (inputs: x `[B, T, C]`, w `[C, K]`), no
    /// bias, then SiLU when `silu`. With `cache_layer` the host keeps the sequence's last `K - 1`
    /// inputs and prepends them on the next call.
    CausalConv1d = "causal_conv1d" { silu: bool, cache_layer: Option<i64> }
    /// The additive mask (f32, 0 where visible, -inf elsewhere) of compressed sparse attention
    /// (DeepSeek-V4): queries at positions input 0 (`[T]` or `[B, T]`) over `[window keys;
    /// n_blocks compressed blocks]`. With `window`, input 1 holds the window keys' positions
    /// (`[S]` or `[B, S]`), visible when `0 <= q - k < window`; block `w` covers positions
    /// `[w·rate, (w+1)·rate)` and is visible once complete (`w < (q + 1) / rate`) and, with
    /// `selected`, only when the last input (i64 `[B, T, k]`) names it. Output
    /// `[B, T, S + n_blocks]` (`B` = 1 when no input has a batch dim): the window keys then the
    /// blocks, or with `interleaved` each block right after its last key (keys `w·rate ..
    /// (w+1)·rate - 1`, block `w`, ..., then the keys after the last block), so a row's visible
    /// columns come first and a shorter sequence's columns are a prefix. No gradient.
    CompressedMask = "compressed_mask" {
        window: Option<i64>,
        compress_rate: i64,
        n_blocks: i64,
        selected: bool,
        interleaved: bool,
    }
    /// Gathered sparse attention (DeepSeek-V4's CSA/HCA): each query of input 0 (`q [B, H, T,
    /// D]`) attends over only what it may see of one shared key/value head: window keys input 1
    /// (`[B, S, D]`) at positions input 3 (`[S]` or `[B, S]`), visible when `0 <= q - k <
    /// window`; with `blocks`, compressed blocks (`[B, N, D]`, the next input), block `w`
    /// visible once complete (`w < (q + 1) / compress_rate`) and, with `selected`, named by the
    /// last input (i64 `[B, T, k]`); with `sinks`, per-head sink logits `[H]` (the input after
    /// the positions). Query positions are input 2 (`[T]` or `[B, T]`). The same values as
    /// [`CompressedMask`] added to full score rows, in O(visible keys) per query;
    /// batch-invariant. Output `[B, H, T, D]`; gradients to q, keys, blocks and sinks.
    GatheredAttention = "gathered_attention" {
        window: i64,
        compress_rate: i64,
        scale: Option<f64>,
        sinks: bool,
        blocks: bool,
        selected: bool,
    }
    /// A new tensor of `shape` and `dtype` (`i64` or `f32`) from `values`, row-major: the
    /// integers themselves for `i64`, the IEEE bit patterns (`f32::to_bits`) for `f32`, so
    /// values computed by the plugin arrive exactly. Made on the device of `like` when given
    /// (the host's default device otherwise). No gradient.
    Constant = "constant" { shape: Vec<i64>, dtype: String, values: Vec<i64>, like: Option<Handle> }
    /// PyTorch's `masked_scatter` along the rows: input 0 `x [.., D]` with the rows where the
    /// mask (input 1, any dtype, `x`'s shape without the last dim, nonzero = take) is set
    /// replaced, in order, by the rows of `src [N, D]` (input 2), `N` the mask's count.
    /// Gradients to `x` (unmasked rows) and `src`.
    MaskedScatter = "masked_scatter" {}
    /// `len` entries of `dim` from `start`, as a view.
    Narrow = "narrow" { dim: i64, start: i64, len: i64 }
    /// Tensors joined along `dim`.
    Cat = "cat" { dim: i64 }
    /// Tensors stacked along a new `dim`.
    Stack = "stack" { dim: i64 }
    /// Rows along `dim` picked by a 1-d index (inputs: x, index).
    IndexSelect = "index_select" { dim: i64 }
    /// PyTorch's `gather` along `dim` (inputs: x, index).
    Gather = "gather" { dim: i64 }
    /// PyTorch's `scatter_add` along `dim` (inputs: x, index, src).
    ScatterAdd = "scatter_add" { dim: i64 }
    /// The `k` largest (or smallest) entries along `dim`: (values, i64 indices).
    TopK = "topk" { k: i64, dim: i64, largest: bool }
    /// Top-k routing choices `[N, k]` grouped by expert: (order, token, inverse, counts).
    SortByExpert = "sort_by_expert" { num_experts: i64 }
    /// `value` where the mask (input 1) is nonzero.
    MaskedFill = "masked_fill" { value: f64 }
    /// Dropout with probability `p`; the mask is a pure function of (seed, stream, offset).
    Dropout = "dropout" { p: f64, seed: i64, stream: String, offset: i64 }
    /// Mean cross-entropy of logits `[N, V]` against i64 targets `[N]`.
    CrossEntropy = "cross_entropy" { ignore_index: Option<i64> }
    /// One fused AdamW step, in place, over `[param, grad, exp_avg, exp_avg_sq]` per parameter.
    AdamW = "adamw" {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        step: i64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_round_trip_and_mismatches_are_named() {
        let a = Attention {
            causal: true,
            sliding_window: Some(4),
            scale: None,
            softcap: None,
            cache_layer: Some(2),
            sinks: Some(Handle(5)),
            value_from_key: None,
        };
        assert_eq!(Attention::from_attrs(&a.to_attrs()).unwrap(), a);
        // Trailing optional attributes may be left off.
        let short = Attention::from_attrs(&[Attr::Bool(false)]).unwrap();
        assert_eq!(short.cache_layer, None);
        let err = Narrow::from_attrs(&[Attr::Int(0), Attr::Str("1".into())]).unwrap_err();
        assert!(
            err.starts_with("narrow: attribute 1 (start) must be an integer"),
            "{err}"
        );
        assert!(Affine::from_attrs(&[Attr::Int(2), Attr::Float(0.5)]).is_ok());
        assert_eq!(Affine::OP, "affine");
        assert!(OPS.contains(&"sort_by_expert"));
        let m = MoeFfn {
            num_experts: 4,
            top_k: 2,
            score: "softmax".into(),
            renormalize: true,
            route_scale: 1.0,
            aux_loss_coef: 0.01,
            out_in: true,
            clamp_alpha: None,
            clamp_limit: Some(7.0),
            router_bias: None,
            balance_bias: Some(Handle(3)),
            gate_bias: None,
            up_bias: None,
            down_bias: None,
            shared_gate: None,
            shared_up: None,
            shared_down: None,
            n_group: Some(4),
            topk_group: Some(2),
        };
        assert_eq!(MoeFfn::from_attrs(&m.to_attrs()).unwrap(), m);
    }
}
