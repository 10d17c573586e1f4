//! RL post-training: GRPO-family losses, the versioned rollout buffer, rollout workers on the
//! same model plugin as the trainer, the loop behind `anneal rl` with its checkpoints, and the
//! samples file (`samples.jsonl`) it writes for reading runs.

pub mod buffer;
mod checkpoint;
pub mod loss;
pub mod rollout;
mod run;
pub mod samples;

pub use run::{run_rl, RlOptions, RlRow, RlSummary};
