//! The run harness that `anneal train` and `anneal rl` share, so the two loops differ only in
//! what one step does:
//!
//! ```text
//! run_dir.rs   the run directory: one writer at a time (an OS lock), config.toml and
//!              tokenizer.json written only once a resume was accepted
//! plugins.rs   the job's model and optimizer plugins
//! resume.rs    resuming from the newest usable checkpoint: the checks every run makes (kind,
//!              seed, tokenizer and data hashes), parameters and optimizer state read back
//!              with their shapes and dtypes checked, step logs cut back to the checkpoint
//! saver.rs     saving: when a save is due, how long the step was blocked, failed saves
//! grads.rs     trained parameters apart from buffers, the global gradient norm, clipping
//! ```
//! The console and `metrics.jsonl` are in [`crate::metrics`], the schedule in
//! [`crate::LrSchedule`].

mod grads;
mod plugins;
mod resume;
mod run_dir;
mod saver;

pub use grads::{clip_grads, split_buffers};
pub use plugins::{
    load_model, load_optimizer, model_plugin_name, with_hf_start, with_model_plugin,
};
pub use resume::{
    params_from_checkpoint, params_of_rows_from_checkpoint, restore_optimizer, resume, resume_with,
    truncate_step_logs, Provenance, Resumed, RowsOf, RunKind, STEP_LOGS,
};
pub use run_dir::{RunDir, LOCK_FILE};
pub use saver::{Saver, ShardSaver};
