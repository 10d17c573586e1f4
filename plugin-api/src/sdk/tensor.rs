//! Host ops as methods on a handle wrapper.

use super::{Error, Result};
use crate::abi::{Attr, Handle, HostVTable};
use crate::ops::{self, OpAttrs};
use abi_stable::std_types::{RSlice, RStr};

/// The host's op table for the duration of one plugin call.
#[derive(Clone, Copy)]
pub struct Host<'h> {
    vt: &'h HostVTable,
}

impl<'h> Host<'h> {
    /// Wraps the table the host passed in.
    pub fn new(vt: &'h HostVTable) -> Self {
        Host { vt }
    }

    /// Runs host op `op`; returns its outputs.
    pub fn call(
        &self,
        op: &str,
        inputs: &[&Tensor<'h>],
        attrs: &[Attr],
    ) -> Result<Vec<Tensor<'h>>> {
        let handles: Vec<Handle> = inputs.iter().map(|t| t.handle).collect();
        // SAFETY: the vtable and its context are valid for 'h, the duration of this plugin call.
        let out = unsafe {
            (self.vt.call)(
                self.vt.ctx,
                RStr::from(op),
                RSlice::from(&handles[..]),
                RSlice::from(attrs),
            )
        };
        match out.into_result() {
            Ok(hs) => Ok(hs
                .into_iter()
                .map(|h| Tensor {
                    handle: h,
                    host: *self,
                })
                .collect()),
            Err(e) => Err(Error::from_host(e)),
        }
    }

    /// Runs the host op `attrs` declares (see [`crate::ops`]) on `inputs`.
    pub fn call_op<A: OpAttrs>(
        &self,
        attrs: &A,
        inputs: &[&Tensor<'h>],
    ) -> Result<Vec<Tensor<'h>>> {
        self.call(A::OP, inputs, &attrs.to_attrs())
    }

    /// Runs a host op with exactly one output.
    pub fn call1(&self, op: &str, inputs: &[&Tensor<'h>], attrs: &[Attr]) -> Result<Tensor<'h>> {
        let mut v = self.call(op, inputs, attrs)?;
        if v.len() != 1 {
            return Err(Error::internal(format!(
                "host op {op} returned {} outputs, expected 1",
                v.len()
            )));
        }
        Ok(v.remove(0))
    }

    /// The parameter (or gradient, or optimizer state) named `name`.
    pub fn param(&self, name: &str) -> Result<Tensor<'h>> {
        // SAFETY: as in `call`.
        let out = unsafe { (self.vt.param)(self.vt.ctx, RStr::from(name)) };
        out.into_result()
            .map(|h| Tensor {
                handle: h,
                host: *self,
            })
            .map_err(Error::from_host)
    }

    /// Hands the host a named output besides the logits (see [`crate::abi::OutputKind`]).
    pub fn emit(&self, kind: crate::abi::OutputKind, name: &str, t: &Tensor<'h>) -> Result<()> {
        // SAFETY: as in `call`.
        let out = unsafe { (self.vt.emit)(self.vt.ctx, kind, RStr::from(name), t.handle) };
        out.into_result().map_err(Error::from_host)
    }

    /// The tensor of a declared parameter (see [`super::ParamTable`]).
    pub fn w(&self, p: &super::Param) -> Result<Tensor<'h>> {
        self.param(p.name())
    }

