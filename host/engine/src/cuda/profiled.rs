//! The CUDA backend under `anneal train --profile`: [`Profiled`] forwards every kernel to
//! [`CudaBackend`] between two timing events on the device's stream, and gives the profiler the
//! op's cost (FLOPs, bytes moved, tensor cores or not) for the roofline column. Outside the
//! profiled window the backend getters hand out [`CudaBackend`] itself, so this costs nothing
//! then.

use super::backend::CudaBackend;
use super::device::Gpu;
use crate::backend::{Backend, DeltaRuleBackend, FusedBackend, FusionBackend, OptimBackend};
use crate::error::Result;
use crate::ops::{AdamW, AdamWTensors, AttentionGrads, AttentionSpec, BinaryOp, ReduceOp};
use crate::ops::{DeltaRuleInputs, DeltaRuleSpec, RopeSpec, UnaryOp};
use crate::profile::{Cost, DevicePeak, DeviceSpan, PendingSpan};
use crate::{DType, Device, Tensor};
use cudarc::driver::sys::{CUdevice_attribute as Attr, CUevent_flags};
use cudarc::driver::CudaEvent;
use std::sync::Arc;

/// [`CudaBackend`] with each op timed on the device.
pub(crate) struct Profiled;

/// An op's start event on its device's stream.
struct Timer {
    gpu: Arc<Gpu>,
    start: CudaEvent,
}

impl Timer {
    fn start(t: &Tensor) -> Option<Timer> {
        let Device::Cuda(n) = t.device() else {
            return None;
        };
        let gpu = super::gpu(n).ok()?;
        let start = gpu
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .ok()?;
        Some(Timer { gpu, start })
    }

    fn stop(self, name: &'static str, cost: Cost) {
        let Ok(end) = self
            .gpu
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        else {
            return;
        };
        let phase = crate::profile::current_phase();
        let gpu = self.gpu.clone();
        let span = Pending {
            start: self.start,
            end,
            name,
            phase,
            cost,
        };
        crate::profile::record_device(Box::new(span), || peak(&gpu));
    }
}

struct Pending {
    start: CudaEvent,
    end: CudaEvent,
    name: &'static str,
    phase: &'static str,
    cost: Cost,
}

impl PendingSpan for Pending {
    fn resolve(self: Box<Self>) -> Option<DeviceSpan> {
        let ms = self.start.elapsed_ms(&self.end).ok()?;
        Some(DeviceSpan {
            name: self.name,
            phase: self.phase,
            ns: (f64::from(ms.max(0.0)) * 1e6) as u64,
            cost: self.cost,
        })
    }
}

/// The device's peaks: the datasheet's for the GPUs training runs on (dense bf16, SXM boards),
/// else derived from the driver's attributes (SMs × clock × per-SM rate of the architecture,
/// memory clock × bus width).
pub(crate) fn peak(gpu: &Gpu) -> DevicePeak {
    let attr = |a: Attr| f64::from(gpu.ctx.attribute(a).unwrap_or(0));
    let name = gpu
        .ctx
        .name()
        .unwrap_or_else(|_| format!("cuda:{}", gpu.ordinal));
    let known = [
        ("H200", 989.4e12, 66.9e12, 4.8e12),
        ("H100", 989.4e12, 66.9e12, 3.35e12),
        ("A100", 312e12, 19.5e12, 2.0e12),
    ];
    if let Some(&(_, tensor, vector, bw)) = known.iter().find(|k| name.contains(k.0)) {
        return DevicePeak {
            name,
            tensor_flops: tensor,
            vector_flops: vector,
            bytes_per_s: bw,
        };
    }
    let sms = attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    let clock_hz = attr(Attr::CU_DEVICE_ATTRIBUTE_CLOCK_RATE) * 1e3;
    let major = gpu
        .arch
        .trim_start_matches("sm_")
        .get(..1)
        .and_then(|m| m.parse::<u32>().ok())
        .unwrap_or(8);
    // Dense bf16 tensor-core and FP32 FLOPs per SM per clock.
    let (tensor_per_sm, vector_per_sm) = match major {
        9.. => (4096.0, 256.0),
        8 if gpu.arch == "sm_80" => (2048.0, 128.0),
        _ => (1024.0, 256.0),
    };
    let mem_hz = attr(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE) * 1e3;
    let bus_bytes = attr(Attr::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH) / 8.0;
    DevicePeak {
        name,
        tensor_flops: sms * clock_hz * tensor_per_sm,
        vector_flops: sms * clock_hz * vector_per_sm,
        // Double data rate.
        bytes_per_s: 2.0 * mem_hz * bus_bytes,
    }
}

