//! Muon (Keller Jordan, 2024; "MomentUm Orthogonalized by Newton–Schulz"), with the scaling
//! Moonlight (Liu et al., 2025, "Muon is Scalable for LLM Training") uses to share AdamW's
//! learning rate and weight decay. For a 2-D matrix parameter θ of shape `[A, B]`:
//!
//!   m ← μ·m + (1−μ)·g                         (the momentum, an exponential average)
//!   u = (1−μ)·g + μ·m if Nesterov, else m
//!   O = NS₅(u)                                 (≈ U·Vᵀ of u = U·S·Vᵀ, in `ns_dtype`)
//!   θ ← θ·(1 − lr·λ) − lr·s·O                  s = 0.2·√max(A, B)  (`match_rms_adamw`)
//!                                              s = √max(1, A/B)     (`original`)
//!
//! NS₅ is the quintic Newton–Schulz iteration with the published coefficients
//! (a, b, c) = (3.4445, −4.7750, 2.0315): X ← u / (‖u‖_F + ε) (transposed when A > B, so
//! X·Xᵀ is the smaller Gram matrix), then five times `Y = X·Xᵀ; X ← a·X + (b·Y + c·Y·Y)·X`,
//! in bf16 by default (`ns_dtype = "bfloat16"`: products accumulate in f32, as the reference
//! runs it, after the normalization in f32) or in f32 (`"float32"`: twice the cost, and the
//! update no longer rounds away the last bits of a gradient, so runs whose gradients are summed
//! in another order stay closer). A 3-D stack `[E, A, B]` (a mixture of experts' weights) is
//! orthogonalized matrix by matrix in one batched iteration.
//!
//! Which tensors Muon takes is a rule on rank and name: tensors of a rank in `muon_ranks`
//! (default 2 and 3) unless their name contains one of `exclude` (by default the embeddings,
//! the output head and the routers, as the references do). Everything else (vectors such as
//! norms and biases, excluded matrices) is stepped by AdamW with `adamw_betas` / `adamw_eps`
//! and the same learning rate and decay. With `match_rms_adamw` the update's RMS is about 0.2, AdamW's
//! typical RMS, so one learning rate serves both groups.
//!
//! Orthogonalization needs the whole matrix (`needs_full_matrix`): under FSDP the host steps each
//! parameter whole on one owner rank and hands every rank back its rows.
//!
//! State: `exp_avg` (Muon's momentum for matrices, AdamW's first moment for the rest) and
//! `exp_avg_sq` (AdamW's second moment; the host gives every parameter the same state, so
//! matrices carry one they leave at zero).

use anneal_plugin_api::sdk::{
    AdamWStep, Factory, Host, Init, Optimizer, OptimizerSpec, Result, StateSpec, Tensor,
};
use serde::{Deserialize, Serialize};

/// The quintic Newton–Schulz coefficients of Keller Jordan's Muon (also PyTorch's default):
/// chosen to push every singular value of the normalized matrix toward 1 within five steps.
const NS_COEFFICIENTS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// How the orthogonalized update is scaled for a matrix of shape `[A, B]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdjustLr {
    /// `0.2·√max(A, B)` (Moonlight): the update's RMS matches AdamW's, so Muon takes AdamW's
    /// learning rate and weight decay.
    MatchRmsAdamw,
    /// `√max(1, A/B)` (Keller Jordan's Muon): wants its own, larger learning rate (about 0.02).
    Original,
}

/// Muon hyperparameters (the learning rate comes from the host's schedule each step).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Muon {
    /// μ: decay of the momentum of the matrices.
    pub momentum: f64,
    /// Nesterov momentum: orthogonalize `(1−μ)·g + μ·m` rather than `m`.
    pub nesterov: bool,
    /// Newton–Schulz iterations.
    pub ns_steps: usize,
    /// Added to the Frobenius norm before the first iteration divides by it.
    pub eps: f64,
    /// Decoupled weight decay λ (both groups).
    pub weight_decay: f64,
    /// The shape scale of the update.
    pub adjust_lr: AdjustLr,
    /// (β₁, β₂) of the AdamW group.
    pub adamw_betas: (f64, f64),
    /// ε of the AdamW group.
    pub adamw_eps: f64,
    /// Matrices whose name contains one of these go to the AdamW group.
    pub exclude: Vec<String>,
    /// Ranks of the tensors Muon takes (2: matrices; 3: stacks of matrices, batched).
    pub muon_ranks: Vec<usize>,
    /// The dtype of the Newton–Schulz iterations: `bfloat16` (default) or `float32`.
    pub ns_dtype: String,
}

