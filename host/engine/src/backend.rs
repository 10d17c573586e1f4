//! The compute backend trait: the kernels behind every op. Ops (in `ops/`) own shape rules and
//! gradients; a backend only computes. Inputs arrive already broadcast (as strided views) and
//! outputs are fresh contiguous tensors without autograd.

use crate::error::{Error, Result};
use crate::ops::{BinaryOp, ReduceOp, UnaryOp};
use crate::{DType, Device, Tensor};

/// Kernels a device must provide.
pub trait Backend: Send + Sync {
    /// A short name (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Elementwise `op(x)`.
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor>;
    /// `grad * op'(x)`, elementwise.
    fn unary_grad(&self, op: UnaryOp, x: &Tensor, grad: &Tensor) -> Result<Tensor>;
    /// Elementwise `op(a, b)` of two tensors of the same shape (either may be a broadcast view).
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// `x * mul + add`, elementwise.
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor>;
    /// `x ^ e`, elementwise.
    fn powf(&self, x: &Tensor, e: f32) -> Result<Tensor>;
    /// `x` clamped to `[lo, hi]`.
    fn clamp(&self, x: &Tensor, lo: f32, hi: f32) -> Result<Tensor>;
    /// Reduces dim `dim` (kept with size 1 in the output).
    fn reduce(&self, op: ReduceOp, x: &Tensor, dim: usize) -> Result<Tensor>;
    /// Batched matrix product of `[batch.., m, k]` and `[batch.., k, n]` with equal batch dims.
    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// A contiguous copy in `dtype`.
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor>;
    /// `dst += src` in place (same shape; `dst` contiguous).
    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()>;
    /// The `k` largest (or smallest) entries along `dim`: (values, i64 indices); ties go to the
    /// lower index. `sorted` orders them best first, else by increasing index.
    fn topk(
        &self,
        x: &Tensor,
        k: usize,
        dim: usize,
        largest: bool,
        sorted: bool,
    ) -> Result<(Tensor, Tensor)>;
    /// `out[o, l, i] = x[o, idx[l], i]` along `dim` for a 1-d index (checked against the size).
    fn index_select(&self, x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor>;
    /// `base` with `src[o, l, i]` added at `[o, idx[l], i]` along `dim`, in index order.
    fn index_add(&self, base: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor>;
    /// PyTorch's gather along `dim` (output shaped like `idx`).
    fn gather(&self, x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor>;
    /// PyTorch's scatter_add along `dim`, summing in a fixed order.
    fn scatter_add(&self, x: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor>;
    /// `cond != 0 ? a : b` for three tensors of one shape, returned in `dtype`.
    fn where_(&self, cond: &Tensor, a: &Tensor, b: &Tensor, dtype: DType) -> Result<Tensor>;
    /// Groups top-k choices `ids [N, k]` (i64/i32, every id in `0..num_experts`) by expert
    /// with a stable counting sort: `[order, token, inverse, counts]`, i64 tensors on `ids`'
    /// device (see [`crate::ops::ExpertRouting`]).
    fn sort_by_expert(&self, ids: &Tensor, num_experts: usize) -> Result<[Tensor; 4]>;
    /// Rows of `x [N, K]` grouped by `counts` (i64 `[E]`, on `x`'s device) times `w[e]` of
    /// `w [E, K, M]` (or `w[e]^T` with `transpose_w`, for `x [N, M]`).
    fn grouped_matmul(
        &self,
        x: &Tensor,
        w: &Tensor,
        counts: &Tensor,
        transpose_w: bool,
    ) -> Result<Tensor>;
    /// `out[e] = x_e^T @ g_e` over the row groups given by `counts`: `[E, K, M]`.
    fn grouped_matmul_weight_grad(&self, x: &Tensor, g: &Tensor, counts: &Tensor)
        -> Result<Tensor>;
    /// MoE dispatch: `out[s] = x[token[s]]` for `x [N, D]`, `[token.len(), D]` in `dtype`.
    /// The index tensors of the MoE ops are i64 on the data's device.
    fn moe_dispatch(&self, x: &Tensor, token: &Tensor, dtype: DType) -> Result<Tensor>;
    /// The gradient of [`Backend::moe_dispatch`]: `dx[t] = Σ_j g[inverse[t·k + j]]`, in
    /// choice order.
    fn moe_dispatch_backward(
        &self,
        g: &Tensor,
        inverse: &Tensor,
        k: usize,
        dtype: DType,
    ) -> Result<Tensor>;
    /// MoE combine: `out[t] = Σ_j w[t, j] · y[inverse[t·k + j]]` for `y [N·k, D]`, `w [N, k]`.
    fn moe_combine(&self, y: &Tensor, w: &Tensor, inverse: &Tensor, dtype: DType)
        -> Result<Tensor>;
    /// The gradients of [`Backend::moe_combine`] for `y` and `w` (each when `need` asks),
    /// returned in `dtypes`.
    #[allow(clippy::too_many_arguments)]
    fn moe_combine_backward(
        &self,
        y: &Tensor,
        w: &Tensor,
        g: &Tensor,
        order: &Tensor,
        inverse: &Tensor,
        need: (bool, bool),
        dtypes: (DType, DType),
    ) -> Result<(Option<Tensor>, Option<Tensor>)>;
    /// Joins tensors of one dtype (equal in every other dim) along `dim`, copying bytes.
    fn cat(&self, tensors: &[Tensor], dim: usize) -> Result<Tensor>;
    /// `x * scale` where the uniform draw of `key` at `offset + i` is at least `p`, else 0.
    fn dropout(
        &self,
        x: &Tensor,
        p: f32,
        scale: f32,
        key: &crate::rng::RngKey,
        offset: u64,
    ) -> Result<Tensor>;
    /// Fused attention forward: the output `[B, Hq, Tq, Dv]` (in `q`'s dtype) and the per-row
    /// logsumexp `[B, Hq, Tq]` (f32) that the backward pass recomputes probabilities from.
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        spec: &crate::ops::AttentionSpec,
    ) -> Result<(Tensor, Tensor)>;
    /// Fused attention backward from the forward's output and logsumexp.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        out: &Tensor,
        lse: &Tensor,
        grad: &Tensor,
        spec: &crate::ops::AttentionSpec,
    ) -> Result<crate::ops::AttentionGrads>;
}

/// Why a CUDA device cannot compute: what is missing on this machine (no driver, a library, no
/// GPU) or, where CUDA is there, that the ops have no CUDA kernels in this build yet.
fn cuda_unavailable(device: Device) -> Error {
    let Device::Cuda(ordinal) = device else {
        unreachable!("only CUDA devices are unavailable")
    };
    #[cfg(feature = "cuda")]
    let reason = match crate::cuda::probe(ordinal) {
        Err(why) => why,
        Ok(info) => format!("{info} found, but its setup failed"),
    };
    #[cfg(not(feature = "cuda"))]
    let reason = {
        let _ = ordinal;
        "this build has no CUDA backend (the engine's `cuda` feature is off)".to_string()
    };
    Error::DeviceUnavailable { device, reason }
}

/// How many CUDA devices the driver sees on this machine: 0 where CUDA cannot run (no driver,
/// a library missing, a build without the backend). Creates no context, so every rank of a
/// job may ask before it picks its device.
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        if crate::cuda::missing_libraries().is_empty() {
            return cudarc::driver::CudaContext::device_count()
                .map_or(0, |n| usize::try_from(n).unwrap_or(0));
        }
    }
    0
}