    /// One fused AdamW step over many parameters, in place (host op `adamw`): `tensors` holds
    /// `[param, grad, exp_avg, exp_avg_sq]` per parameter. One pass over memory, no
    /// temporaries, however many parameters.
    pub fn adamw(&self, tensors: &[[Tensor<'h>; 4]], hp: &AdamWStep) -> Result<()> {
        let inputs: Vec<&Tensor<'h>> = tensors.iter().flatten().collect();
        let attrs = ops::AdamW {
            lr: hp.lr,
            beta1: hp.betas.0,
            beta2: hp.betas.1,
            eps: hp.eps,
            weight_decay: hp.weight_decay,
            step: hp.step as i64,
        };
        self.call_op(&attrs, &inputs).map(|_| ())
    }

    /// A new i64 tensor of `shape` holding `values` (row-major), on `like`'s device.
    pub fn constant_i64(
        &self,
        shape: &[usize],
        values: &[i64],
        like: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        self.constant(shape, "i64", values.to_vec(), like)
    }

    /// A new f32 tensor of `shape` holding exactly `values` (row-major), on `like`'s device.
    pub fn constant_f32(
        &self,
        shape: &[usize],
        values: &[f32],
        like: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let bits = values.iter().map(|v| i64::from(v.to_bits())).collect();
        self.constant(shape, "f32", bits, like)
    }

    fn constant(
        &self,
        shape: &[usize],
        dtype: &str,
        values: Vec<i64>,
        like: &Tensor<'h>,
    ) -> Result<Tensor<'h>> {
        let attrs = ops::Constant {
            shape: shape.iter().map(|&d| d as i64).collect(),
            dtype: dtype.into(),
            values,
            like: Some(like.handle),
        };
        let mut out = self.call_op(&attrs, &[])?;
        if out.len() != 1 {
            return Err(Error::internal(
                "host op constant returned the wrong number of outputs",
            ));
        }
        Ok(out.remove(0))
    }

    /// Takes ownership of a handle the host passed in.
    pub fn adopt(&self, handle: Handle) -> Tensor<'h> {
        Tensor {
            handle,
            host: *self,
        }
    }
}

/// A tensor owned by the host, reached through a handle. Dropping it releases the handle.
pub struct Tensor<'h> {
    handle: Handle,
    host: Host<'h>,
}

impl Clone for Tensor<'_> {
    fn clone(&self) -> Self {
        // SAFETY: as in `Host::call`.
        let handle = unsafe { (self.host.vt.retain)(self.host.vt.ctx, self.handle) };
        Tensor {
            handle,
            host: self.host,
        }
    }
}

impl Drop for Tensor<'_> {
    fn drop(&mut self) {
        // SAFETY: as in `Host::call`; each handle is released once.
        unsafe { (self.host.vt.release)(self.host.vt.ctx, self.handle) }
    }
}

impl<'h> Tensor<'h> {
    /// Gives up ownership, returning the raw handle (to return it to the host).
    pub fn into_handle(self) -> Handle {
        let h = self.handle;
        std::mem::forget(self);
        h
    }

    /// The raw handle, still owned by this tensor (to pass as an attribute).
    pub(super) fn raw(&self) -> Handle {
        self.handle
    }

