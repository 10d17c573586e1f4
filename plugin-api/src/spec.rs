//! What a plugin declares, as plain serde types (sent across the boundary as JSON).

use serde::{Deserialize, Serialize};

/// How a parameter is initialized (values come from the host's counter-based RNG, keyed by the
/// parameter's name, so they do not depend on sharding or thread count).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones (norm weights).
    Ones,
    /// Normal with mean 0.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// Normal with mean 0, resampled into `[a, b]` (like `trunc_normal_`).
    TruncNormal {
        /// Standard deviation.
        std: f64,
        /// Lower bound.
        a: f64,
        /// Upper bound.
        b: f64,
    },
    /// Uniform in `[lo, hi)`.
    Uniform {
        /// Lower bound.
        lo: f64,
        /// Upper bound.
        hi: f64,
    },
}

/// How tensor parallelism splits a weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorParallel {
    /// Split the output features (the first dim of a `[out, in]` weight; of stacked experts'
    /// `[expert, out, in]`, the second).
    Column,
    /// Split the input features (the last dim).
    Row,
    /// Split the vocabulary (embedding tables).
    Vocab,
}

/// Placement hints: the plugin says how a parameter may be split; the host decides.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Tensor-parallel split, if any.
    #[serde(default)]
    pub tensor_parallel: Option<TensorParallel>,
    /// The dim that indexes experts (MoE weights), if any.
    #[serde(default)]
    pub expert_dim: Option<usize>,
    /// Whether FSDP may shard it (false for tiny tensors kept replicated).
    #[serde(default = "yes")]
    pub fsdp: bool,
    /// A weight shared by every attention head and applied to each head apart (Qwen3's
    /// per-head q/k norms): kept whole under tensor parallelism, where each rank applies it to
    /// its share of the heads, so each rank's gradient is a partial sum the host adds up.
    #[serde(default)]
    pub per_head: bool,
}

fn yes() -> bool {
    true
}

/// One parameter of a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Dotted name (`layers.0.attention.wq.weight`).
    pub name: String,
    /// Global (unsharded) shape.
    pub shape: Vec<usize>,
    /// Storage dtype name (`f32`, `bf16`).
    pub dtype: String,
    /// Initialization.
    pub init: Init,
    /// Placement hints.
    #[serde(default)]
    pub placement: Placement,
    /// The block it belongs to (for recompute, prefetch and pipeline splits); `None` for
    /// embedding and head parameters.
    #[serde(default)]
    pub layer: Option<usize>,
    /// Where its values live in a Hugging Face checkpoint; `None` means a tensor of the same
    /// name and layout.
    #[serde(default)]
    pub hf: Option<HfMap>,
    /// False for a buffer: saved in checkpoints and exported like a parameter, but not trained
    /// (no gradient, no optimizer state); the model updates it in
    /// `before_optimizer_step` (a router's load-balancing bias).
    #[serde(default = "yes")]
    pub trainable: bool,
}

/// A model: its parameters, module tree and costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Architecture name (`llama`).
    pub architecture: String,
    /// Number of blocks `layer(i, ..)` accepts.
    pub n_layers: usize,
    /// Vocabulary size of the logits.
    pub vocab_size: usize,
    /// Maximum sequence length the model supports.
    pub max_seq_len: usize,
    /// Training FLOPs per token at sequence length `max_seq_len` (for MFU).
    pub flops_per_token: f64,
    /// The part of `flops_per_token` that grows with the context: training FLOPs per token per
    /// key position of the layers that attend to the whole context (`flops_per_token` counts
    /// them at `max_seq_len` keys), so a run at a shorter sequence length reports its own
    /// figures ([`ModelSpec::flops_per_token_at`]). 0 when the plugin does not say.
    #[serde(default)]
    pub context_flops_per_token: f64,
    /// Parameters one token goes through, when fewer than all (a mixture of experts counts
    /// only the experts a token is routed to).
    #[serde(default)]
    pub active_params: Option<usize>,
    /// Every parameter.
    pub params: Vec<ParamSpec>,
    /// Per-layer attention cache needs: `(n_kv_heads, head_dim)` for attention layers.
    #[serde(default)]
    pub kv_cache: Vec<Option<(usize, usize)>>,
    /// How to read and write the Hugging Face layout of this model, if it has one.
    #[serde(default)]
    pub hf: Option<HfAdapter>,
    /// The parallel layouts whose forward the model must take part in, that it supports.
    #[serde(default)]
    pub parallel: ParallelSupport,
}