/// Bytes of `ts` in device memory.
fn bytes(ts: &[&Tensor]) -> f64 {
    ts.iter()
        .map(|t| (t.numel() * t.dtype().size_in_bytes()) as f64)
        .sum()
}

/// `per` FLOPs per output element, every operand read once and the output written once.
fn elementwise(ins: &[&Tensor], out: &Tensor, per: f64) -> Cost {
    Cost {
        flops: per * out.numel() as f64,
        bytes: bytes(ins) + bytes(&[out]),
        tensor_cores: false,
    }
}

fn low_precision(t: &Tensor) -> bool {
    matches!(t.dtype(), DType::BF16 | DType::F16)
}

/// Forward attention FLOPs (FlashAttention's count: Q·Kᵀ and P·V, half of it under a causal
/// mask over equal lengths).
fn attention_flops(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> f64 {
    let (s, ks, vs) = (q.shape(), k.shape(), v.shape());
    let (b, h, tq, d) = (s[0], s[1], s[2], s[3]);
    let (tk, dv) = (ks[2], vs[3]);
    let full = 2.0 * (b * h * tq * tk) as f64 * (d + dv) as f64;
    if spec.causal && tq == tk {
        full / 2.0
    } else {
        full
    }
}

/// Runs `call` between two events when profiling, recording `name` with the cost `cost`
/// gives for its result.
fn timed<T>(
    on: &Tensor,
    name: &'static str,
    call: impl FnOnce() -> Result<T>,
    cost: impl FnOnce(&T) -> Cost,
) -> Result<T> {
    let timer = Timer::start(on);
    let out = call()?;
    if let Some(t) = timer {
        t.stop(name, cost(&out));
    }
    Ok(out)
}

const CUDA: CudaBackend = CudaBackend;

impl Backend for Profiled {
    fn name(&self) -> &'static str {
        CUDA.name()
    }
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        timed(
            x,
            "unary",
            || CUDA.unary(op, x),
            |o| elementwise(&[x], o, 1.0),
        )
    }
    fn unary_grad(&self, op: UnaryOp, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let call = || CUDA.unary_grad(op, x, grad);
        timed(x, "unary_grad", call, |o| elementwise(&[x, grad], o, 2.0))
    }
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        timed(
            a,
            "binary",
            || CUDA.binary(op, a, b),
            |o| elementwise(&[a, b], o, 1.0),
        )
    }
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        let call = || CUDA.affine(x, mul, add);
        timed(x, "affine", call, |o| elementwise(&[x], o, 2.0))
    }
    fn powf(&self, x: &Tensor, e: f32) -> Result<Tensor> {
        timed(x, "powf", || CUDA.powf(x, e), |o| elementwise(&[x], o, 1.0))
    }
    fn clamp(&self, x: &Tensor, lo: f32, hi: f32) -> Result<Tensor> {
        timed(
            x,
            "clamp",
            || CUDA.clamp(x, lo, hi),
            |o| elementwise(&[x], o, 1.0),
        )
    }
    fn reduce(&self, op: ReduceOp, x: &Tensor, dim: usize) -> Result<Tensor> {
        let call = || CUDA.reduce(op, x, dim);
        timed(x, "reduce", call, |o| Cost {
            flops: x.numel() as f64,
            ..elementwise(&[x], o, 0.0)
        })
    }
    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        timed(
            a,
            "matmul",
            || CUDA.matmul(a, b),
            |o| Cost {
                flops: 2.0 * o.numel() as f64 * a.shape().last().copied().unwrap_or(0) as f64,
                bytes: bytes(&[a, b, o]),
                tensor_cores: low_precision(a),
            },
        )
    }
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        timed(
            x,
            "cast",
            || CUDA.cast(x, dtype),
            |o| elementwise(&[x], o, 0.0),
        )
    }
    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let call = || CUDA.add_assign(dst, src);
        timed(dst, "add_assign", call, |_| {
            elementwise(&[dst, src], dst, 1.0)
        })
    }
    fn topk(
        &self,
        x: &Tensor,
        k: usize,
        dim: usize,
        largest: bool,
        sorted: bool,
    ) -> Result<(Tensor, Tensor)> {
        let call = || CUDA.topk(x, k, dim, largest, sorted);
        timed(x, "topk", call, |(v, i)| Cost {
            flops: (x.numel() * k.max(1)) as f64,
            bytes: bytes(&[x, v, i]),
            tensor_cores: false,
        })
    }
    fn index_select(&self, x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
        let call = || CUDA.index_select(x, dim, idx);
        timed(x, "index_select", call, |o| elementwise(&[idx, o], o, 0.0))
    }
    fn index_add(&self, base: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        let call = || CUDA.index_add(base, dim, idx, src);
        timed(base, "index_add", call, |o| {
            elementwise(&[base, idx, src], o, 1.0)
        })
    }
    fn gather(&self, x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
        let call = || CUDA.gather(x, dim, idx);
        timed(x, "gather", call, |o| elementwise(&[idx, o], o, 0.0))
    }
    fn scatter_add(&self, x: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        let call = || CUDA.scatter_add(x, dim, idx, src);
        timed(x, "scatter_add", call, |o| {
            elementwise(&[x, idx, src], o, 1.0)
        })
    }
    fn where_(&self, cond: &Tensor, a: &Tensor, b: &Tensor, dtype: DType) -> Result<Tensor> {
        let call = || CUDA.where_(cond, a, b, dtype);
        timed(a, "where", call, |o| elementwise(&[cond, a, b], o, 1.0))
    }
    fn sort_by_expert(&self, ids: &Tensor, num_experts: usize) -> Result<[Tensor; 4]> {
        let call = || CUDA.sort_by_expert(ids, num_experts);
        timed(ids, "sort_by_expert", call, |o| {
            elementwise(&[ids, &o[0], &o[1], &o[2]], &o[0], 0.0)
        })
    }
    fn grouped_matmul(
        &self,
        x: &Tensor,
        w: &Tensor,
        counts: &Tensor,
        transpose_w: bool,
    ) -> Result<Tensor> {
        let call = || CUDA.grouped_matmul(x, w, counts, transpose_w);
        timed(x, "grouped_matmul", call, |o| Cost {
            flops: 2.0 * o.numel() as f64 * x.shape().last().copied().unwrap_or(0) as f64,
            bytes: bytes(&[x, w, o]),
            tensor_cores: low_precision(x),
        })
    }
    fn grouped_matmul_weight_grad(
        &self,
        x: &Tensor,
        g: &Tensor,
        counts: &Tensor,
    ) -> Result<Tensor> {
        let call = || CUDA.grouped_matmul_weight_grad(x, g, counts);
        timed(x, "grouped_matmul_wgrad", call, |o| Cost {
            flops: 2.0 * x.numel() as f64 * g.shape().last().copied().unwrap_or(0) as f64,
            bytes: bytes(&[x, g, o]),
            tensor_cores: low_precision(x),
        })
    }
    fn moe_dispatch(&self, x: &Tensor, token: &Tensor, dtype: DType) -> Result<Tensor> {
        let call = || CUDA.moe_dispatch(x, token, dtype);
        timed(x, "moe_dispatch", call, |o| elementwise(&[o], o, 0.0))
    }
    fn moe_dispatch_backward(
        &self,
        g: &Tensor,
        inverse: &Tensor,
        k: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let call = || CUDA.moe_dispatch_backward(g, inverse, k, dtype);
        timed(g, "moe_dispatch_backward", call, |o| {
            elementwise(&[g], o, k as f64)
        })
    }
    fn moe_combine(
        &self,
        y: &Tensor,
        w: &Tensor,
        inverse: &Tensor,
        dtype: DType,
    ) -> Result<Tensor> {
        let call = || CUDA.moe_combine(y, w, inverse, dtype);
        timed(y, "moe_combine", call, |o| Cost {
            flops: 2.0 * y.numel() as f64,
            ..elementwise(&[y, w], o, 0.0)
        })
    }
    fn moe_combine_backward(
        &self,
        y: &Tensor,
        w: &Tensor,
        g: &Tensor,
        order: &Tensor,
        inverse: &Tensor,
        need: (bool, bool),
        dtypes: (DType, DType),
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let call = || CUDA.moe_combine_backward(y, w, g, order, inverse, need, dtypes);
        timed(y, "moe_combine_backward", call, |_| Cost {
            flops: 4.0 * y.numel() as f64,
            bytes: bytes(&[y, w, g, y]),
            tensor_cores: false,
        })
    }
    fn cat(&self, tensors: &[Tensor], dim: usize) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return CUDA.cat(tensors, dim);
        };
        timed(
            first,
            "cat",
            || CUDA.cat(tensors, dim),
            |o| elementwise(&[o, o], o, 0.0),
        )
    }
    fn dropout(
        &self,
        x: &Tensor,
        p: f32,
        scale: f32,
        key: &crate::rng::RngKey,
        offset: u64,
    ) -> Result<Tensor> {
        let call = || CUDA.dropout(x, p, scale, key, offset);
        timed(x, "dropout", call, |o| elementwise(&[x], o, 2.0))
    }
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        let call = || CUDA.attention(q, k, v, sinks, spec);
        timed(q, "attention", call, |(o, lse)| Cost {
            flops: attention_flops(q, k, v, spec),
            bytes: bytes(&[q, k, v, o, lse]),
            tensor_cores: low_precision(q),
        })
    }
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        out: &Tensor,
        lse: &Tensor,
        grad: &Tensor,
        spec: &AttentionSpec,
    ) -> Result<AttentionGrads> {
        let call = || CUDA.attention_backward(q, k, v, sinks, out, lse, grad, spec);
        timed(q, "attention_backward", call, |g| Cost {
            // Q·Kᵀ again, then dV, dP, dQ and dK: 2.5 times the forward.
            flops: 2.5 * attention_flops(q, k, v, spec),
            bytes: bytes(&[q, k, v, out, lse, grad, &g.q, &g.k, &g.v]),
            tensor_cores: low_precision(q),
        })
    }
}

