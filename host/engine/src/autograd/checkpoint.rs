//! Recompute regions (activation checkpointing): run a function without keeping its
//! activations, and run it again during backward to get them back.

use super::{no_grad, record, set_grad_enabled};
use crate::error::Result;
use crate::tensor::Tensor;
use std::sync::Arc;

/// The function of a recompute region: from its inputs to one output.
pub type RegionFn = Arc<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>;

/// Runs `f(inputs)` keeping none of its intermediate activations; backward recomputes them.
///
/// Tensors that `f` captures (parameters) receive their gradients during the recompute. `f`
/// must be deterministic: randomness inside it must be keyed explicitly (see [`crate::rng`]),
/// so the recomputation sees the same values.
pub fn checkpoint(inputs: &[Tensor], f: RegionFn) -> Result<Tensor> {
    let out = {
        let _g = no_grad();
        let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        f(&detached)?
    };
    let saved: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    // The recompute runs in backward, outside the forward's autocast region: replay its mode.
    let amp = crate::autocast::autocast_dtype();
    let f: RegionFn = Arc::new(move |xs: &[Tensor]| {
        let _amp = crate::autocast::set_autocast(amp);
        f(xs)
    });
    let wants: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    // Parameters captured by `f` are not inputs of the node, so the region must be recorded
    // whenever grad is on, even if no explicit input requires grad.
    let out = if !inputs.iter().any(|t| t.requires_grad()) && super::is_grad_enabled() {
        let anchor = Tensor::zeros(&[], crate::DType::F32).requires_grad_();
        let mut with_anchor = refs.clone();
        with_anchor.push(&anchor);
        let f2 = f.clone();
        let saved2 = saved.clone();
        let wants2 = wants.clone();
        record("checkpoint", out, &with_anchor, move || {
            move |g: &Tensor| {
                let mut grads = recompute(&f2, &saved2, &wants2, g)?;
                grads.push(None);
                Ok(grads)
            }
        })
    } else {
        record("checkpoint", out, &refs, move || {
            move |g: &Tensor| recompute(&f, &saved, &wants, g)
        })
    };
    Ok(out)
}

fn recompute(
    f: &RegionFn,
    saved: &[Tensor],
    wants: &[bool],
    g: &Tensor,
) -> Result<Vec<Option<Tensor>>> {
    let _on = set_grad_enabled(true);
    let leaves: Vec<Tensor> = saved
        .iter()
        .zip(wants)
        .map(|(t, &w)| {
            if w {
                t.detach().requires_grad_()
            } else {
                t.detach()
            }
        })
        .collect();
    let out = {
        let _phase = crate::profile::phase("recompute");
        f(&leaves)?
    };
    if out.requires_grad() {
        // Inside a split backward the region splits too: its inputs' gradients now, the
        // parameters' with the weight pass.
        super::split::backward_region(&out, g.clone(), &leaves)?;
    }
    Ok(leaves
        .iter()
        .zip(wants)
        .map(|(l, &w)| if w { l.grad() } else { None })
        .collect())
}
