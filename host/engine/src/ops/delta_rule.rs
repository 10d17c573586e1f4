//! The gated delta rule: the linear-attention mixer of Gated DeltaNet (Qwen3.5, Qwen3-Next) and,
//! with a decay per key channel, Kimi Delta Attention (Kimi Linear).
//!
//! Per value head, with state `S [Dk, Dv]`, for each token:
//! ```text
//! S ← e^{g_t} ⊙ S                      decay (per head: GDN; per key channel: KDA)
//! S ← S + k_t (β_t (v_t − Sᵀ k_t))ᵀ    delta-rule write
//! o_t = Sᵀ (scale · q_t)
//! ```
//! Training runs the chunked form (chunks of 64, WY/UT transform, f32 inside, see
//! `cpu::delta_rule`) forward and backward as one fused op. Decode runs either the recurrence
//! token by token ([`gated_delta_rule_recurrent`]) or, in batch-invariant mode, the chunked form
//! over the tokens since the last 64-aligned position ([`DeltaRuleCache`]), so that a sequence's
//! outputs have the same bits in a prefill, in a training forward and step by step. On a GPU
//! kernels compute the recurrence (`cuda::CudaDeltaRule`, forward and backward), the same
//! per-token steps in a training forward and in decode; sizes past its reach fall back to the
//! CPU backend (`cuda::HostDeltaRule`).

use crate::autograd::{is_grad_enabled, no_grad, record};
use crate::backend::{delta_rule_backend_for, DeltaRuleBackend};
use crate::error::{invalid, Error, Result};
use crate::{DType, Tensor};

const OP: &str = "gated_delta_rule";

/// Rows per chunk of the chunked form (and the alignment of batch-invariant decode).
pub const DELTA_RULE_CHUNK: usize = 64;

/// Options of [`gated_delta_rule`]. The default scales `q` by `Dk^-0.5` and does not normalize.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeltaRuleParams {
    /// Multiplies `q`; `None` means `1/sqrt(Dk)`.
    pub scale: Option<f32>,
    /// L2-normalizes `q` and `k` over their head dim first (`x / sqrt(Σx² + 1e-6)`), as
    /// transformers' `use_qk_l2norm_in_kernel`.
    pub qk_l2norm: bool,
}

/// The result of the delta rule over a sequence.
#[derive(Clone, Debug)]
pub struct DeltaRuleOutput {
    /// `[B, T, Hv, Dv]`, in `q`'s dtype.
    pub out: Tensor,
    /// The state after the last token, `[B, Hv, Dk, Dv]`, f32.
    pub final_state: Tensor,
}

/// The validated sizes and scale of one call, as the kernels compute with them.
#[derive(Clone, Copy, Debug)]
pub struct DeltaRuleSpec {
    /// Batch size.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Query/key heads.
    pub hk: usize,
    /// Value heads (a multiple of `hk`).
    pub hv: usize,
    /// Query/key head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
    /// The decay has one value per key channel (KDA) rather than per head (GDN).
    pub per_channel: bool,
    /// Multiplies `q`.
    pub scale: f32,
}

impl DeltaRuleSpec {
    /// Decay values per (token, value head): `dk` per channel, else 1.
    pub fn gd(&self) -> usize {
        if self.per_channel {
            self.dk
        } else {
            1
        }
    }
}

/// The tensors a delta-rule kernel reads (shapes as in [`gated_delta_rule`]; `q`, `k` already
/// normalized when asked, `q` not yet scaled).
#[derive(Clone, Copy, Debug)]
pub struct DeltaRuleInputs<'a> {
    /// `[B, T, Hk, Dk]`.
    pub q: &'a Tensor,
    /// `[B, T, Hk, Dk]`.
    pub k: &'a Tensor,
    /// `[B, T, Hv, Dv]`.
    pub v: &'a Tensor,
    /// `[B, T, Hv]` or `[B, T, Hv, Dk]`.
    pub g: &'a Tensor,
    /// `[B, T, Hv]`.
    pub beta: &'a Tensor,
    /// `[B, Hv, Dk, Dv]`; zeros when `None`.
    pub state: Option<&'a Tensor>,
}