impl FusedBackend for Profiled {
    fn softmax(&self, x: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
        let call = || CUDA.softmax(x, dim, log);
        timed(x, "softmax", call, |o| elementwise(&[x], o, 5.0))
    }
    fn softmax_backward(&self, y: &Tensor, g: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
        let call = || CUDA.softmax_backward(y, g, dim, log);
        timed(y, "softmax_backward", call, |o| {
            elementwise(&[y, g], o, 4.0)
        })
    }
    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, eps: f32) -> Result<(Tensor, Tensor)> {
        let call = || CUDA.rms_norm(x, w, eps);
        timed(x, "rms_norm", call, |(o, _)| elementwise(&[x], o, 4.0))
    }
    fn rms_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        rstd: &Tensor,
        g: &Tensor,
        need_w: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let call = || CUDA.rms_norm_backward(x, w, rstd, g, need_w);
        timed(x, "rms_norm_backward", call, |(dx, _)| {
            elementwise(&[x, g], dx, 8.0)
        })
    }
    fn layer_norm(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        b: Option<&Tensor>,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let call = || CUDA.layer_norm(x, w, b, eps);
        timed(x, "layer_norm", call, |(o, _, _)| elementwise(&[x], o, 6.0))
    }
    fn layer_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        g: &Tensor,
        need: (bool, bool),
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let call = || CUDA.layer_norm_backward(x, w, mean, rstd, g, need);
        timed(x, "layer_norm_backward", call, |(dx, _, _)| {
            elementwise(&[x, g], dx, 10.0)
        })
    }
    fn rope(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        spec: RopeSpec,
        inverse: bool,
    ) -> Result<Tensor> {
        let call = || CUDA.rope(x, cos, sin, spec, inverse);
        timed(x, "rope", call, |o| elementwise(&[x, cos, sin], o, 3.0))
    }
    fn embedding(&self, weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let call = || CUDA.embedding(weight, ids);
        timed(weight, "embedding", call, |o| {
            elementwise(&[ids, o], o, 0.0)
        })
    }
    fn embedding_backward(
        &self,
        ids: &Tensor,
        g: &Tensor,
        vocab: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let call = || CUDA.embedding_backward(ids, g, vocab, dtype);
        timed(g, "embedding_backward", call, |o| {
            elementwise(&[ids, g], o, 1.0)
        })
    }
    fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: Option<i64>,
        label_smoothing: f32,
    ) -> Result<(Tensor, Tensor)> {
        let call = || CUDA.cross_entropy(logits, targets, ignore_index, label_smoothing);
        timed(logits, "cross_entropy", call, |(l, s)| Cost {
            flops: 4.0 * logits.numel() as f64,
            bytes: bytes(&[logits, targets, l, s]),
            tensor_cores: false,
        })
    }
    fn cross_entropy_backward(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        lse: &Tensor,
        row_scale: &Tensor,
        ignore_index: Option<i64>,
        label_smoothing: f32,
    ) -> Result<Tensor> {
        let call = || {
            CUDA.cross_entropy_backward(
                logits,
                targets,
                lse,
                row_scale,
                ignore_index,
                label_smoothing,
            )
        };
        timed(logits, "cross_entropy_backward", call, |o| {
            elementwise(&[logits, targets, lse, row_scale], o, 4.0)
        })
    }
}

