//! What a plan needs to know of a mixture-of-experts model, read from its spec: which blocks
//! route their tokens to experts, how many experts and how many a token goes to, and which
//! statistics each MoE layer reports (the SDK's `MoeFfnOutput::report`).

use anneal_plugin_api::spec::ModelSpec;

/// The mixture of experts of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    /// The blocks with experts.
    pub layers: Vec<usize>,
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// A layer reports its tokens per expert and its balancing bias (aux-loss-free balancing:
    /// the spec declares a `balance_bias` buffer).
    pub balance_bias: bool,
    /// The layers add a load-balancing loss.
    pub aux_loss: bool,
}

impl Moe {
    /// The mixture of experts of `spec`, `None` for a dense model. The experts per token come
    /// from the active parameters (`active = all − (E − k)/E · experts'`); without them every
    /// expert is taken as active. The load-balancing loss is taken as on unless the Hugging
    /// Face config sets `router_aux_loss_coef` to 0.
    pub fn of(spec: &ModelSpec) -> Option<Moe> {
        let stacks: Vec<_> = spec
            .params
            .iter()
            .filter(|p| p.trainable && p.placement.expert_dim.is_some())
            .collect();
        let first = stacks.first()?;
        let experts = first
            .placement
            .expert_dim
            .and_then(|d| first.shape.get(d).copied())
            .unwrap_or(1)
            .max(1);
        let mut layers: Vec<usize> = stacks.iter().filter_map(|p| p.layer).collect();
        layers.dedup();
        let numel = |s: &[usize]| s.iter().map(|&d| d as u64).product::<u64>();
        let total: u64 = spec.params.iter().map(|p| numel(&p.shape)).sum();
        let expert_total: u64 = stacks.iter().map(|p| numel(&p.shape)).sum();
        let top_k = match spec.active_params {
            Some(active) if expert_total > 0 => {
                let idle = total.saturating_sub(active as u64) as f64;
                let active_share = 1.0 - idle / expert_total as f64;
                ((active_share * experts as f64).round() as usize).clamp(1, experts)
            }
            _ => experts,
        };
        let balance_bias = spec
            .params
            .iter()
            .any(|p| !p.trainable && p.layer.is_some() && p.name.ends_with("balance_bias"));
        let aux_loss = spec
            .hf
            .as_ref()
            .and_then(|h| h.config.get("router_aux_loss_coef"))
            .and_then(|c| c.as_f64())
            .is_none_or(|c| c != 0.0);
        Some(Moe {
            layers,
            experts,
            top_k,
            balance_bias,
            aux_loss,
        })
    }

    /// MoE layers among `blocks`.
    pub fn layers_in(&self, blocks: &std::ops::Range<usize>) -> u64 {
        self.layers.iter().filter(|l| blocks.contains(l)).count() as u64
    }

    /// The f32 a step's outputs carry for `layers` MoE layers (`StepOutputs::reduce_across`):
    /// each statistic once as a tensor and once in the named sums (imbalance and entropy per
    /// layer; tokens per expert and the bias with a balancing bias), and the load-balancing
    /// loss's sum once.
    pub fn output_floats(&self, layers: u64) -> u64 {
        if layers == 0 {
            return 0;
        }
        let per_layer = 2 + if self.balance_bias {
            2 * self.experts as u64
        } else {
            0
        };
        2 * layers * per_layer + u64::from(self.aux_loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::spec::{Init, ParamSpec, Placement};

    fn param(name: &str, shape: &[usize], layer: Option<usize>, expert: bool) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: "float32".into(),
            init: Init::Zeros,
            placement: Placement {
                expert_dim: expert.then_some(0),
                ..Placement::default()
            },
            layer,
            hf: None,
            trainable: true,
        }
    }

    fn spec(params: Vec<ParamSpec>, active: Option<usize>) -> ModelSpec {
        ModelSpec {
            architecture: "test".into(),
            n_layers: 2,
            vocab_size: 16,
            max_seq_len: 8,
            flops_per_token: 0.0,
            context_flops_per_token: 0.0,
            active_params: active,
            params,
            kv_cache: vec![],
            hf: None,
            parallel: Default::default(),
        }
    }

    #[test]
    fn experts_per_token_come_from_the_active_parameters() {
        // 8 experts of 4x4 in layer 1 only, a dense 4x4 in each layer: 2 of 8 active.
        let params = vec![
            param("l0.w", &[4, 4], Some(0), false),
            param("l1.w", &[4, 4], Some(1), false),
            param("l1.experts", &[8, 4, 4], Some(1), true),
        ];
        let active = 2 * 16 + 2 * 16;
        let moe = Moe::of(&spec(params.clone(), Some(active))).expect("a MoE");
        assert_eq!(
            (moe.layers.clone(), moe.experts, moe.top_k),
            (vec![1], 8, 2)
        );
        assert!(moe.aux_loss && !moe.balance_bias);
        // Imbalance and entropy twice (tensor and sum) per layer, one loss.
        assert_eq!(moe.output_floats(1), 5);
        assert_eq!(moe.output_floats(0), 0);
        // Without active parameters every expert is taken as routed to.
        assert_eq!(Moe::of(&spec(params, None)).map(|m| m.top_k), Some(8));
        assert_eq!(
            Moe::of(&spec(vec![param("w", &[4, 4], Some(0), false)], None)),
            None
        );
    }
}