impl Default for Muon {
    fn default() -> Self {
        Muon {
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            eps: 1e-7,
            weight_decay: 0.1,
            adjust_lr: AdjustLr::MatchRmsAdamw,
            adamw_betas: (0.9, 0.95),
            adamw_eps: 1e-8,
            exclude: vec![
                "embed".into(),
                "output".into(),
                "lm_head".into(),
                "router".into(),
            ],
            muon_ranks: vec![2, 3],
            ns_dtype: "bfloat16".into(),
        }
    }
}

impl Factory for Muon {
    fn flavors() -> Vec<String> {
        vec!["default".into()]
    }

    fn create(flavor: Option<&str>, args: anneal_plugin_api::serde_json::Value) -> Result<Self> {
        if let Some(f) = flavor.filter(|f| *f != "default") {
            return Err(format!("unknown flavor '{f}' (known: default)").into());
        }
        let mut base = anneal_plugin_api::serde_json::to_value(Muon::default())?;
        anneal_plugin_api::sdk::merge_args(&mut base, args);
        let m: Muon = anneal_plugin_api::sdk::from_args(base)?;
        m.validate()?;
        Ok(m)
    }
}

impl Muon {
    /// Refuses values that make the update meaningless, naming the key.
    fn validate(&self) -> Result<()> {
        let (b1, b2) = self.adamw_betas;
        for (name, b) in [
            ("momentum", self.momentum),
            ("adamw_betas[0]", b1),
            ("adamw_betas[1]", b2),
        ] {
            if !(0.0..1.0).contains(&b) {
                return Err(format!("{name} = {b} must be within [0, 1)").into());
            }
        }
        for (name, v) in [
            ("eps", self.eps),
            ("adamw_eps", self.adamw_eps),
            ("weight_decay", self.weight_decay),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(format!("{name} = {v} must be a finite number ≥ 0").into());
            }
        }
        if !(1..=100).contains(&self.ns_steps) {
            return Err(format!("ns_steps = {} must be within 1..=100", self.ns_steps).into());
        }
        if self.exclude.iter().any(String::is_empty) {
            return Err("exclude: an empty pattern would exclude every parameter".into());
        }
        if let Some(r) = self.muon_ranks.iter().find(|r| !(2..=3).contains(*r)) {
            return Err(format!("muon_ranks: {r} is not 2 (matrices) or 3 (stacks)").into());
        }
        if !matches!(self.ns_dtype.as_str(), "bfloat16" | "float32") {
            return Err(
                format!("ns_dtype = '{}' must be bfloat16 or float32", self.ns_dtype).into(),
            );
        }
        Ok(())
    }

    /// Whether `name` of shape `shape` is stepped by Muon (rather than AdamW).
    fn is_muon(&self, name: &str, shape: &[usize]) -> bool {
        self.muon_ranks.contains(&shape.len())
            && !self.exclude.iter().any(|p| name.contains(p.as_str()))
    }

    /// The Muon update of one matrix parameter (see the crate docs).
    fn muon_step<'h>(&self, host: Host<'h>, name: &str, p: &Tensor<'h>, lr: f64) -> Result<()> {
        let shape = p.shape()?;
        let (rows, cols) = (shape[shape.len() - 2] as f64, shape[shape.len() - 1] as f64);
        let g = host.param(&format!("{name}.grad"))?.to_dtype("f32")?;
        let m = host.param(&format!("{name}.exp_avg"))?;
        let mu = self.momentum;
        let m_new = m.scale(mu)?.add(&g.scale(1.0 - mu)?)?;
        m.assign(&m_new)?;
        let u = if self.nesterov {
            g.scale(1.0 - mu)?.add(&m_new.scale(mu)?)?
        } else {
            m_new
        };
        let o = newton_schulz(&u, rows > cols, self.ns_steps, self.eps, &self.ns_dtype)?;
        let s = match self.adjust_lr {
            AdjustLr::MatchRmsAdamw => 0.2 * rows.max(cols).sqrt(),
            AdjustLr::Original => (rows / cols).max(1.0).sqrt(),
        };
        let decayed = p.to_dtype("f32")?.scale(1.0 - lr * self.weight_decay)?;
        p.assign(&decayed.sub(&o.scale(lr * s)?)?)
    }
}

