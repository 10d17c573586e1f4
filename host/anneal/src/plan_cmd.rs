//! `anneal plan CONFIG [--set ...] [--device h200|h100|cpu] [--nproc N] [--json]`: per-rank
//! memory, per-step communication and an estimated step time of a training run, from the
//! config and the model's spec, before anything is allocated (see `anneal_train::plan`).

use anneal_train::plan::{plan, DeviceKind, PlanInput};
use std::path::Path;

/// Prints the plan of `config` (with `set` applied) on `device` over `nproc` processes (by
/// default the product of the mesh's degrees), as a table or as JSON.
pub fn run(
    config: &Path,
    set: &[String],
    device: &str,
    nproc: Option<usize>,
    json: bool,
) -> anyhow::Result<()> {
    let device: DeviceKind = match device.parse() {
        Ok(d) => d,
        Err(e) => crate::user_bail!("--device: {e}"),
    };
    if nproc == Some(0) {
        crate::user_bail!("--nproc: a job needs at least 1 process");
    }
    let cfg = crate::train_cmd::load(config, set)?;
    let processes = nproc.unwrap_or_else(|| default_processes(&cfg));
    // The plugins with their flavor and arguments: a spec, no weights.
    let (model, optimizer) = anneal_train::preflight::plugins(&cfg)?;
    let planned = plan(&PlanInput {
        cfg: &cfg,
        spec: model.spec(),
        optimizer: optimizer.spec(),
        processes,
        device,
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&planned)?);
    } else {
        print!("{planned}");
    }
    Ok(())
}

/// The processes the mesh's degrees name (`ep` borrows `dp_shard`'s ranks; a `-1` counts 1).
fn default_processes(cfg: &anneal_config::JobConfig) -> usize {
    let p = &cfg.parallelism;
    [p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp]
        .iter()
        .map(|&d| usize::try_from(d).unwrap_or(1).max(1))
        .product()
}
