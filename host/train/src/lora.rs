//! Low-rank adapters (LoRA; Hu et al., 2021): each chosen weight `W` (`[out, in]`) computes
//! with `W + (alpha / rank) · B·A`, `A` `[rank, in]` and `B` `[out, rank]` trained, every base
//! parameter frozen. The model plugin is unchanged: the forward's map of named tensors holds the
//! adapted weight under the base weight's name, so every op that reads the weight (linear or
//! not) reads the adapted one, and autograd carries its gradient to `A` and `B` alone.
//!
//! `A` starts as PEFT draws it (uniform in `±1/sqrt(in)`, Kaiming's bound with `a = sqrt(5)`)
//! and `B` at zero, so step 0 is the base model. Adapters are named `<weight>.lora_A` /
//! `<weight>.lora_B`; a checkpoint holds them (and the model's buffers) only, and the base comes
//! back from where the run took it ([`base_params`]).

use std::collections::HashMap;
use std::sync::Arc;

use anneal_config::{JobConfig, Lora};
use anneal_engine::{DType, Tensor};
use anneal_plugin_api::spec::{HfCombine, ModelSpec};
use anneal_runtime::plugins::{Params, PluginModel};

use crate::TrainError;

/// One adapted weight.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// The base weight's parameter name.
    pub name: String,
    /// Its Hugging Face module (the tensor name without `.weight`), when it maps one to one.
    pub hf_module: Option<String>,
    /// Output features (rows of `W`).
    pub out: usize,
    /// Input features (columns of `W`).
    pub inp: usize,
}

/// The adapters of a run: which weights, their rank and scale.
#[derive(Clone, Debug)]
pub struct Adapters {
    /// The adapted weights, sorted by name.
    pub targets: Vec<Target>,
    /// `r`.
    pub rank: usize,
    /// PEFT's `lora_alpha`.
    pub alpha: f64,
    /// The base weights' dtype (`f32` or `bf16`).
    pub base_dtype: DType,
}

/// The name of `weight`'s `A` matrix.
pub fn a_name(weight: &str) -> String {
    format!("{weight}.lora_A")
}

/// The name of `weight`'s `B` matrix.
pub fn b_name(weight: &str) -> String {
    format!("{weight}.lora_B")
}

/// Whether `name` is an adapter's (`.lora_A` / `.lora_B`).
pub fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_A") || name.ends_with(".lora_B")
}

/// `*` matches any run of characters; everything else matches itself.
fn glob(pattern: &str, s: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == s,
        Some((head, rest)) => {
            let Some(s) = s.strip_prefix(head) else {
                return false;
            };
            (0..=s.len())
                .filter(|&i| s.is_char_boundary(i))
                .any(|i| glob(rest, &s[i..]))
        }
    }
}

/// Whether `target` (a `lora.targets` entry) names `name` (a module or parameter name):
/// a glob when it has a `*`, else the whole name or its last dotted parts.
fn names(target: &str, name: &str) -> bool {
    match target.contains('*') {
        true => glob(target, name),
        false => name == target || name.ends_with(&format!(".{target}")),
    }
}