impl FusionBackend for Profiled {
    fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let call = || CUDA.swiglu(gate, up);
        timed(gate, "swiglu", call, |o| elementwise(&[gate, up], o, 5.0))
    }
    fn swiglu_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let call = || CUDA.swiglu_backward(gate, up, grad);
        timed(gate, "swiglu_backward", call, |(dg, du)| Cost {
            flops: 10.0 * dg.numel() as f64,
            bytes: bytes(&[gate, up, grad, dg, du]),
            tensor_cores: false,
        })
    }
}

impl OptimBackend for Profiled {
    fn adamw(&self, groups: &[AdamWTensors<'_>], hp: &AdamW) -> Result<()> {
        let Some(first) = groups.first() else {
            return CUDA.adamw(groups, hp);
        };
        let elems: usize = groups.iter().map(|g| g.param.numel()).sum();
        timed(
            first.param,
            "adamw",
            || CUDA.adamw(groups, hp),
            |_| Cost {
                flops: 15.0 * elems as f64,
                // Parameter, gradient and both moments read; parameter and moments written.
                bytes: 7.0 * 4.0 * elems as f64,
                tensor_cores: false,
            },
        )
    }
    fn sum_of_squares(&self, tensors: &[&Tensor]) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return CUDA.sum_of_squares(tensors);
        };
        let call = || CUDA.sum_of_squares(tensors);
        timed(first, "sum_of_squares", call, |_| Cost {
            flops: 2.0 * tensors.iter().map(|t| t.numel()).sum::<usize>() as f64,
            bytes: bytes(tensors),
            tensor_cores: false,
        })
    }
}