impl<'a> DeltaRuleInputs<'a> {
    /// The inputs in recording order (`q, k, v, g, beta[, state]`).
    fn of(t: &'a [Tensor]) -> DeltaRuleInputs<'a> {
        DeltaRuleInputs {
            q: &t[0],
            k: &t[1],
            v: &t[2],
            g: &t[3],
            beta: &t[4],
            state: t.get(5),
        }
    }
}

fn shape_error(what: &str, want: String, got: &Tensor) -> Error {
    invalid(
        OP,
        format!("{what} must be {want}, got shape {:?}", got.shape()),
    )
}

/// Checks shapes and dtypes: `q`, `k` `[B, T, Hk, Dk]`, `v` `[B, T, Hv, Dv]` with `Hv` a
/// multiple of `Hk`, `g` `[B, T, Hv]` or `[B, T, Hv, Dk]`, `beta` `[B, T, Hv]`, state
/// `[B, Hv, Dk, Dv]`.
pub(super) fn resolve(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: Option<&Tensor>,
    p: &DeltaRuleParams,
) -> Result<DeltaRuleSpec> {
    let named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)];
    for (_, t) in named
        .iter()
        .chain(state.map(|s| ("initial_state", s)).iter())
    {
        if !t.dtype().is_float() {
            return Err(Error::DType {
                op: OP,
                got: t.dtype(),
                expected: "a floating dtype",
            });
        }
        t.check_device(OP)?;
    }
    if q.rank() != 4 {
        return Err(shape_error("q", "[B, T, Hk, Dk]".into(), q));
    }
    let [b, t, hk, dk] = [q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]];
    if k.shape() != q.shape() {
        return Err(shape_error("k", format!("{:?} like q", q.shape()), k));
    }
    if v.rank() != 4 || v.shape()[..2] != [b, t] || hk == 0 || !v.shape()[2].is_multiple_of(hk) {
        return Err(shape_error(
            "v",
            format!("[{b}, {t}, Hv, Dv] with Hv a multiple of {hk}"),
            v,
        ));
    }
    let (hv, dv) = (v.shape()[2], v.shape()[3]);
    if dk == 0 || dv == 0 || hv == 0 {
        return Err(invalid(OP, "head counts and head dims must be at least 1"));
    }
    let per_channel = match g.shape() {
        s if s == [b, t, hv] => false,
        s if s == [b, t, hv, dk] => true,
        _ => {
            return Err(shape_error(
                "g",
                format!("[{b}, {t}, {hv}] or [{b}, {t}, {hv}, {dk}]"),
                g,
            ))
        }
    };
    if beta.shape() != [b, t, hv] {
        return Err(shape_error("beta", format!("[{b}, {t}, {hv}]"), beta));
    }
    if let Some(s) = state {
        if s.shape() != [b, hv, dk, dv] {
            return Err(shape_error(
                "initial_state",
                format!("[{b}, {hv}, {dk}, {dv}]"),
                s,
            ));
        }
    }
    let scale = p.scale.unwrap_or(1.0 / (dk as f32).sqrt());
    if !scale.is_finite() {
        return Err(invalid(OP, format!("scale must be finite, got {scale}")));
    }
    Ok(DeltaRuleSpec {
        b,
        t,
        hk,
        hv,
        dk,
        dv,
        per_channel,
        scale,
    })
}

/// `x / sqrt(Σ x² + 1e-6)` over the last dim (differentiable, composed of plain ops).
fn l2norm(x: &Tensor) -> Result<Tensor> {
    x.mul(&x.mul(x)?.sum_dims(&[-1], true)?.add_scalar(1e-6)?.rsqrt()?)
}

/// `q`, `k` as the kernels read them (normalized when asked).
pub(super) fn prepare(q: &Tensor, k: &Tensor, p: &DeltaRuleParams) -> Result<(Tensor, Tensor)> {
    if p.qk_l2norm {
        // In f32 whatever the storage dtype, as transformers and FLA normalize.
        let f32 = |t: &Tensor| -> Result<Tensor> {
            if t.dtype() == DType::F32 {
                Ok(t.clone())
            } else {
                t.to_dtype(DType::F32)
            }
        };
        Ok((l2norm(&f32(q)?)?, l2norm(&f32(k)?)?))
    } else {
        Ok((q.clone(), k.clone()))
    }
}

/// `t` (f32, from a kernel) in `dtype`.
pub(super) fn to_dtype(t: Tensor, dtype: DType) -> Result<Tensor> {
    Ok(if dtype == DType::F32 {
        t
    } else {
        t.materialize(dtype)
    })
}

