//! The fine-tuning sections of a job: `[lora]` (low-rank adapters on a frozen model) and
//! `[preference]` (DPO and SimPO on pairs of completions).

use serde::{Deserialize, Serialize};

/// `[preference]`: tuning on `{prompt, chosen, rejected}` pairs (`data.format =
/// "preference"`) instead of next-token prediction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Preference {
    /// `none` (off), `dpo` (against the frozen starting model) or `simpo` (length-normalized,
    /// no reference).
    pub loss: PreferenceLoss,
    /// The margin's scale `β` (DPO's usual 0.1; SimPO's 2.0 or so).
    pub beta: f64,
    /// SimPO's target margin `γ` (unused by DPO).
    pub gamma: f64,
}

/// `preference.loss`
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PreferenceLoss {
    /// No preference tuning.
    None,
    /// Direct preference optimization (Rafailov et al., 2023).
    Dpo,
    /// Simple preference optimization (Meng et al., 2024).
    Simpo,
}

impl Preference {
    /// Whether the section is at its defaults (off).
    pub fn is_off(&self) -> bool {
        *self == Preference::default()
    }

    /// Whether a preference loss is on.
    pub fn on(&self) -> bool {
        self.loss != PreferenceLoss::None
    }
}

impl Default for Preference {
    fn default() -> Self {
        Preference {
            loss: PreferenceLoss::None,
            beta: 0.1,
            gamma: 0.5,
        }
    }
}

/// `[lora]`: low-rank adapters on chosen weights. Each adapted weight `W` (`[out, in]`)
/// computes with `W + (alpha / rank) · B·A`, `A` `[rank, in]` drawn as PEFT draws it and `B`
/// `[out, rank]` zero, so training starts from the base model; every base parameter is frozen
/// and only the adapters reach the optimizer and the checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Lora {
    /// The adapters' rank; 0 turns LoRA off (every parameter trains).
    pub rank: usize,
    /// PEFT's `lora_alpha`: the update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// The weights that get adapters, as PEFT's `target_modules`: a name matches the module
    /// of a weight's Hugging Face name or its last part (`q_proj` matches every
    /// `model.layers.N.self_attn.q_proj`), or, with `*`, a glob over the parameter names
    /// (`layers.0.*`).
    pub targets: Vec<String>,
    /// How the frozen base weights are held: `f32`, or `bf16` for half the memory.
    pub base_dtype: String,
}

impl Lora {
    /// Whether the section is at its defaults (LoRA off).
    pub fn is_off(&self) -> bool {
        *self == Lora::default()
    }
}

impl Default for Lora {
    fn default() -> Self {
        Lora {
            rank: 0,
            alpha: 16.0,
            targets: vec!["q_proj".into(), "v_proj".into()],
            base_dtype: "f32".into(),
        }
    }
}
