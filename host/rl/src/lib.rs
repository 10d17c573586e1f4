//! RL post-training: GRPO-family losses, the versioned rollout buffer, rollout workers on the
//! same model plugin as the trainer, and the loop behind `anneal rl` with its checkpoints.

pub mod buffer;
mod checkpoint;
pub mod loss;
pub mod rollout;
mod run;

pub use run::{run_rl, RlOptions, RlRow, RlSummary};
