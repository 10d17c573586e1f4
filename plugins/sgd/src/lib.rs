//! SGD with momentum (PyTorch's formulation):
//!
//!   g ← g + λ·θ                      (coupled weight decay)
//!   b ← μ·b + (1−τ)·g                (b = g on the first step)
//!   d = g + μ·b if Nesterov, else b
//!   θ ← θ − lr·d

use anneal_plugin_api::sdk::{Factory, Host, Init, Optimizer, OptimizerSpec, Result, StateSpec};
use serde::{Deserialize, Serialize};

/// SGD hyperparameters.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sgd {
    /// μ, the momentum factor (0 disables momentum).
    pub momentum: f64,
    /// τ, the dampening of new gradients in the buffer.
    pub dampening: f64,
    /// λ, coupled weight decay.
    pub weight_decay: f64,
    /// Use Nesterov momentum.
    pub nesterov: bool,
}

impl Default for Sgd {
    fn default() -> Self {
        Sgd {
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl Factory for Sgd {
    fn flavors() -> Vec<String> {
        vec!["default".into()]
    }

    fn create(flavor: Option<&str>, args: anneal_plugin_api::serde_json::Value) -> Result<Self> {
        if let Some(f) = flavor.filter(|f| *f != "default") {
            return Err(format!("unknown flavor '{f}' (known: default)").into());
        }
        let mut base = anneal_plugin_api::serde_json::to_value(Sgd::default())?;
        anneal_plugin_api::sdk::merge_args(&mut base, args);
        let s: Sgd = anneal_plugin_api::sdk::from_args(base)?;
        // Momentum 1 or more never forgets a gradient (the buffer grows without bound).
        if !(0.0..1.0).contains(&s.momentum) {
            return Err(format!("momentum = {} must be within [0, 1)", s.momentum).into());
        }
        if !(0.0..=1.0).contains(&s.dampening) {
            return Err(format!("dampening = {} must be within [0, 1]", s.dampening).into());
        }
        if !(s.weight_decay >= 0.0 && s.weight_decay.is_finite()) {
            return Err(format!(
                "weight_decay = {} must be a finite number ≥ 0",
                s.weight_decay
            )
            .into());
        }
        if s.nesterov && (s.momentum <= 0.0 || s.dampening != 0.0) {
            return Err("nesterov needs momentum > 0 and dampening = 0".into());
        }
        Ok(s)
    }
}

impl Optimizer for Sgd {
    fn spec(&self) -> OptimizerSpec {
        OptimizerSpec {
            algorithm: "sgd".into(),
            state: vec![StateSpec {
                name: "momentum_buffer".into(),
                init: Init::Zeros,
            }],
            needs_full_matrix: false,
        }
    }

    fn step(&self, host: Host<'_>, name: &str, step: u64, lr: f64) -> Result<()> {
        let p = host.param(name)?;
        let mut g = host.param(&format!("{name}.grad"))?;
        if self.weight_decay != 0.0 {
            g = g.add(&p.scale(self.weight_decay)?)?;
        }
        if self.momentum != 0.0 {
            let buf = host.param(&format!("{name}.momentum_buffer"))?;
            let new_buf = if step <= 1 {
                g.scale(1.0)?
            } else {
                buf.scale(self.momentum)?
                    .add(&g.scale(1.0 - self.dampening)?)?
            };
            buf.assign(&new_buf)?;
            g = if self.nesterov {
                g.add(&new_buf.scale(self.momentum)?)?
            } else {
                new_buf
            };
        }
        p.assign(&p.sub(&g.scale(lr)?)?)
    }
}

anneal_plugin_api::export_plugin!(optimizer Sgd, name = "sgd", description = "SGD with momentum (optional Nesterov, coupled weight decay)");

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::serde_json::json;

    #[test]
    fn arguments_out_of_range_are_refused_by_name() {
        for (args, key) in [
            (json!({"momentum": 1.0}), "momentum"),
            (json!({"dampening": -0.5}), "dampening"),
            (json!({"weight_decay": -1.0}), "weight_decay"),
            (
                json!({"momentum": "high"}),
                "bad plugin arguments: momentum",
            ),
        ] {
            let e = Sgd::create(None, args.clone()).expect_err("refused");
            assert!(e.msg.starts_with(key), "{args}: {e}");
        }
    }
}