    /// The host this tensor lives in.
    pub fn host(&self) -> Host<'h> {
        self.host
    }

    /// The shape.
    pub fn shape(&self) -> Result<Vec<usize>> {
        // SAFETY: as in `Host::call`.
        let out = unsafe { (self.host.vt.shape)(self.host.vt.ctx, self.handle) };
        out.into_result()
            .map(|v| v.into_iter().map(|d| d as usize).collect())
            .map_err(Error::from_host)
    }

    /// The dtype name.
    pub fn dtype(&self) -> Result<String> {
        // SAFETY: as in `Host::call`.
        let out = unsafe { (self.host.vt.dtype)(self.host.vt.ctx, self.handle) };
        out.into_result()
            .map(|s| s.into())
            .map_err(Error::from_host)
    }

    pub(super) fn op(
        &self,
        name: &str,
        others: &[&Tensor<'h>],
        attrs: &[Attr],
    ) -> Result<Tensor<'h>> {
        let mut inputs = vec![self];
        inputs.extend_from_slice(others);
        self.host.call1(name, &inputs, attrs)
    }

    /// The declared op `attrs` on `self` and `others`, with one output.
    pub(super) fn op_with<A: OpAttrs>(
        &self,
        attrs: A,
        others: &[&Tensor<'h>],
    ) -> Result<Tensor<'h>> {
        self.op(A::OP, others, &attrs.to_attrs())
    }

    /// `self + rhs` (broadcasting).
    pub fn add(&self, rhs: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::Add {}, &[rhs])
    }
    /// `self - rhs` (broadcasting).
    pub fn sub(&self, rhs: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::Sub {}, &[rhs])
    }
    /// `self * rhs` (broadcasting).
    pub fn mul(&self, rhs: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::Mul {}, &[rhs])
    }
    /// `self / rhs` (broadcasting).
    pub fn div(&self, rhs: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::Div {}, &[rhs])
    }
    /// `self * mul + add` with scalars.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor<'h>> {
        self.op_with(ops::Affine { mul, add }, &[])
    }
    /// `self * v`.
    pub fn scale(&self, v: f64) -> Result<Tensor<'h>> {
        self.affine(v, 0.0)
    }
    /// The values of this integer tensor, row-major (copied to host memory: for small index
    /// tensors such as token ids).
    pub fn read_ints(&self) -> Result<Vec<i64>> {
        // SAFETY: as in `Host::call`.
        let out = unsafe { (self.host.vt.read_ints)(self.host.vt.ctx, self.handle) };
        out.into_result()
            .map(|v| v.into_vec())
            .map_err(Error::from_host)
    }
    /// `self` limited to `[min, max]`.
    pub fn clamp(&self, min: f64, max: f64) -> Result<Tensor<'h>> {
        self.op_with(ops::Clamp { min, max }, &[])
    }
    /// Elementwise unary op by name (`exp`, `sqrt`, `silu`, ...).
    pub fn unary(&self, name: &str) -> Result<Tensor<'h>> {
        self.op(name, &[], &[])
    }
    /// SiLU.
    pub fn silu(&self) -> Result<Tensor<'h>> {
        self.unary("silu")
    }
    /// `silu(self) * up`: the gated activation of a SwiGLU feed-forward (`self` is the gate),
    /// one fused host op.
    pub fn swiglu(&self, up: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::Swiglu {}, &[up])
    }
    /// Square root.
    pub fn sqrt(&self) -> Result<Tensor<'h>> {
        self.unary("sqrt")
    }
    /// `self @ rhs`.
    pub fn matmul(&self, rhs: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::Matmul {}, &[rhs])
    }
    /// `self @ wᵀ` for a `[out, in]` weight: a linear layer without bias.
    pub fn linear(&self, w: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::Linear {}, &[w])
    }
    /// A view with a new shape (one dim may be -1).
    pub fn reshape(&self, shape: &[i64]) -> Result<Tensor<'h>> {
        self.op_with(
            ops::Reshape {
                shape: shape.to_vec(),
            },
            &[],
        )
    }
    /// A view with two dims swapped.
    pub fn transpose(&self, a: i64, b: i64) -> Result<Tensor<'h>> {
        self.op_with(ops::Transpose { a, b }, &[])
    }
    /// A view with dims reordered.
    pub fn permute(&self, perm: &[i64]) -> Result<Tensor<'h>> {
        self.op_with(
            ops::Permute {
                perm: perm.to_vec(),
            },
            &[],
        )
    }
    /// Sum over dims.
    pub fn sum(&self, dims: &[i64], keepdim: bool) -> Result<Tensor<'h>> {
        self.op_with(
            ops::Sum {
                dims: dims.to_vec(),
                keepdim,
            },
            &[],
        )
    }
    /// Mean over dims.
    pub fn mean(&self, dims: &[i64], keepdim: bool) -> Result<Tensor<'h>> {
        self.op_with(
            ops::Mean {
                dims: dims.to_vec(),
                keepdim,
            },
            &[],
        )
    }
    /// Converts to a dtype by name.
    pub fn to_dtype(&self, dtype: &str) -> Result<Tensor<'h>> {
        self.op_with(
            ops::ToDtype {
                dtype: dtype.into(),
            },
            &[],
        )
    }
    /// Overwrites this tensor's elements with `src` in place (optimizer updates).
    pub fn assign(&self, src: &Tensor<'h>) -> Result<()> {
        self.host.call_op(&ops::Assign {}, &[self, src]).map(|_| ())
    }

    /// Embedding lookup: `self` is the table `[V, D]`, `ids` any shape of integer ids.
    pub fn embedding(&self, ids: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::Embedding {}, &[ids])
    }
    /// RMSNorm over the last dim with a `[D]` weight.
    pub fn rms_norm(&self, weight: &Tensor<'h>, eps: f64) -> Result<Tensor<'h>> {
        self.op_with(ops::RmsNorm { eps }, &[weight])
    }
    /// Rotary position embedding of `[B, H, T, D]` at absolute `positions` (i64 `[T]` or
    /// per-row `[B, T]`).
    pub fn rope(&self, positions: &Tensor<'h>, rope: &Rope) -> Result<Tensor<'h>> {
        let s = rope.llama3_scaling.as_ref();
        let y = rope.yarn.as_ref();
        let attrs = ops::Rope {
            theta: rope.theta,
            rot_dim: rope.rot_dim as i64,
            interleaved: rope.interleaved,
            llama3_factor: s.map(|s| s.factor),
            llama3_low_freq_factor: s.map(|s| s.low_freq_factor),
            llama3_high_freq_factor: s.map(|s| s.high_freq_factor),
            llama3_original_max_positions: s.map(|s| s.original_max_position_embeddings as i64),
            yarn_factor: y.map(|y| y.factor),
            yarn_original_max_positions: y.map(|y| y.original_max_position_embeddings as i64),
            yarn_beta_fast: y.map(|y| y.beta_fast),
            yarn_beta_slow: y.map(|y| y.beta_slow),
            yarn_truncate: y.map(|y| y.truncate),
            yarn_attention_factor: y.and_then(|y| y.attention_factor),
            yarn_mscale: y.and_then(|y| y.mscale),
            yarn_mscale_all_dim: y.and_then(|y| y.mscale_all_dim),
        };
        self.op_with(attrs, &[positions])
    }
    /// Scaled dot-product attention of `q [B, Hq, T, D]` over `k`, `v` `[B, Hkv, S, D]` at
    /// absolute query `positions`. With `cache_layer`, the host appends `k`, `v` to that layer's
    /// KV cache and attends over everything cached.
    pub fn attention(
        &self,
        k: &Tensor<'h>,
        v: &Tensor<'h>,
        positions: &Tensor<'h>,
        opts: &AttentionOpts<'_, 'h>,
    ) -> Result<Tensor<'h>> {
        let attrs = ops::Attention {
            causal: opts.causal,
            sliding_window: opts.sliding_window.map(|w| w as i64),
            scale: opts.scale,
            softcap: opts.softcap,
            cache_layer: opts.cache_layer.map(|l| l as i64),
            sinks: opts.sinks.map(Tensor::raw),
            value_from_key: opts.value_from_key.map(|n| n as i64),
        };
        self.op_with(attrs, &[k, v, positions])
    }
}

