//! Typed reads of a Hugging Face `config.json`, for plugins that build a model from one: a key
//! that is absent (or `null`) reads as `None`, a key of the wrong type is an error naming the
//! key (with its parent object's name) and what it holds, never a silent default. The RoPE
//! settings, which every architecture reads the same way, have their own reader.

use super::{Llama3Scaling, YarnScaling};

/// A `config.json` object (or a nested object of it).
pub struct HfConfig<'a> {
    obj: &'a serde_json::Value,
    /// `rope_parameters.` inside a nested object, so messages name the full key.
    prefix: String,
}

impl<'a> HfConfig<'a> {
    /// The top-level object of a parsed `config.json`.
    pub fn new(obj: &'a serde_json::Value) -> Self {
        HfConfig {
            obj,
            prefix: String::new(),
        }
    }

    /// The value at `k`, unless absent or `null`.
    pub fn get(&self, k: &str) -> Option<&'a serde_json::Value> {
        self.obj.get(k).filter(|v| !v.is_null())
    }

    fn typed<T>(
        &self,
        k: &str,
        expected: &str,
        read: impl FnOnce(&'a serde_json::Value) -> Option<T>,
    ) -> Result<Option<T>, String> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        read(v).map(Some).ok_or_else(|| {
            format!(
                "config.json: '{}{k}' has the wrong type: expected {expected}, found {}",
                self.prefix,
                json_kind(v)
            )
        })
    }

    /// A non-negative integer.
    pub fn uint(&self, k: &str) -> Result<Option<usize>, String> {
        self.typed(k, "a non-negative integer", |v| {
            v.as_u64().and_then(|n| usize::try_from(n).ok())
        })
    }

    /// A non-negative integer that must be there.
    pub fn need_uint(&self, k: &str) -> Result<usize, String> {
        self.uint(k)?
            .ok_or_else(|| format!("config.json: missing integer '{}{k}'", self.prefix))
    }

    /// A number (an integer reads as one too).
    pub fn float(&self, k: &str) -> Result<Option<f64>, String> {
        self.typed(k, "a number", serde_json::Value::as_f64)
    }

    /// `true` or `false`.
    pub fn bool(&self, k: &str) -> Result<Option<bool>, String> {
        self.typed(k, "true or false", serde_json::Value::as_bool)
    }

    /// A string.
    pub fn str(&self, k: &str) -> Result<Option<&'a str>, String> {
        self.typed(k, "a string", serde_json::Value::as_str)
    }

    /// A list of non-negative integers (layer indices).
    pub fn uint_list(&self, k: &str) -> Result<Option<Vec<usize>>, String> {
        self.typed(k, "a list of non-negative integers", |v| {
            v.as_array()?
                .iter()
                .map(|x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
                .collect()
        })
    }

    /// A list of strings.
    pub fn str_list(&self, k: &str) -> Result<Option<Vec<&'a str>>, String> {
        self.typed(k, "a list of strings", |v| {
            v.as_array()?
                .iter()
                .map(serde_json::Value::as_str)
                .collect()
        })
    }

    /// The value at `k` read through serde (an enum, a list of them), an error naming the key.
    pub fn json<T: serde::de::DeserializeOwned>(&self, k: &str) -> Result<Option<T>, String> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        T::deserialize(v)
            .map(Some)
            .map_err(|e| format!("config.json: '{}{k}': {e}", self.prefix))
    }

    /// The error for a required key `k`, holding a `kind` ("integer", "number"), that is absent.
    pub fn missing(&self, k: &str, kind: &str) -> String {
        format!("config.json: missing {kind} '{}{k}'", self.prefix)
    }

    /// The nested object at `k`, which must be there.
    pub fn object(&self, k: &str) -> Result<HfConfig<'a>, String> {
        let obj = self
            .typed(k, "an object", |v| v.is_object().then_some(v))?
            .ok_or_else(|| format!("config.json: missing object '{}{k}'", self.prefix))?;
        Ok(HfConfig {
            obj,
            prefix: format!("{}{k}.", self.prefix),
        })
    }

    /// The RoPE settings, from `rope_parameters` (transformers 5) or `rope_theta` +
    /// `rope_scaling` (earlier), with `default_theta` when no base is given. Rope types other
    /// than `default`, `llama3` and `yarn` are refused by name.
    pub fn rope(&self, default_theta: f64) -> Result<HfRope, String> {
        let rope = match ["rope_parameters", "rope_scaling"]
            .into_iter()
            .find(|k| self.get(k).is_some())
        {
            Some(k) => Some(self.object(k)?),
            None => None,
        };
        let theta = match (self.float("rope_theta")?, &rope) {
            (Some(t), _) => t,
            (None, Some(r)) => r.float("rope_theta")?.unwrap_or(default_theta),
            (None, None) => default_theta,
        };
        let mut out = HfRope {
            theta,
            llama3: None,
            yarn: None,
        };
        let Some(r) = rope else {
            return Ok(out);
        };
        let rope_type = match r.str("rope_type")? {
            Some(t) => t,
            None => r.str("type")?.unwrap_or("default"),
        };
        let need = |k: &str| {
            r.float(k)?
                .ok_or_else(|| format!("config.json: rope parameter '{}{k}' missing", r.prefix))
        };
        let original = || r.need_uint("original_max_position_embeddings");
        match rope_type {
            "default" => {}
            "llama3" => {
                out.llama3 = Some(Llama3Scaling {
                    factor: need("factor")?,
                    low_freq_factor: need("low_freq_factor")?,
                    high_freq_factor: need("high_freq_factor")?,
                    original_max_position_embeddings: original()?,
                })
            }
            "yarn" => {
                let original = original()?;
                // Without a factor, transformers takes the ratio of the two context lengths.
                let factor = match r.float("factor")? {
                    Some(f) => f,
                    None => self.need_uint("max_position_embeddings")? as f64 / original as f64,
                };
                out.yarn = Some(YarnScaling {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: r.float("beta_fast")?.unwrap_or(32.0),
                    beta_slow: r.float("beta_slow")?.unwrap_or(1.0),
                    truncate: r.bool("truncate")?.unwrap_or(true),
                    attention_factor: r.float("attention_factor")?,
                    mscale: r.float("mscale")?,
                    mscale_all_dim: r.float("mscale_all_dim")?,
                })
            }
            other => {
                return Err(format!(
                    "config.json: rope type '{other}' is not supported (default, llama3, yarn)"
                ))
            }
        }
        Ok(out)
    }
}