/// The backend computing on `device`, or why none can.
pub fn backend_for(device: Device) -> Result<&'static dyn Backend> {
    match device {
        Device::Cpu => Ok(&crate::cpu::CpuBackend),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) if crate::cuda::gpu(n).is_ok() => Ok(if crate::profile::enabled() {
            &crate::cuda::Profiled
        } else {
            &crate::cuda::CudaBackend
        }),
        d @ Device::Cuda(_) => Err(cuda_unavailable(d)),
    }
}

/// Fused transformer kernels (softmax, norms, rotary embedding, embedding lookup, cross-entropy).
/// Each forward and backward is one kernel; the ops in `ops/` own shapes, checks and autograd.
/// A trait of its own (next to [`Backend`]) so op families added in parallel never edit the same
/// trait body; a device backend implements both.
pub trait FusedBackend: Send + Sync {
    /// Softmax (or log-softmax when `log`) of `x` over `dim`.
    fn softmax(&self, x: &Tensor, dim: usize, log: bool) -> Result<Tensor>;
    /// Gradient of softmax (or log-softmax) given its output `y` and the output gradient `g`.
    fn softmax_backward(&self, y: &Tensor, g: &Tensor, dim: usize, log: bool) -> Result<Tensor>;
    /// RMSNorm over the last dim: `(out, rstd)` with `rstd` one f32 per row.
    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, eps: f32) -> Result<(Tensor, Tensor)>;
    /// RMSNorm gradients `(dx, dw)`; `dw` is computed when `need_w` (and `w` is given).
    fn rms_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        rstd: &Tensor,
        g: &Tensor,
        need_w: bool,
    ) -> Result<(Tensor, Option<Tensor>)>;
    /// LayerNorm over the last dim: `(out, mean, rstd)` with one f32 per row each.
    fn layer_norm(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        b: Option<&Tensor>,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)>;
    /// LayerNorm gradients `(dx, dw, db)`.
    fn layer_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        g: &Tensor,
        need: (bool, bool),
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)>;
    /// Rotates pairs of `x` by the angles whose cos/sin `cos`, `sin` hold (`inverse`: by minus them).
    fn rope(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        spec: crate::ops::RopeSpec,
        inverse: bool,
    ) -> Result<Tensor>;
    /// Rows of `weight` at `ids` (already checked in range): `ids.shape + [D]`.
    fn embedding(&self, weight: &Tensor, ids: &Tensor) -> Result<Tensor>;
    /// Scatter-add of `g` (`ids.shape + [D]`) into a `[vocab, D]` gradient of `dtype`.
    fn embedding_backward(
        &self,
        ids: &Tensor,
        g: &Tensor,
        vocab: usize,
        dtype: DType,
    ) -> Result<Tensor>;
    /// Per-row cross-entropy of `logits [N, V]` against checked `targets [N]`:
    /// `(loss [N] f32, logsumexp [N] f32)`; ignored rows have loss 0.
    fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: Option<i64>,
        label_smoothing: f32,
    ) -> Result<(Tensor, Tensor)>;
    /// Gradient of `sum_i scale_i * loss_i` w.r.t. the logits, with `row_scale [N]` f32
    /// (already zero on ignored rows).
    fn cross_entropy_backward(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        lse: &Tensor,
        row_scale: &Tensor,
        ignore_index: Option<i64>,
        label_smoothing: f32,
    ) -> Result<Tensor>;
}