impl<'h> Tensor<'h> {
    /// Softmax over `dim`.
    pub fn softmax(&self, dim: i64) -> Result<Tensor<'h>> {
        self.op_with(ops::Softmax { dim }, &[])
    }
    /// Log-softmax over `dim`.
    pub fn log_softmax(&self, dim: i64) -> Result<Tensor<'h>> {
        self.op_with(ops::LogSoftmax { dim }, &[])
    }
    /// LayerNorm over the last dim with a `[D]` weight and optional bias.
    pub fn layer_norm(
        &self,
        weight: &Tensor<'h>,
        bias: Option<&Tensor<'h>>,
        eps: f64,
    ) -> Result<Tensor<'h>> {
        let bias = bias.map(|b| b.handle);
        self.op_with(ops::LayerNorm { eps, bias }, &[weight])
    }
    /// PyTorch's `masked_scatter` over rows: the rows of `self [.., D]` where `mask` (shape
    /// `self`'s without the last dim) is nonzero replaced, in order, by the rows of `src [N, D]`.
    pub fn masked_scatter(&self, mask: &Tensor<'h>, src: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::MaskedScatter {}, &[mask, src])
    }
    /// `len` entries of `dim` from `start`, as a view.
    pub fn narrow(&self, dim: i64, start: usize, len: usize) -> Result<Tensor<'h>> {
        let attrs = ops::Narrow {
            dim,
            start: start as i64,
            len: len as i64,
        };
        self.op_with(attrs, &[])
    }
    /// Rows (along `dim`) picked by a 1-d integer index.
    pub fn index_select(&self, dim: i64, idx: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::IndexSelect { dim }, &[idx])
    }
    /// PyTorch's `gather` along `dim`.
    pub fn gather(&self, dim: i64, idx: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::Gather { dim }, &[idx])
    }
    /// PyTorch's `scatter_add` along `dim`.
    pub fn scatter_add(&self, dim: i64, idx: &Tensor<'h>, src: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::ScatterAdd { dim }, &[idx, src])
    }
    /// The `k` largest entries along `dim` (best first): (values, i64 indices).
    pub fn topk(&self, k: usize, dim: i64) -> Result<(Tensor<'h>, Tensor<'h>)> {
        let attrs = ops::TopK {
            k: k as i64,
            dim,
            largest: true,
        };
        let mut v = self.host.call_op(&attrs, &[self])?;
        if v.len() != 2 {
            return Err(Error::internal(
                "host op topk returned the wrong number of outputs",
            ));
        }
        let i = v.remove(1);
        Ok((v.remove(0), i))
    }
    /// MoE expert product: rows of `self [N, K]` grouped by `counts` (i64 `[E]`) times `w [E, K, M]`.
    pub fn grouped_matmul(&self, w: &Tensor<'h>, counts: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.op_with(ops::GroupedMatmul {}, &[w, counts])
    }
    /// Maximum over `dim`.
    pub fn max(&self, dim: i64, keepdim: bool) -> Result<Tensor<'h>> {
        self.op_with(ops::Max { dim, keepdim }, &[])
    }
    /// Index of the maximum over `dim` (i64).
    pub fn argmax(&self, dim: i64, keepdim: bool) -> Result<Tensor<'h>> {
        self.op_with(ops::Argmax { dim, keepdim }, &[])
    }
    /// `value` where `mask` is nonzero (broadcasting).
    pub fn masked_fill(&self, mask: &Tensor<'h>, value: f64) -> Result<Tensor<'h>> {
        self.op_with(ops::MaskedFill { value }, &[mask])
    }
    /// Dropout with probability `p`; the mask is a pure function of (seed, stream, offset).
    pub fn dropout(&self, p: f64, seed: u64, stream: &str, offset: u64) -> Result<Tensor<'h>> {
        let attrs = ops::Dropout {
            p,
            seed: seed as i64,
            stream: stream.into(),
            offset: offset as i64,
        };
        self.op_with(attrs, &[])
    }
    /// Mean cross-entropy of logits `[N, V]` against i64 targets `[N]`.
    pub fn cross_entropy(
        &self,
        targets: &Tensor<'h>,
        ignore_index: Option<i64>,
    ) -> Result<Tensor<'h>> {
        self.op_with(ops::CrossEntropy { ignore_index }, &[targets])
    }
}

