//! The gated delta rule for tensors on a GPU. [`CudaDeltaRule`] runs kernels/delta_rule.cu (the
//! recurrence with one thread per value channel; the backward recomputes each chunk's states
//! from the forward's checkpoints), for key dims up to 128 and value dims up to 256: every
//! model the plugins build. Other sizes take [`HostDeltaRule`]: the CPU backend's results, with
//! the inputs copied to the host and the results back (as PyTorch's MPS fallback does for an op
//! without a kernel).

use super::backend::contiguous_as;
use super::launch::{empty, gpu_of, launch, ptr, zeros};
use crate::backend::DeltaRuleBackend;
use crate::cpu::CpuBackend;
use crate::error::Result;
use crate::ops::{DeltaRuleInputs, DeltaRuleSpec};
use crate::{DType, Device, Tensor};
use cudarc::driver::{DeviceRepr, LaunchConfig};

/// Tokens between the forward's saved states (the kernel's `DR_CHUNK`, the CPU's chunk).
const CHUNK: usize = 64;

/// The `DeltaDims` struct of kernels/delta_rule.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct DeltaDims {
    t: i64,
    hv: i64,
    dk: i64,
    dv: i64,
    gd: i64,
    scale: f32,
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for DeltaDims {}

/// [`DeltaRuleBackend`] of CUDA devices: the kernels where the sizes fit, else [`HostDeltaRule`].
pub struct CudaDeltaRule;

/// The kernels' key-dim bucket for `spec` (their register arrays' length), or `None` when the
/// sizes are outside what they take.
fn bucket(spec: &DeltaRuleSpec) -> Option<usize> {
    let dk = [16, 32, 64, 128].into_iter().find(|&b| spec.dk <= b)?;
    (spec.dv >= 1 && spec.dv <= 256 && spec.dk >= 1).then_some(dk)
}