/// The fused-kernel backend computing on `device`, or why none can.
pub fn fused_backend_for(device: Device) -> Result<&'static dyn FusedBackend> {
    match device {
        Device::Cpu => Ok(&crate::cpu::CpuBackend),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) if crate::cuda::gpu(n).is_ok() => Ok(if crate::profile::enabled() {
            &crate::cuda::Profiled
        } else {
            &crate::cuda::CudaBackend
        }),
        d @ Device::Cuda(_) => Err(cuda_unavailable(d)),
    }
}

/// Optimizer kernels: fused, in-place, multi-tensor updates (no autograd). The op in
/// `ops/optim.rs` checks dtypes, shapes and aliasing first.
pub trait OptimBackend: Send + Sync {
    /// One AdamW step over every group, in place.
    fn adamw(&self, groups: &[crate::ops::AdamWTensors<'_>], hp: &crate::ops::AdamW) -> Result<()>;
    /// `Σ x²` of each tensor (any float dtype), as an f32 tensor `[tensors.len()]` on their
    /// device: a gradient norm's parts, in one pass over all of them.
    fn sum_of_squares(&self, tensors: &[&Tensor]) -> Result<Tensor>;
}

/// The optimizer-kernel backend computing on `device`, or why none can.
pub fn optim_backend_for(device: Device) -> Result<&'static dyn OptimBackend> {
    match device {
        Device::Cpu => Ok(&crate::cpu::CpuBackend),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) if crate::cuda::gpu(n).is_ok() => Ok(if crate::profile::enabled() {
            &crate::cuda::Profiled
        } else {
            &crate::cuda::CudaBackend
        }),
        d @ Device::Cuda(_) => Err(cuda_unavailable(d)),
    }
}

