//! The runtime side of `#[derive(ModelArgs)]`: typed fields of `config.json` and the trait the
//! derive implements.

use crate::sdk::{HfConfig, HfRope};
use serde_json::{Map, Value};

/// A model-args struct that knows its `config.json` keys (derive it: `#[derive(ModelArgs)]`).
pub trait ModelArgs: Sized {
    /// The fields declared with a `config.json` key (or a default), read from `f`; the
    /// plugin's reader then sets what depends on the model type.
    fn from_hf(f: &HfConfig<'_>) -> Result<Self, String>;
    /// Writes the fields declared with a key into `out` (the rest of `config.json`, such as
    /// `model_type`, is the plugin's).
    fn write_hf(&self, out: &mut Map<String, Value>);
    /// The per-field checks, each failure naming `prefix` + the field (and its
    /// `config.json` key).
    fn check_at(&self, prefix: &str) -> Result<(), String>;
    /// The RoPE settings of the fields declared `rope = ..` (`None`: no RoPE).
    fn hf_rope(&self) -> Option<HfRope> {
        None
    }

    /// The per-field checks from the top.
    fn check(&self) -> Result<(), String> {
        self.check_at("")
    }

    /// The fields declared with a key, as a `config.json` object.
    fn to_hf(&self) -> Map<String, Value> {
        let mut out = Map::new();
        self.write_hf(&mut out);
        out
    }
}

/// A field type `config.json` holds directly.
pub trait HfField: Sized {
    /// What the key holds, for the message when it is missing ("integer", "number").
    const KIND: &'static str;
    /// The value at `key` (`None`: absent); a value of the wrong type is an error naming it.
    fn read(f: &HfConfig<'_>, key: &str) -> Result<Option<Self>, String>;
    /// What an absent key without a default reads as (`None`: it is required).
    fn absent() -> Option<Self> {
        None
    }
    /// The value to write (`None`: leave the key out).
    fn to_json(&self) -> Option<Value>;
}

impl HfField for usize {
    const KIND: &'static str = "integer";
    fn read(f: &HfConfig<'_>, key: &str) -> Result<Option<Self>, String> {
        f.uint(key)
    }
    fn to_json(&self) -> Option<Value> {
        Some((*self).into())
    }
}

impl HfField for f64 {
    const KIND: &'static str = "number";
    fn read(f: &HfConfig<'_>, key: &str) -> Result<Option<Self>, String> {
        f.float(key)
    }
    fn to_json(&self) -> Option<Value> {
        Some((*self).into())
    }
}

impl HfField for bool {
    const KIND: &'static str = "boolean";
    fn read(f: &HfConfig<'_>, key: &str) -> Result<Option<Self>, String> {
        f.bool(key)
    }
    fn to_json(&self) -> Option<Value> {
        Some((*self).into())
    }
}

impl HfField for String {
    const KIND: &'static str = "string";
    fn read(f: &HfConfig<'_>, key: &str) -> Result<Option<Self>, String> {
        Ok(f.str(key)?.map(str::to_string))
    }
    fn to_json(&self) -> Option<Value> {
        Some(self.as_str().into())
    }
}

impl HfField for Vec<usize> {
    const KIND: &'static str = "list of integers";
    fn read(f: &HfConfig<'_>, key: &str) -> Result<Option<Self>, String> {
        f.uint_list(key)
    }
    fn to_json(&self) -> Option<Value> {
        Some(self.clone().into())
    }
}

impl HfField for Vec<String> {
    const KIND: &'static str = "list of strings";
    fn read(f: &HfConfig<'_>, key: &str) -> Result<Option<Self>, String> {
        Ok(f.str_list(key)?
            .map(|l| l.into_iter().map(str::to_string).collect()))
    }
    fn to_json(&self) -> Option<Value> {
        Some(self.clone().into())
    }
}

impl<T: HfField> HfField for Option<T> {
    const KIND: &'static str = T::KIND;
    fn read(f: &HfConfig<'_>, key: &str) -> Result<Option<Self>, String> {
        Ok(T::read(f, key)?.map(Some))
    }
    fn absent() -> Option<Self> {
        Some(None)
    }
    fn to_json(&self) -> Option<Value> {
        self.as_ref().and_then(T::to_json)
    }
}

/// Writes RoPE settings as transformers reads them: `rope_theta`, and `rope_scaling` (with its
/// `rope_type`) when the frequencies are scaled.
pub fn write_rope(r: &HfRope, out: &mut Map<String, Value>) {
    out.insert("rope_theta".into(), r.theta.into());
    if r.llama3.is_some() || r.yarn.is_some() {
        out.insert("rope_scaling".into(), r.to_hf());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sdk::YarnScaling;
    use serde::{Deserialize, Serialize};
    use serde_json::json;

    #[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Kind {
        Full,
        Sliding,
    }

    #[derive(Debug, PartialEq, crate::sdk::kit::ModelArgs)]
    struct Experts {
        #[arg(hf = "num_experts", min = 1)]
        n: usize,
        #[arg(hf = "router_aux_loss_coef", default = 0.0, non_negative)]
        coef: f64,
    }

    #[derive(Debug, PartialEq, crate::sdk::kit::ModelArgs)]
    struct Tiny {
        #[arg(hf = "hidden_size", min = 1, even)]
        dim: usize,
        #[arg(hf = "num_attention_heads", min = 1)]
        n_heads: usize,
        #[arg(hf = "num_key_value_heads", default = n_heads)]
        n_kv_heads: usize,
        #[arg(hf = "head_dim")]
        head_dim: Option<usize>,
        #[arg(hf = "rms_norm_eps", default = 1e-6, non_negative)]
        norm_eps: f64,
        #[arg(rope = theta, default = 1e6)]
        rope_theta: f64,
        #[arg(rope = yarn)]
        yarn: Option<YarnScaling>,
        #[arg(hf = "layer_types", json, default = vec![])]
        layer_types: Vec<Kind>,
        #[arg(default = "f32".into(), one_of("f32", "bf16"))]
        dtype: String,
        #[arg(nested)]
        moe: Option<Experts>,
        #[arg(nested)]
        always: Experts,
    }

    fn config() -> Value {
        json!({"hidden_size": 8, "num_attention_heads": 2, "num_experts": 4,
               "layer_types": ["full", "sliding"]})
    }

    #[test]
    fn one_declaration_reads_writes_and_checks() {
        let c = config();
        let mut t = Tiny::from_hf(&HfConfig::new(&c)).unwrap();
        assert_eq!((t.dim, t.n_kv_heads, t.head_dim), (8, 2, None));
        assert_eq!(
            (t.norm_eps, t.rope_theta, t.yarn.is_none()),
            (1e-6, 1e6, true)
        );
        assert_eq!(t.layer_types, [Kind::Full, Kind::Sliding]);
        assert_eq!(
            (t.dtype.as_str(), t.moe.is_none(), t.always.n),
            ("f32", true, 4)
        );
        t.check().unwrap();
        t.moe = Some(Experts { n: 2, coef: 0.5 });
        let out = Value::Object(t.to_hf());
        assert_eq!(out["num_key_value_heads"], 2);
        assert_eq!(out["layer_types"], json!(["full", "sliding"]));
        assert_eq!(out["rope_theta"], 1e6);
        assert!(out.get("head_dim").is_none() && out.get("dtype").is_none());
        // The nested struct that is set wins over the one always there: both write.
        assert!(out["num_experts"] == 2 || out["num_experts"] == 4);
        let back = Tiny::from_hf(&HfConfig::new(&out)).unwrap();
        assert_eq!((back.dim, back.layer_types.len()), (8, 2));
    }

    #[test]
    fn failures_name_the_field_and_its_key() {
        let mut c = config();
        c["hidden_size"] = json!(6.5);
        let e = Tiny::from_hf(&HfConfig::new(&c)).unwrap_err();
        assert!(e.contains("'hidden_size' has the wrong type"), "{e}");
        let mut c = config();
        c.as_object_mut().unwrap().remove("num_attention_heads");
        let e = Tiny::from_hf(&HfConfig::new(&c)).unwrap_err();
        assert!(e.contains("missing integer 'num_attention_heads'"), "{e}");
        let mut c = config();
        c["layer_types"] = json!(["dense"]);
        let e = Tiny::from_hf(&HfConfig::new(&c)).unwrap_err();
        assert!(e.contains("'layer_types'") && e.contains("dense"), "{e}");
        let c = config();
        let ok = Tiny::from_hf(&HfConfig::new(&c)).unwrap();
        for (t, want) in [
            (
                Tiny {
                    dim: 0,
                    ..clone(&ok)
                },
                "dim must be at least 1 (hidden_size in config.json)",
            ),
            (
                Tiny {
                    dim: 7,
                    ..clone(&ok)
                },
                "dim (7) must be even",
            ),
            (
                Tiny {
                    norm_eps: -1.0,
                    ..clone(&ok)
                },
                "norm_eps = -1 must be a finite number ≥ 0",
            ),
            (
                Tiny {
                    rope_theta: 0.0,
                    ..clone(&ok)
                },
                "rope_theta",
            ),
            (
                Tiny {
                    dtype: "f16".into(),
                    ..clone(&ok)
                },
                "dtype must be one of f32, bf16, got 'f16'",
            ),
            (
                Tiny {
                    moe: Some(Experts { n: 0, coef: 0.0 }),
                    ..clone(&ok)
                },
                "moe.n must be at least 1 (num_experts in config.json)",
            ),
            (
                Tiny {
                    always: Experts {
                        n: 1,
                        coef: f64::NAN,
                    },
                    ..clone(&ok)
                },
                "always.coef = NaN must be a finite number ≥ 0",
            ),
        ] {
            let e = t.check().unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    fn clone(t: &Tiny) -> Tiny {
        let c = Value::Object(t.to_hf());
        let mut back = Tiny::from_hf(&HfConfig::new(&c)).unwrap();
        back.dtype = t.dtype.clone();
        back.moe = None;
        back
    }
}