/// One block per (batch, value head), one thread per value channel (whole warps).
fn cfg(spec: &DeltaRuleSpec) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((spec.b * spec.hv) as u32, 1, 1),
        block_dim: (spec.dv.div_ceil(32) as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn dims(spec: &DeltaRuleSpec) -> DeltaDims {
    DeltaDims {
        t: spec.t as i64,
        hv: spec.hv as i64,
        dk: spec.dk as i64,
        dv: spec.dv as i64,
        gd: spec.gd() as i64,
        scale: spec.scale,
    }
}

/// Contiguous f32 inputs, with q and k repeated per value head (`[B, T, Hv, Dk]`).
struct Prepared {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
}

/// `[B, T, Hk, Dk]` repeated to `[B, T, Hv, Dk]` (each key head for its group of value heads).
fn per_value_head(x: &Tensor, spec: &DeltaRuleSpec) -> Result<Tensor> {
    let x = contiguous_as(x, DType::F32, OP)?;
    if spec.hk == spec.hv {
        return Ok(x);
    }
    let group = spec.hv / spec.hk;
    let (b, t, hk, dk) = (spec.b, spec.t, spec.hk, spec.dk);
    let wide = x
        .reshape(&[b, t, hk, 1, dk])?
        .expand(&[b, t, hk, group, dk])?;
    contiguous_as(&wide, DType::F32, OP)?.reshape(&[b, t, spec.hv, dk])
}

/// The sum of `[B, T, Hv, Dk]` gradients over each key head's group: `[B, T, Hk, Dk]`.
fn per_key_head(x: Tensor, spec: &DeltaRuleSpec) -> Result<Tensor> {
    if spec.hk == spec.hv {
        return Ok(x);
    }
    let group = spec.hv / spec.hk;
    let (b, t, hk, dk) = (spec.b, spec.t, spec.hk, spec.dk);
    x.reshape(&[b, t, hk, group, dk])?.sum_dims(&[3], false)
}

const OP: &str = "gated_delta_rule";

impl Prepared {
    fn of(x: &DeltaRuleInputs<'_>, spec: &DeltaRuleSpec) -> Result<Prepared> {
        let f32 = |t: &Tensor| contiguous_as(t, DType::F32, OP);
        Ok(Prepared {
            q: per_value_head(x.q, spec)?,
            k: per_value_head(x.k, spec)?,
            v: f32(x.v)?,
            g: f32(x.g)?,
            beta: f32(x.beta)?,
        })
    }
}

/// The state the recurrence starts from, as a fresh f32 buffer the kernel updates in place.
fn initial_state(x: &DeltaRuleInputs<'_>, spec: &DeltaRuleSpec) -> Result<Tensor> {
    let shape = [spec.b, spec.hv, spec.dk, spec.dv];
    match x.state {
        Some(s) => super::materialize(s, DType::F32)?.reshape(&shape),
        None => zeros(&gpu_of(x.q, OP)?, DType::F32, &shape),
    }
}

impl CudaDeltaRule {
    fn forward(
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
        save: bool,
        dk_bucket: usize,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let gpu = gpu_of(x.q, OP)?;
        let p = Prepared::of(x, spec)?;
        let state = initial_state(x, spec)?;
        let out = empty(&gpu, DType::F32, &[spec.b, spec.t, spec.hv, spec.dv])?;
        let chunks = spec.t.div_ceil(CHUNK);
        let saved = save
            .then(|| {
                empty(
                    &gpu,
                    DType::F32,
                    &[spec.b * spec.hv, chunks, spec.dk, spec.dv],
                )
            })
            .transpose()?;
        if spec.b * spec.hv * spec.t * spec.dv > 0 {
            let sp = match &saved {
                Some(c) => ptr(c, OP)?,
                None => 0u64,
            };
            let (qp, kp, vp, gp, bp) = (
                ptr(&p.q, OP)?,
                ptr(&p.k, OP)?,
                ptr(&p.v, OP)?,
                ptr(&p.g, OP)?,
                ptr(&p.beta, OP)?,
            );
            let (st, op) = (ptr(&state, OP)?, ptr(&out, OP)?);
            let m = dims(spec);
            launch!(gpu, "delta_rule", format!("delta_rule_fwd_{dk_bucket}"), cfg(spec);
                m, qp, kp, vp, gp, bp, st, op, sp)?;
        }
        Ok((out, state, saved))
    }
}

impl DeltaRuleBackend for CudaDeltaRule {
    fn delta_rule(
        &self,
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
        save: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        match bucket(spec) {
            Some(dk) => Self::forward(x, spec, save, dk),
            None => HostDeltaRule.delta_rule(x, spec, save),
        }
    }

    fn delta_rule_backward(
        &self,
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
        chunk_states: &Tensor,
        d_out: &Tensor,
        d_state: &Tensor,
    ) -> Result<[Tensor; 6]> {
        let Some(dk_bucket) = bucket(spec) else {
            return HostDeltaRule.delta_rule_backward(x, spec, chunk_states, d_out, d_state);
        };
        let gpu = gpu_of(x.q, OP)?;
        let p = Prepared::of(x, spec)?;
        // The forward's checkpoints, on the device (a host forward's fallback left them there).
        let chunks = if chunk_states.device() == x.q.device() {
            contiguous_as(chunk_states, DType::F32, OP)?
        } else {
            chunk_states.to_device(x.q.device())?
        };
        let dout = contiguous_as(d_out, DType::F32, OP)?;
        let dstate = super::materialize(d_state, DType::F32)?
            .reshape(&[spec.b, spec.hv, spec.dk, spec.dv])?;
        let (b, t, hv, dk, dv) = (spec.b, spec.t, spec.hv, spec.dk, spec.dv);
        let scratch = empty(&gpu, DType::F32, &[b * hv, CHUNK.min(t.max(1)), dk, dv])?;
        let dq = zeros(&gpu, DType::F32, &[b, t, hv, dk])?;
        let dkt = zeros(&gpu, DType::F32, &[b, t, hv, dk])?;
        let dvt = zeros(&gpu, DType::F32, &[b, t, hv, dv])?;
        let dg = zeros(&gpu, DType::F32, x.g.shape())?;
        let dbeta = zeros(&gpu, DType::F32, &[b, t, hv])?;
        if b * hv * t * dv > 0 {
            let ins = [&p.q, &p.k, &p.v, &p.g, &p.beta, &chunks, &dout];
            let [qp, kp, vp, gp, bp, cp, op] = ins.map(|t| ptr(t, OP));
            let (qp, kp, vp, gp, bp, cp, op) = (qp?, kp?, vp?, gp?, bp?, cp?, op?);
            let outs = [&dstate, &scratch, &dq, &dkt, &dvt, &dg, &dbeta];
            let [sp, scp, dqp, dkp, dvp, dgp, dbp] = outs.map(|t| ptr(t, OP));
            let (sp, scp, dqp, dkp, dvp, dgp, dbp) = (sp?, scp?, dqp?, dkp?, dvp?, dgp?, dbp?);
            let m = dims(spec);
            launch!(gpu, "delta_rule", format!("delta_rule_bwd_{dk_bucket}"), cfg(spec);
                m, qp, kp, vp, gp, bp, cp, op, sp, scp, dqp, dkp, dvp, dgp, dbp)?;
        }
        Ok([
            per_key_head(dq, spec)?,
            per_key_head(dkt, spec)?,
            dvt,
            dg,
            dbeta,
            dstate,
        ])
    }

    fn delta_rule_recurrent(
        &self,
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
    ) -> Result<(Tensor, Tensor)> {
        match bucket(spec) {
            Some(dk) => {
                let (out, state, _) = Self::forward(x, spec, false, dk)?;
                Ok((out, state))
            }
            None => HostDeltaRule.delta_rule_recurrent(x, spec),
        }
    }
}

/// [`DeltaRuleBackend`] of CUDA devices, by way of the CPU backend.
pub struct HostDeltaRule;

fn host(t: &Tensor) -> Result<Tensor> {
    t.to_device(Device::Cpu)
}

/// Host copies of the inputs, and the device they came from.
struct OnHost {
    device: Device,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Option<Tensor>,
}

impl OnHost {
    fn of(x: &DeltaRuleInputs<'_>) -> Result<OnHost> {
        Ok(OnHost {
            device: x.q.device(),
            q: host(x.q)?,
            k: host(x.k)?,
            v: host(x.v)?,
            g: host(x.g)?,
            beta: host(x.beta)?,
            state: x.state.map(host).transpose()?,
        })
    }

    fn inputs(&self) -> DeltaRuleInputs<'_> {
        DeltaRuleInputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
            state: self.state.as_ref(),
        }
    }
}