/// Fused kernels of the training fast path (SwiGLU, ...): a trait of its own so it grows
/// without touching the others' bodies.
pub trait FusionBackend: Send + Sync {
    /// `silu(gate) * up`, elementwise.
    fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor>;
    /// Gradients `(d gate, d up)` of [`FusionBackend::swiglu`] given the output gradient.
    fn swiglu_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor)>;
}

/// The fusion backend computing on `device`, or why none can.
pub fn fusion_backend_for(device: Device) -> Result<&'static dyn FusionBackend> {
    match device {
        Device::Cpu => Ok(&crate::cpu::CpuBackend),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) if crate::cuda::gpu(n).is_ok() => Ok(if crate::profile::enabled() {
            &crate::cuda::Profiled
        } else {
            &crate::cuda::CudaBackend
        }),
        d @ Device::Cuda(_) => Err(cuda_unavailable(d)),
    }
}

/// Kernels of the gated delta rule (`ops::gated_delta_rule`): a trait of its own, like
/// [`FusionBackend`]. Results are f32 whatever the inputs' dtypes.
pub trait DeltaRuleBackend: Send + Sync {
    /// The chunked forward: `(out [B, T, Hv, Dv], final state [B, Hv, Dk, Dv], chunk states)`,
    /// the last (when `save`) the state entering every chunk, `[B·Hv, chunks, Dk, Dv]`, which
    /// the backward starts each chunk from.
    fn delta_rule(
        &self,
        x: &crate::ops::DeltaRuleInputs<'_>,
        spec: &crate::ops::DeltaRuleSpec,
        save: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)>;
    /// Gradients `[q, k, v, g, beta, initial state]` shaped like the inputs (the state's even
    /// when none was given), from the forward's chunk states and the gradients of its output and
    /// final state.
    fn delta_rule_backward(
        &self,
        x: &crate::ops::DeltaRuleInputs<'_>,
        spec: &crate::ops::DeltaRuleSpec,
        chunk_states: &Tensor,
        d_out: &Tensor,
        d_state: &Tensor,
    ) -> Result<[Tensor; 6]>;
    /// The recurrence token by token from `x.state` (zeros when absent): `(out, new state)`.
    fn delta_rule_recurrent(
        &self,
        x: &crate::ops::DeltaRuleInputs<'_>,
        spec: &crate::ops::DeltaRuleSpec,
    ) -> Result<(Tensor, Tensor)>;
}

/// The delta-rule backend computing on `device`, or why none can.
pub fn delta_rule_backend_for(device: Device) -> Result<&'static dyn DeltaRuleBackend> {
    match device {
        Device::Cpu => Ok(&crate::cpu::CpuBackend),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) if crate::cuda::gpu(n).is_ok() => Ok(if crate::profile::enabled() {
            &crate::cuda::Profiled
        } else {
            &crate::cuda::CudaDeltaRule
        }),
        d @ Device::Cuda(_) => Err(cuda_unavailable(d)),
    }
}
