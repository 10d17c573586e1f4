//! What a checkpoint directory holds, as serialized types.

use anneal_data::LoaderState;
use serde::{Deserialize, Serialize};

/// The layout version written to and required from `manifest.json`.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";
/// The train state's file name.
pub const TRAIN_STATE: &str = "train_state.json";

/// Shard file of `rank` out of `world` ranks.
pub fn shard_name(rank: usize, world: usize) -> String {
    format!("shard-{rank:05}-of-{world:05}.safetensors")
}

/// `manifest.json`: enough to find, check and (later) reshard every tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Optimizer steps completed when saved.
    pub step: u64,
    /// Ranks that wrote shards.
    pub world_size: usize,
    /// Every tensor piece: parameters as `model/<name>`, optimizer state as `optim/<name>`.
    pub tensors: Vec<TensorEntry>,
    /// Every other file of the directory with its size and SHA-256.
    pub files: Vec<FileEntry>,
}

/// One piece of one global tensor, as stored in one shard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Global name.
    pub name: String,
    /// Element type (`f32`, `bf16`, ...).
    pub dtype: String,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// The `[start, end)` range of each dim this piece covers (the whole tensor at world size 1).
    pub slice: Vec<[usize; 2]>,
    /// The shard file holding the piece.
    pub shard: String,
    /// Byte range of the piece's data within the shard file.
    pub byte_range: [u64; 2],
}

/// A file of the checkpoint with its checksum.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name within the step directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Hex SHA-256 of the contents.
    pub sha256: String,
}

/// `train_state.json`: everything besides tensors that an exact resume needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: u64,
    /// The run's seed (parameter init, data order, dropout streams are keyed by it and by step).
    pub seed: u64,
    /// Where the data loader continues.
    pub loader: LoaderState,
    /// Learning rate of the last step (the schedule is a function of the step).
    pub lr: f64,
    /// Tokens trained on.
    pub tokens: u64,
    /// Seconds of training (over every process of the run) up to this step.
    #[serde(default)]
    pub elapsed_s: f64,
    /// Model plugin and flavor.
    pub model: String,
    /// Optimizer plugin.
    pub optimizer: String,
    /// The resolved config of the run, as TOML.
    pub config: String,
    /// SHA-256 of the tokenizer the run trained with (its JSON form); absent in checkpoints
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_sha256: Option<String>,
    /// SHA-256 of the run's data: the tokenized training stream of `anneal train`, the prompts
    /// of `anneal rl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_sha256: Option<String>,
    /// Where an RL run (`anneal rl`) continues; absent in checkpoints of `anneal train`. An RL
    /// run has no data loader: its `loader` is zero and `tokens` counts completion tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rl: Option<RlState>,
}

/// The RL part of a [`TrainState`]: prompts and sampling seeds are functions of the run's seed
/// and the prompt index, so with the parameters, optimizer state and step this is all an exact
/// resume needs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RlState {
    /// The first prompt index the rollouts of the next step take; every index below it was
    /// trained on, or was in flight when the checkpoint was taken and is skipped.
    pub next_prompt: u64,
    /// Samples (completions) trained on.
    pub samples: u64,
}