impl DeltaRuleBackend for HostDeltaRule {
    fn delta_rule(
        &self,
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
        save: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let h = OnHost::of(x)?;
        let (out, state, chunk_states) = CpuBackend.delta_rule(&h.inputs(), spec, save)?;
        Ok((
            out.to_device(h.device)?,
            state.to_device(h.device)?,
            chunk_states,
        ))
    }

    fn delta_rule_backward(
        &self,
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
        chunk_states: &Tensor,
        d_out: &Tensor,
        d_state: &Tensor,
    ) -> Result<[Tensor; 6]> {
        let h = OnHost::of(x)?;
        let grads = CpuBackend.delta_rule_backward(
            &h.inputs(),
            spec,
            &host(chunk_states)?,
            &host(d_out)?,
            &host(d_state)?,
        )?;
        let mut placed = Vec::with_capacity(6);
        for g in grads {
            placed.push(g.to_device(h.device)?);
        }
        Ok(placed.try_into().expect("six gradients"))
    }

    fn delta_rule_recurrent(
        &self,
        x: &DeltaRuleInputs<'_>,
        spec: &DeltaRuleSpec,
    ) -> Result<(Tensor, Tensor)> {
        let h = OnHost::of(x)?;
        let (out, state) = CpuBackend.delta_rule_recurrent(&h.inputs(), spec)?;
        Ok((out.to_device(h.device)?, state.to_device(h.device)?))
    }
}