impl Adapters {
    /// The adapters `cfg` asks for on the model of `spec`: every trainable 2-D parameter that
    /// a target names (by its Hugging Face module or its own name); `None` when LoRA is off.
    /// A target list that names no weight is an error listing what it could name.
    pub fn plan(cfg: &Lora, spec: &ModelSpec) -> Result<Option<Adapters>, TrainError> {
        if cfg.rank == 0 {
            return Ok(None);
        }
        let candidates: Vec<Target> = spec
            .params
            .iter()
            .filter(|p| p.trainable && p.shape.len() == 2)
            .map(|p| Target {
                name: p.name.clone(),
                hf_module: p
                    .hf
                    .as_ref()
                    .and_then(|m| match (&m.combine, &m.sources[..]) {
                        (HfCombine::One, [one]) if m.steps.is_empty() => {
                            one.strip_suffix(".weight").map(str::to_owned)
                        }
                        _ => None,
                    }),
                out: p.shape[0],
                inp: p.shape[1],
            })
            .collect();
        let mut targets: Vec<Target> = candidates
            .iter()
            .filter(|c| {
                cfg.targets.iter().any(|t| {
                    names(t, &c.name) || c.hf_module.as_deref().is_some_and(|m| names(t, m))
                })
            })
            .cloned()
            .collect();
        if targets.is_empty() {
            let some: Vec<String> = candidates
                .iter()
                .take(12)
                .map(|c| match &c.hf_module {
                    Some(m) => format!("{} ({m})", c.name),
                    None => c.name.clone(),
                })
                .collect();
            return Err(TrainError::Config(format!(
                "config: `lora.targets` = {:?} names no weight of this model; its 2-D weights \
                 include {}",
                cfg.targets,
                some.join(", ")
            )));
        }
        targets.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Some(Adapters {
            targets,
            rank: cfg.rank,
            alpha: cfg.alpha,
            base_dtype: match cfg.base_dtype.as_str() {
                "bf16" => DType::BF16,
                _ => DType::F32,
            },
        }))
    }

    /// The update's scale, `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Parameters the adapters train.
    pub fn trainable(&self) -> usize {
        self.targets
            .iter()
            .map(|t| self.rank * (t.inp + t.out))
            .sum()
    }

    /// The adapters at the start of training, sorted by name, on the host: `A` uniform in
    /// `±1/sqrt(in)` from `seed` and the weight's name, `B` zero.
    pub fn init(&self, seed: u64) -> Result<Vec<(String, Tensor)>, TrainError> {
        let mut out = Vec::with_capacity(2 * self.targets.len());
        for t in &self.targets {
            let key = anneal_engine::rng::RngKey::new(seed, &a_name(&t.name));
            let bound = 1.0 / (t.inp as f32).sqrt();
            let a: Vec<f32> = key
                .uniform_vec(0, self.rank * t.inp)
                .into_iter()
                .map(|u| (2.0 * u - 1.0) * bound)
                .collect();
            out.push((a_name(&t.name), Tensor::from_vec(a, &[self.rank, t.inp])?));
            out.push((
                b_name(&t.name),
                Tensor::zeros(&[t.out, self.rank], DType::F32),
            ));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// The base parameters as the run holds them: detached, the weights in `base_dtype`.
    pub fn freeze(
        &self,
        named: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>, TrainError> {
        named
            .into_iter()
            .map(|(n, t)| {
                let t = match t.shape().len() >= 2 && t.dtype() != self.base_dtype {
                    true => t.detach().to_dtype(self.base_dtype)?,
                    false => t.detach(),
                };
                Ok((n, t))
            })
            .collect()
    }

    /// `W + scale · B·A` from `w`, `a` and `b` (on autograd's tape when `a` and `b` are).
    fn adapted(&self, w: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor, TrainError> {
        let delta = b.matmul(a)?.mul_scalar(self.scale() as f32)?;
        let w = match w.dtype() {
            DType::F32 => w.clone(),
            _ => w.to_dtype(DType::F32)?,
        };
        Ok(w.add(&delta)?)
    }

    /// The forward's map: `params` with each adapted weight in place of its base weight.
    pub fn apply(&self, params: &Params) -> Result<Params, TrainError> {
        let mut map = (**params).clone();
        for t in &self.targets {
            let get = |n: &str| {
                params
                    .get(n)
                    .ok_or_else(|| TrainError::Config(format!("lora: no tensor {n}")))
            };
            let w = self.adapted(
                get(&t.name)?,
                get(&a_name(&t.name))?,
                get(&b_name(&t.name))?,
            )?;
            map.insert(t.name.clone(), w);
        }
        Ok(Arc::new(map))
    }

    /// Merges the adapters of `adapters` into `params` (whole base weights, by name, held as
    /// [`Adapters::freeze`] holds them), as the training forward computed them: what an
    /// export writes and a server runs.
    pub fn merge(
        &self,
        params: &mut HashMap<String, Tensor>,
        adapters: &HashMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        for t in &self.targets {
            let get = |n: String| {
                adapters
                    .get(&n)
                    .ok_or_else(|| TrainError::Config(format!("lora: the checkpoint has no {n}")))
            };
            let (a, b) = (get(a_name(&t.name))?, get(b_name(&t.name))?);
            let w = params
                .get(&t.name)
                .ok_or_else(|| TrainError::Config(format!("lora: no base weight {}", t.name)))?;
            let merged = self.adapted(w, &a.to_dtype(DType::F32)?, &b.to_dtype(DType::F32)?)?;
            params.insert(t.name.clone(), merged);
        }
        Ok(())
    }

    /// A line for the user: what is adapted and what trains.
    pub fn summary(&self, base_params: usize) -> String {
        let trainable = self.trainable();
        format!(
            "lora: rank {} (alpha {}) on {} weights; {} trainable parameters ({:.3}% of the \
             {} frozen), the base held in {}",
            self.rank,
            self.alpha,
            self.targets.len(),
            trainable,
            100.0 * trainable as f64 / base_params.max(1) as f64,
            base_params,
            self.base_dtype.name()
        )
    }
}

/// The base model of a LoRA run, as training started from it: the Hugging Face checkpoint of
/// `checkpoint.init_from_hf`, else the plugin's initialisation from `training.seed`; f32.
pub fn base_params(
    cfg: &JobConfig,
    model: &PluginModel,
) -> Result<HashMap<String, Tensor>, TrainError> {
    let params = match &cfg.checkpoint.init_from_hf {
        Some(dir) => anneal_runtime::hf::load_params(std::path::Path::new(dir), model.spec())
            .map_err(|e| {
                TrainError::Config(format!(
                    "lora: the base model (checkpoint.init_from_hf = {dir}): {e}"
                ))
            })?,
        None => model.init_params(cfg.training.seed)?.into_iter().collect(),
    };
    Ok(crate::device::f32_masters(params)?.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_name_modules_by_their_last_parts_or_globs() {
        let m = "model.layers.3.self_attn.q_proj";
        assert!(names("q_proj", m));
        assert!(names("self_attn.q_proj", m));
        assert!(!names("proj", m));
        assert!(!names("k_proj", m));
        assert!(names("model.layers.3.*", m));
        assert!(names("*.q_proj", m));
        assert!(!names("*.layers.4.*", m));
        assert!(glob("a*b*c", "aXXbYc"));
        assert!(!glob("a*b*c", "aXXbY"));
    }

    #[test]
    fn the_adapted_weight_is_the_base_plus_the_scaled_product() {
        let a = Adapters {
            targets: Vec::new(),
            rank: 2,
            alpha: 4.0,
            base_dtype: DType::F32,
        };
        let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        let am = Tensor::from_vec(vec![1.0f32, 0.0, 1.0, 0.0, 1.0, 0.0], &[2, 3]).unwrap();
        let bm = Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 0.5], &[2, 2]).unwrap();
        // B·A = [[1, 0, 1], [0, 0.5, 0]], scaled by 4 / 2.
        let got = a.adapted(&w, &am, &bm).unwrap().to_vec_f32();
        assert_eq!(got, vec![3.0, 2.0, 5.0, 4.0, 6.0, 6.0]);
    }
}