/// The recurrence's FLOPs for `spec`: per token, value head and state element a decay, a product
/// into the memory, an update and a product into the output (8 with the multiply-adds).
fn delta_rule_flops(spec: &DeltaRuleSpec) -> f64 {
    8.0 * (spec.b * spec.t * spec.hv * spec.dk * spec.dv) as f64
}

fn delta_rule_inputs(x: &DeltaRuleInputs<'_>) -> f64 {
    bytes(&[x.q, x.k, x.v, x.g, x.beta]) + x.state.map_or(0.0, |s| bytes(&[s]))
}

impl DeltaRuleBackend for Profiled {
    fn delta_rule(
        &self,
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
        save: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let call = || super::CudaDeltaRule.delta_rule(x, spec, save);
        timed(x.q, "delta_rule", call, |(o, s, c)| Cost {
            flops: delta_rule_flops(spec),
            bytes: delta_rule_inputs(x) + bytes(&[o, s]) + c.as_ref().map_or(0.0, |c| bytes(&[c])),
            tensor_cores: false,
        })
    }
    fn delta_rule_backward(
        &self,
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
        chunk_states: &Tensor,
        d_out: &Tensor,
        d_state: &Tensor,
    ) -> Result<[Tensor; 6]> {
        let call =
            || super::CudaDeltaRule.delta_rule_backward(x, spec, chunk_states, d_out, d_state);
        timed(x.q, "delta_rule_backward", call, |g| Cost {
            // The forward again (recomputed chunks), then its adjoint: about three times it.
            flops: 4.0 * delta_rule_flops(spec),
            bytes: 2.0 * delta_rule_inputs(x)
                + bytes(&[chunk_states, d_out, d_state])
                + g.iter().map(|t| bytes(&[t])).sum::<f64>(),
            tensor_cores: false,
        })
    }
    fn delta_rule_recurrent(
        &self,
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
    ) -> Result<(Tensor, Tensor)> {
        let call = || super::CudaDeltaRule.delta_rule_recurrent(x, spec);
        timed(x.q, "delta_rule_recurrent", call, |(o, s)| Cost {
            flops: delta_rule_flops(spec),
            bytes: delta_rule_inputs(x) + bytes(&[o, s]),
            tensor_cores: false,
        })
    }
}
