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
    /// Split the output features (the first dim of a `[out, in]` weight).
    Column,
    /// Split the input features (the second dim).
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
    /// Every parameter.
    pub params: Vec<ParamSpec>,
    /// Per-layer attention cache needs: `(n_kv_heads, head_dim)` for attention layers.
    #[serde(default)]
    pub kv_cache: Vec<Option<(usize, usize)>>,
    /// How to read and write the Hugging Face layout of this model, if it has one.
    #[serde(default)]
    pub hf: Option<HfAdapter>,
}

/// The state-dict adapter to Hugging Face: names (and the config) of the same weights.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HfAdapter {
    /// `config.json` contents for export.
    pub config: serde_json::Value,
    /// `(our name, Hugging Face name)` for every parameter; tensors keep their layout.
    pub names: Vec<(String, String)>,
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
