//! RL post-training: GRPO-family losses, the versioned rollout buffer, rollout workers on the
//! same model plugin as the trainer, the loop behind `anneal rl` with its checkpoints, and the
//! samples file (`samples.jsonl`) it writes for reading runs.
//!
//! ```text
//! run/           `anneal rl`: the run as a short sequence (mod.rs), the layouts it refuses
//!                (layout.rs), the rank's roles and starting policy (start.rs), each step's
//!                phases: rollouts, updates, publish, row, evaluation, save (steps.rs)
//! setup.rs       tokenizer, prompts, plugins and the starting policy of a run
//! preflight.rs   the run's up-front checks as one call (`anneal serve` validates with it)
//! step.rs        a step's phases the loop names: sharded rollouts, the optimizer updates
//! trainer.rs     one trainer step: batch-invariant forward, logprob mismatch, loss, backward
//! tp_fsdp.rs     tensor parallel x FSDP: rows gathered to slices, partial grads, whole saves
//! cp.rs          context parallelism: each rank's part of the rows, logits made whole
//! pp.rs          pipeline parallelism: stages kept, gathered for rollouts, the RL loss last
//! loss.rs        GRPO / Dr.GRPO / DAPO, k3 KL, truncated importance ratio
//! rollout.rs     prompts, rollout workers, scoring, held-out evaluation
//! episode.rs     multi-turn episodes with an environment: token-exact turns, tool calls
//! buffer.rs      the rollout buffer keyed by policy version (bounded staleness)
//! checkpoint.rs  what an RL checkpoint holds beyond the trainer's tensors
//! metrics.rs     the per-step row of metrics.jsonl
//! samples.rs     samples.jsonl: every module's score of the samples of logged steps
//! ```

pub mod buffer;
mod checkpoint;
mod cp;
pub mod episode;
pub mod loss;
mod metrics;
mod pp;
mod preflight;
pub mod rollout;
mod run;
pub mod samples;
mod setup;
mod step;
mod tp_fsdp;
mod trainer;

pub use metrics::RlRow;
pub use preflight::preflight;
pub use run::{check_layout, run_rl, run_rl_dist, RlOptions, RlSummary};