/// The delta-rule backend for `t`'s device.
pub(super) fn be(t: &Tensor) -> Result<&'static dyn DeltaRuleBackend> {
    delta_rule_backend_for(t.device())
}

/// The gated delta rule over whole sequences, chunked (see the module doc), with gradients for
/// `q`, `k`, `v`, `g`, `beta` and `initial_state`.
///
/// `q`, `k` `[B, T, Hk, Dk]`; `v` `[B, T, Hv, Dv]` with value head `h` reading key head
/// `h / (Hv / Hk)` (transformers' `repeat_interleave`); `g` the log-decay (≤ 0), `[B, T, Hv]`
/// per head (Gated DeltaNet) or `[B, T, Hv, Dk]` per key channel (KDA); `beta` `[B, T, Hv]`;
/// `initial_state` `[B, Hv, Dk, Dv]` (zeros when `None`). Any `T`, including 0.
pub fn gated_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    initial_state: Option<&Tensor>,
    params: &DeltaRuleParams,
) -> Result<DeltaRuleOutput> {
    let m = resolve(q, k, v, g, beta, initial_state, params)?;
    let out_dtype = q.dtype();
    let (q, k) = prepare(q, k, params)?;
    let mut inputs = vec![&q, &k, v, g, beta];
    inputs.extend(initial_state);
    let save = is_grad_enabled() && inputs.iter().any(|t| t.requires_grad());
    let data: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let (out, state, chunk_states) = be(&q)?.delta_rule(&DeltaRuleInputs::of(&data), &m, save)?;
    let (n_out, n_state) = (out.numel(), state.numel());
    // Both results leave as views of one recorded tensor, so one node carries both gradients.
    let packed = super::cat(&[out.reshape(&[n_out])?, state.reshape(&[n_state])?], 0)?;
    let packed = record(OP, packed, &inputs, || {
        move |grad: &Tensor| {
            let cs = chunk_states
                .as_ref()
                .expect("saved whenever the graph is recorded");
            let (d_out, d_state) = (grad.narrow(0, 0, n_out)?, grad.narrow(0, n_out, n_state)?);
            let x = DeltaRuleInputs::of(&data);
            let grads = be(&data[0])?.delta_rule_backward(&x, &m, cs, &d_out, &d_state)?;
            grads
                .into_iter()
                .zip(&data)
                .map(|(g, t)| Ok(Some(to_dtype(g, t.dtype())?)))
                .collect()
        }
    });
    let out = packed
        .narrow(0, 0, n_out)?
        .reshape(&[m.b, m.t, m.hv, m.dv])?;
    let out = if out_dtype == DType::F32 {
        out
    } else {
        out.to_dtype(out_dtype)?
    };
    let final_state = packed
        .narrow(0, n_out, n_state)?
        .reshape(&[m.b, m.hv, m.dk, m.dv])?;
    Ok(DeltaRuleOutput { out, final_state })
}

/// The recurrent form for decode: the tokens of `q` .. `beta` (shaped as in
/// [`gated_delta_rule`], usually `T = 1`) applied one by one to `state`. Records no gradient.
/// Agrees with the chunked form to rounding, not bit for bit (see [`DeltaRuleCache`] for that).
pub fn gated_delta_rule_recurrent(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
    params: &DeltaRuleParams,
) -> Result<DeltaRuleOutput> {
    let _ng = no_grad();
    let m = resolve(q, k, v, g, beta, Some(state), params)?;
    let out_dtype = q.dtype();
    let (q, k) = prepare(q, k, params)?;
    let x = DeltaRuleInputs {
        q: &q,
        k: &k,
        v,
        g,
        beta,
        state: Some(state),
    };
    let (out, final_state) = be(&q)?.delta_rule_recurrent(&x, &m)?;
    Ok(DeltaRuleOutput {
        out: to_dtype(out, out_dtype)?,
        final_state,
    })
}

impl Tensor {
    /// `gated_delta_rule(self, k, v, g, beta, initial_state, params)`: see [`gated_delta_rule`].
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_rule(
        &self,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        initial_state: Option<&Tensor>,
        params: &DeltaRuleParams,
    ) -> Result<DeltaRuleOutput> {
        gated_delta_rule(self, k, v, g, beta, initial_state, params)
    }
}
