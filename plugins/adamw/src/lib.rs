//! AdamW (Loshchilov & Hutter): Adam's moment estimates with weight decay applied to the
//! parameter directly rather than through the gradient.
//!
//!   m ← β₁·m + (1−β₁)·g            v ← β₂·v + (1−β₂)·g²
//!   m̂ = m / (1−β₁ᵗ)               v̂ = v / (1−β₂ᵗ)
//!   θ ← θ·(1 − lr·λ) − lr · m̂ / (√v̂ + ε)
//!
//! The host's fused `adamw` op computes this for every parameter in one pass.

use anneal_plugin_api::sdk::{
    AdamWStep, Factory, Host, Init, Optimizer, OptimizerSpec, Result, StateSpec,
};
use serde::{Deserialize, Serialize};

/// AdamW hyperparameters (the learning rate comes from the host's schedule each step).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamW {
    /// (β₁, β₂): decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl Factory for AdamW {
    fn flavors() -> Vec<String> {
        vec!["default".into()]
    }

    fn create(flavor: Option<&str>, args: anneal_plugin_api::serde_json::Value) -> Result<Self> {
        if let Some(f) = flavor.filter(|f| *f != "default") {
            return Err(format!("unknown flavor '{f}' (known: default)").into());
        }
        let mut base = anneal_plugin_api::serde_json::to_value(AdamW::default())?;
        anneal_plugin_api::sdk::merge_args(&mut base, args);
        let a: AdamW = anneal_plugin_api::sdk::from_args(base)?;
        a.validate()?;
        Ok(a)
    }
}

impl AdamW {
    /// Refuses values that make the update meaningless: a moment decay outside `[0, 1)` never
    /// forgets (or grows), a negative `eps` can divide by zero, a negative decay grows weights.
    fn validate(&self) -> Result<()> {
        let (b1, b2) = self.betas;
        for (name, b) in [("betas[0]", b1), ("betas[1]", b2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(format!("{name} = {b} must be within [0, 1)").into());
            }
        }
        if !(self.eps >= 0.0 && self.eps.is_finite()) {
            return Err(format!("eps = {} must be a finite number ≥ 0", self.eps).into());
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return Err(format!(
                "weight_decay = {} must be a finite number ≥ 0",
                self.weight_decay
            )
            .into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::serde_json::json;

    #[test]
    fn arguments_out_of_range_are_refused_by_name() {
        for (args, key) in [
            (json!({"eps": -1e-8}), "eps"),
            (json!({"betas": [1.0, 0.9]}), "betas[0]"),
            (json!({"betas": [0.9, -0.1]}), "betas[1]"),
            (json!({"weight_decay": -0.1}), "weight_decay"),
        ] {
            let e = AdamW::create(None, args.clone()).expect_err("refused");
            assert!(e.msg.starts_with(key), "{args}: {e}");
        }
        assert!(AdamW::create(None, json!({"betas": [0.0, 0.999], "eps": 0.0})).is_ok());
    }
}

impl Optimizer for AdamW {
    fn spec(&self) -> OptimizerSpec {
        OptimizerSpec {
            algorithm: "adamw".into(),
            state: vec![
                StateSpec {
                    name: "exp_avg".into(),
                    init: Init::Zeros,
                },
                StateSpec {
                    name: "exp_avg_sq".into(),
                    init: Init::Zeros,
                },
            ],
            needs_full_matrix: false,
        }
    }

    fn step(&self, host: Host<'_>, name: &str, step: u64, lr: f64) -> Result<()> {
        self.step_all(host, &[name], step, lr)
    }

    /// Every parameter in one fused host op: one pass over memory, no temporaries.
    fn step_all(&self, host: Host<'_>, names: &[&str], step: u64, lr: f64) -> Result<()> {
        let tensors = names
            .iter()
            .map(|name| {
                Ok([
                    host.param(name)?,
                    host.param(&format!("{name}.grad"))?,
                    host.param(&format!("{name}.exp_avg"))?,
                    host.param(&format!("{name}.exp_avg_sq"))?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let hp = AdamWStep {
            lr,
            betas: self.betas,
            eps: self.eps,
            weight_decay: self.weight_decay,
            step,
        };
        host.adamw(&tensors, &hp)
    }
}

anneal_plugin_api::export_plugin!(optimizer AdamW, name = "adamw", description = "AdamW: decoupled weight decay, bias correction, fp32 state");