/// NS₅: `u` (a matrix `[A, B]` or a stack `[E, A, B]`) with each matrix's singular values
/// pushed toward 1 (crate docs), iterated in `dtype` after an f32 normalization. `tall` (more
/// rows than columns) works on the transposes so that the Gram matrices `X·Xᵀ` are the smaller.
fn newton_schulz<'h>(
    u: &Tensor<'h>,
    tall: bool,
    steps: usize,
    eps: f64,
    dtype: &str,
) -> Result<Tensor<'h>> {
    let (a, b, c) = NS_COEFFICIENTS;
    let rank = u.shape()?.len() as i64;
    let (r, k) = (rank - 2, rank - 1);
    let x = if tall { u.transpose(r, k)? } else { u.clone() };
    let norm = x.mul(&x)?.sum(&[r, k], true)?.sqrt()?.affine(1.0, eps)?;
    let mut x = x
        .div(&norm)?
        .to_dtype(if dtype == "float32" { "f32" } else { "bf16" })?;
    for _ in 0..steps {
        let gram = x.matmul(&x.transpose(r, k)?)?; // X·Xᵀ
        let poly = gram.scale(b)?.add(&gram.matmul(&gram)?.scale(c)?)?;
        x = x.scale(a)?.add(&poly.matmul(&x)?)?;
    }
    let x = x.to_dtype("f32")?;
    if tall {
        x.transpose(r, k)
    } else {
        Ok(x)
    }
}

impl Optimizer for Muon {
    fn spec(&self) -> OptimizerSpec {
        OptimizerSpec {
            algorithm: "muon".into(),
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
            needs_full_matrix: true,
        }
    }

    fn step(&self, host: Host<'_>, name: &str, step: u64, lr: f64) -> Result<()> {
        self.step_all(host, &[name], step, lr)
    }

    /// Muon for each matrix in turn; everything else in one fused AdamW host op.
    fn step_all(&self, host: Host<'_>, names: &[&str], step: u64, lr: f64) -> Result<()> {
        let mut adamw = Vec::new();
        for name in names {
            let p = host.param(name)?;
            if self.is_muon(name, &p.shape()?) {
                self.muon_step(host, name, &p, lr)?;
            } else {
                adamw.push([
                    p,
                    host.param(&format!("{name}.grad"))?,
                    host.param(&format!("{name}.exp_avg"))?,
                    host.param(&format!("{name}.exp_avg_sq"))?,
                ]);
            }
        }
        if adamw.is_empty() {
            return Ok(());
        }
        let hp = AdamWStep {
            lr,
            betas: self.adamw_betas,
            eps: self.adamw_eps,
            weight_decay: self.weight_decay,
            step,
        };
        host.adamw(&adamw, &hp)
    }
}

anneal_plugin_api::export_plugin!(optimizer Muon, name = "muon", description = "Muon: Newton–Schulz orthogonalized momentum for matrices, AdamW for the rest");

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::serde_json::json;

    #[test]
    fn arguments_out_of_range_are_refused_by_name() {
        for (args, key) in [
            (json!({"momentum": 1.0}), "momentum"),
            (json!({"adamw_betas": [0.9, 1.5]}), "adamw_betas[1]"),
            (json!({"eps": -1.0}), "eps"),
            (json!({"adamw_eps": f64::NAN}), "bad plugin arguments"),
            (json!({"weight_decay": -0.1}), "weight_decay"),
            (json!({"ns_steps": 0}), "ns_steps"),
            (json!({"exclude": ["embed", ""]}), "exclude"),
            (
                json!({"adjust_lr": "sideways"}),
                "bad plugin arguments: adjust_lr",
            ),
            (json!({"nesterov": "yes"}), "bad plugin arguments: nesterov"),
            (json!({"muon_ranks": [1, 2]}), "muon_ranks"),
            (json!({"ns_dtype": "fp8"}), "ns_dtype"),
        ] {
            let e = Muon::create(None, args.clone()).expect_err("refused");
            assert!(e.msg.starts_with(key), "{args}: {e}");
        }
    }

    #[test]
    fn matrices_go_to_muon_unless_excluded() {
        let m = Muon::create(None, json!({})).expect("defaults");
        assert!(m.is_muon("layers.0.attention.wq.weight", &[32, 32]));
        assert!(!m.is_muon("tok_embeddings.weight", &[320, 32]));
        assert!(!m.is_muon("output.weight", &[320, 32]));
        assert!(!m.is_muon("norm.weight", &[32]));
        assert!(m.is_muon("layers.0.feed_forward.experts.w1", &[4, 8, 8]));
        assert!(!m.is_muon("layers.0.feed_forward.router.weight", &[4, 32]));
        let m2 = Muon::create(None, json!({"muon_ranks": [2]})).expect("matrices only");
        assert!(!m2.is_muon("layers.0.feed_forward.experts.w1", &[4, 8, 8]));
        // A list given by the user replaces the default one.
        let m = Muon::create(None, json!({"exclude": ["wq"]})).expect("custom list");
        assert!(m.is_muon("output.weight", &[320, 32]));
        assert!(!m.is_muon("layers.0.attention.wq.weight", &[32, 32]));
        assert!(m.spec().needs_full_matrix);
    }
}
