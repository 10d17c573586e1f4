//! `anneal rl`'s up-front checks as one call, so `anneal serve`'s validation asks exactly what
//! the run will before it does any expensive work: the mesh and the device
//! ([`crate::check_layout`]'s checks), the tokenizer, the prompts (each fitting the model's
//! context with `rl.max_new_tokens` after it, or skipped with `rl.skip_long_prompts`), the
//! model and optimizer plugins and the memory estimate. The reward modules are loaded by the
//! caller (the CLI's scorer, the server's check), with the same `RewardSet::load`.

use anneal_config::JobConfig;
use anneal_train::TrainError;

/// The checks of `anneal rl` for a job of `processes` processes; returns what the run will
/// say about the config at its start (prompts it leaves out).
pub fn preflight(cfg: &JobConfig, processes: usize) -> Result<Vec<String>, TrainError> {
    let mesh = anneal_train::preflight::mesh(cfg, processes)?;
    crate::run::check_mesh_layout(cfg, &mesh)?;
    let setup = crate::setup::prepare(cfg)?;
    Ok(skipped_note(cfg, setup.skipped_prompts)
        .into_iter()
        .collect())
}

/// The line a run logs once at its start when `rl.skip_long_prompts` left prompts out.
pub(crate) fn skipped_note(cfg: &JobConfig, skipped: usize) -> Option<String> {
    (skipped > 0).then(|| {
        format!(
            "prompts: skipping {skipped} prompt(s) of {} longer than the model's context allows with rl.max_new_tokens = {} after them (rl.skip_long_prompts)",
            cfg.rl.prompts_path, cfg.rl.max_new_tokens
        )
    })
}