/// The RoPE settings of a `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct HfRope {
    /// The base of the frequencies.
    pub theta: f64,
    /// Llama 3 scaling, for `rope_type = "llama3"`.
    pub llama3: Option<Llama3Scaling>,
    /// YaRN scaling, for `rope_type = "yarn"`.
    pub yarn: Option<YarnScaling>,
}

impl HfRope {
    /// Checks the numbers are usable (finite, positive) and at most one scaling is set, naming
    /// what is not.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.theta > 0.0 && self.theta.is_finite()) {
            return Err(format!(
                "rope_theta = {} must be a finite number > 0",
                self.theta
            ));
        }
        if let Some(s) = &self.llama3 {
            let factors = [s.factor, s.low_freq_factor, s.high_freq_factor];
            if factors.iter().any(|f| !(*f > 0.0 && f.is_finite()))
                || s.original_max_position_embeddings == 0
            {
                return Err("rope_scaling: factor, low_freq_factor and high_freq_factor must be finite numbers > 0, original_max_position_embeddings at least 1".into());
            }
            if self.yarn.is_some() {
                return Err("rope_scaling (llama3) and yarn are exclusive".into());
            }
        }
        if let Some(y) = &self.yarn {
            let betas = [y.factor, y.beta_fast, y.beta_slow];
            if betas.iter().any(|f| !(*f > 0.0 && f.is_finite()))
                || y.original_max_position_embeddings == 0
            {
                return Err("rope yarn: factor, beta_fast and beta_slow must be finite numbers > 0, original_max_position_embeddings at least 1".into());
            }
        }
        Ok(())
    }

    /// The `rope_parameters` object transformers 5 writes for these settings.
    pub fn to_hf(&self) -> serde_json::Value {
        let mut r = serde_json::json!({ "rope_type": "default", "rope_theta": self.theta });
        if let Some(s) = &self.llama3 {
            r = serde_json::json!({
                "rope_type": "llama3",
                "rope_theta": self.theta,
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
        }
        if let Some(y) = &self.yarn {
            r = serde_json::json!({
                "rope_type": "yarn",
                "rope_theta": self.theta,
                "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position_embeddings,
                "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow,
                "truncate": y.truncate,
            });
            for (k, v) in [
                ("attention_factor", y.attention_factor),
                ("mscale", y.mscale),
                ("mscale_all_dim", y.mscale_all_dim),
            ] {
                if let Some(v) = v {
                    r[k] = v.into();
                }
            }
        }
        r
    }
}

/// What a JSON value is, for messages (never the value itself, which may be large).
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(n) if n.is_f64() => "a fractional number",
        serde_json::Value::Number(n) if n.is_i64() && n.as_i64().is_some_and(|x| x < 0) => {
            "a negative integer"
        }
        serde_json::Value::Number(_) => "an integer",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rope_reads_every_type_and_names_bad_keys() {
        let c = json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0,
            "factor": 32.0, "original_max_position_embeddings": 4096, "truncate": false}});
        let r = HfConfig::new(&c).rope(10_000.0).unwrap();
        assert_eq!(r.theta, 150000.0);
        let y = r.yarn.clone().unwrap();
        assert_eq!((y.factor, y.beta_fast, y.truncate), (32.0, 32.0, false));
        assert_eq!(r.to_hf()["truncate"], false);
        let back = json!({ "rope_parameters": r.to_hf() });
        assert_eq!(HfConfig::new(&back).rope(1.0).unwrap(), r);
        let c = json!({"rope_theta": 5e5});
        let r = HfConfig::new(&c).rope(10_000.0).unwrap();
        assert_eq!(
            (r.theta, r.llama3.is_none(), r.yarn.is_none()),
            (5e5, true, true)
        );
        let c = json!({"rope_scaling": {"rope_type": "yarn", "factor": "4",
            "original_max_position_embeddings": 4096}});
        let e = HfConfig::new(&c).rope(1.0).unwrap_err();
        assert!(
            e.contains("'rope_scaling.factor' has the wrong type"),
            "{e}"
        );
        let c = json!({"rope_scaling": {"rope_type": "longrope"}});
        let e = HfConfig::new(&c).rope(1.0).unwrap_err();
        assert!(e.contains("'longrope' is not supported"), "{e}");
        let c = json!({"layer_types": ["full_attention", 3]});
        let e = HfConfig::new(&c).str_list("layer_types").unwrap_err();
        assert!(e.contains("'layer_types' has the wrong type"), "{e}");
    }
}