impl ModelSpec {
    /// Training FLOPs per token at sequence length `seq_len` (at most `max_seq_len`): the
    /// attention over the whole context counted at `seq_len` keys instead of `max_seq_len`.
    pub fn flops_per_token_at(&self, seq_len: usize) -> f64 {
        let shorter = self.max_seq_len.saturating_sub(seq_len) as f64;
        self.flops_per_token - self.context_flops_per_token * shorter
    }
}

/// The parallel layouts a model's forward takes part in, that it declares it supports. Data
/// parallelism, FSDP, pipeline stages and context parallelism need nothing of a model beyond
/// its parameters' placements; these do.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ParallelSupport {
    /// The forward runs on a rank's share of the heads and of every parameter declared
    /// tensor-parallel (column, row, vocab, experts' widths): each op it uses on them is
    /// one the host combines over the group, and its per-head tensors follow the rank's heads.
    #[serde(default)]
    pub tensor: bool,
    /// The experts run through the plugin's own grouped products (`moe_dispatch`,
    /// `grouped_matmul_nt`, `moe_combine`) rather than the host's `moe_ffn`, which is what
    /// expert parallelism splits: the host refuses `parallelism.ep` for such a model.
    #[serde(default)]
    pub experts_outside_moe_op: bool,
}

/// The Hugging Face side of a model besides its tensors (each parameter carries its own
/// [`HfMap`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HfAdapter {
    /// `config.json` contents for export.
    pub config: serde_json::Value,
}

/// One piece of per-parameter optimizer state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateSpec {
    /// The suffix the state is reached by (`exp_avg` → `"<param>.exp_avg"`).
    pub name: String,
    /// Its initial value (shape and dtype follow the parameter; state is kept in f32).
    pub init: Init,
}

/// An optimizer: the state it keeps and what it needs from the host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSpec {
    /// Algorithm name (`adamw`).
    pub algorithm: String,
    /// State per parameter.
    pub state: Vec<StateSpec>,
    /// True when `step` must see the full (unsharded) matrix of each parameter (Muon).
    #[serde(default)]
    pub needs_full_matrix: bool,
}

pub use crate::hf_map::{HfCombine, HfMap, HfStep};

/// A parameter claiming a Hugging Face tensor, and which part of it (index, count) if fused.
type Claim<'a> = (&'a str, Option<(usize, usize)>);

impl ModelSpec {
    /// Checks what a plugin declared fits together: parameter names are unique, shapes have no
    /// zero dims, each Hugging Face mapping agrees with its parameter's shape, and no Hugging
    /// Face tensor is claimed twice (except as distinct parts of one fused tensor). The message
    /// names the parameter, so a slip in a declaration fails when the plugin loads.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        // Hugging Face tensor -> (parameter, part index, part count) claiming it.
        let mut claimed: std::collections::HashMap<&str, Vec<Claim<'_>>> =
            std::collections::HashMap::new();
        for p in &self.params {
            if !seen.insert(p.name.as_str()) {
                return Err(format!("parameter '{}' is declared twice", p.name));
            }
            if p.shape.contains(&0) {
                return Err(format!(
                    "parameter '{}' has a zero dim in its shape {:?}",
                    p.name, p.shape
                ));
            }
            if let Some(e) = p.placement.expert_dim {
                if e >= p.shape.len() {
                    return Err(format!(
                        "parameter '{}': expert_dim {e} is out of range for shape {:?}",
                        p.name, p.shape
                    ));
                }
            }
            let Some(m) = &p.hf else { continue };
            m.source_shape(&p.shape)
                .map_err(|e| format!("parameter '{}': Hugging Face mapping: {e}", p.name))?;
            for src in &m.sources {
                claimed
                    .entry(src.as_str())
                    .or_default()
                    .push((p.name.as_str(), m.part_of()));
            }
        }
        for (src, users) in &claimed {
            if users.len() < 2 && users[0].1.is_none_or(|(_, n)| n == 1) {
                continue;
            }
            let parts: Option<Vec<(usize, usize)>> = users.iter().map(|u| u.1).collect();
            let Some(mut parts) = parts else {
                return Err(format!(
                    "parameters '{}' and '{}' both map to Hugging Face tensor '{src}'",
                    users[0].0, users[1].0
                ));
            };
            parts.sort();
            let n = parts[0].1;
            if parts.len() != n
                || parts
                    .iter()
                    .enumerate()
                    .any(|(i, &(k, m))| i != k || m != n)
            {
                let names: Vec<&str> = users.iter().map(|u| u.0).collect();
                return Err(format!(
                    "Hugging Face tensor '{src}' is split into {n} parts, but parameters {names:?} claim parts {:?}; each part must be claimed once",
                    parts.iter().map(|p| p.0).collect::<Vec<_>>()
                ));
            }
        }
        Ok(())
    }
}