impl<'h> Host<'h> {
    /// Joins tensors along `dim`.
    pub fn cat(&self, tensors: &[&Tensor<'h>], dim: i64) -> Result<Tensor<'h>> {
        self.call1(ops::Cat::OP, tensors, &ops::Cat { dim }.to_attrs())
    }
    /// Tensors of one shape stacked along a new `dim`.
    pub fn stack(&self, tensors: &[&Tensor<'h>], dim: i64) -> Result<Tensor<'h>> {
        self.call1(ops::Stack::OP, tensors, &ops::Stack { dim }.to_attrs())
    }
    /// `cond ? a : b`, broadcasting.
    pub fn where_(&self, cond: &Tensor<'h>, a: &Tensor<'h>, b: &Tensor<'h>) -> Result<Tensor<'h>> {
        self.call1(ops::Where::OP, &[cond, a, b], &[])
    }
    /// Groups top-k routing choices `[N, k]` by expert: (order, token, inverse, counts), see the
    /// engine's `sort_by_expert`.
    pub fn sort_by_expert(
        &self,
        expert_ids: &Tensor<'h>,
        num_experts: usize,
    ) -> Result<[Tensor<'h>; 4]> {
        let attrs = ops::SortByExpert {
            num_experts: num_experts as i64,
        };
        let v = self.call_op(&attrs, &[expert_ids])?;
        v.try_into().map_err(|_| {
            Error::internal("host op sort_by_expert returned the wrong number of outputs")
        })
    }
}

/// Llama-3 style RoPE frequency scaling (the `llama3` rope type of Hugging Face).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Llama3Scaling {
    /// Overall scale factor of long wavelengths.
    pub factor: f64,
    /// Wavelengths above `original / low_freq_factor` are scaled fully.
    pub low_freq_factor: f64,
    /// Wavelengths below `original / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was first trained with.
    pub original_max_position_embeddings: usize,
}

/// Hyperparameters of one [`Host::adamw`] step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate of this step.
    pub lr: f64,
    /// (β₁, β₂): decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
    /// The step being taken, counting from 1 (bias correction).
    pub step: u64,
}

/// Rotary embedding settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// Base of the frequencies.
    pub theta: f64,
    /// How many leading dims of each head rotate (the rest pass through).
    pub rot_dim: usize,
    /// Pairs (2i, 2i+1) when true (Meta layout); (i, i + rot_dim/2) when false (HF layout).
    pub interleaved: bool,
    /// Optional Llama-3 frequency scaling.
    pub llama3_scaling: Option<Llama3Scaling>,
    /// Optional YaRN frequency scaling (exclusive with `llama3_scaling`).
    pub yarn: Option<YarnScaling>,
}

impl Rope {
    /// Hugging Face's half-split RoPE of base `theta` on the first `rot_dim` dims, unscaled.
    pub fn new(theta: f64, rot_dim: usize) -> Self {
        Rope {
            theta,
            rot_dim,
            interleaved: false,
            llama3_scaling: None,
            yarn: None,
        }
    }
}

/// YaRN RoPE scaling (the `yarn` rope type of Hugging Face: gpt-oss, DeepSeek-V3).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct YarnScaling {
    /// How much longer the context is than the original one.
    pub factor: f64,
    /// The context length the model was first trained with.
    pub original_max_position_embeddings: usize,
    /// Dims turning at least this many times over the original context keep their frequency.
    #[serde(default = "beta_fast")]
    pub beta_fast: f64,
    /// Dims turning at most this many times are fully interpolated.
    #[serde(default = "beta_slow")]
    pub beta_slow: f64,
    /// Round the ramp's ends to whole dims.
    #[serde(default = "yes")]
    pub truncate: bool,
    /// The factor on `cos`/`sin`; derived from `factor` (and the mscales) when absent.
    #[serde(default)]
    pub attention_factor: Option<f64>,
    /// DeepSeek's numerator scale of the derived attention factor.
    #[serde(default)]
    pub mscale: Option<f64>,
    /// DeepSeek's denominator scale of the derived attention factor.
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
}

fn beta_fast() -> f64 {
    32.0
}

fn beta_slow() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

/// Options of [`Tensor::attention`].
#[derive(Clone, Default)]
pub struct AttentionOpts<'a, 'h> {
    /// Mask future positions.
    pub causal: bool,
    /// Only attend to the last `w` positions (including the query's own).
    pub sliding_window: Option<usize>,
    /// Logit scale; default `1/sqrt(D)`.
    pub scale: Option<f64>,
    /// Logit soft-cap `c·tanh(x/c)`.
    pub softcap: Option<f64>,
    /// The layer whose KV cache to use (inference with a cache).
    pub cache_layer: Option<usize>,
    /// `[Hq]` learned logits that join every row's softmax denominator without a value
    /// (gpt-oss's attention sinks); they receive a gradient.
    pub sinks: Option<&'a Tensor<'h>>,
    /// The values are the keys' first `n` features (MLA's latent, `v` = that prefix): with a
    /// cache, the host keeps only the keys and reads the values from them.
    pub value_from_key: Option<usize>,
}
