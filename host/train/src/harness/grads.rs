//! Which tensors train, their gradient norm and clipping, the same for pretraining and RL.

use anneal_engine::Tensor;
use anneal_runtime::plugins::PluginModel;

type Named = Vec<(String, Tensor)>;

/// Splits a model's tensors into trained parameters (leaves that require grad) and buffers
/// (`ParamSpec::trainable == false`: no gradient, no optimizer state; the model's
/// `before_optimizer_step` updates them), each sorted by name.
pub fn split_buffers(model: &PluginModel, all: Named) -> (Named, Named) {
    let buffer_names: std::collections::HashSet<&str> = model
        .spec()
        .params
        .iter()
        .filter(|p| !p.trainable)
        .map(|p| p.name.as_str())
        .collect();
    let (mut buffers, mut named): (Vec<_>, Vec<_>) = all
        .into_iter()
        .partition(|(n, _)| buffer_names.contains(n.as_str()));
    named = named
        .into_iter()
        .map(|(n, p)| (n, p.requires_grad_()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    buffers.sort_by(|a, b| a.0.cmp(&b.0));
    (named, buffers)
}

/// Scales the gradients down to global norm `max_norm` when their norm `norm` (from
/// [`crate::parallel::Placements::grad_norm`]) is finite and above it; `max_norm = 0` turns clipping off.
pub fn clip_grads(
    named: &[(String, Tensor)],
    max_norm: f64,
    norm: f64,
) -> anneal_engine::Result<()> {
    if max_norm > 0.0 && norm > max_norm && norm.is_finite() {
        let scale = (max_norm / (norm + 1e-6)) as f32;
        for (_, p) in named {
            if let Some(g) = p.grad() {
                p.set_grad(Some(g.mul_scalar(scale)?))?;
            }
        }
    }
    Ok(())
}
