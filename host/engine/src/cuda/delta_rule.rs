//! The gated delta rule for tensors on a GPU, computed by the CPU backend: the inputs are copied
//! to the host and the results back to their device. No CUDA kernel computes it yet; this keeps
//! Qwen3.5 and Kimi Linear running on a GPU unchanged, with the CPU's results bit for bit, at
//! the price of the CPU's speed and two host round trips per layer (as PyTorch's MPS fallback
//! does for ops without a kernel). The forward's chunk states stay on the host, where the
//! backward reads them.

use crate::backend::DeltaRuleBackend;
use crate::cpu::CpuBackend;
use crate::error::Result;
use crate::ops::{DeltaRuleInputs, DeltaRuleSpec};
use crate::{Device, Tensor};

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
