//! What multi-rank RL refuses before anything loads: the layouts and settings it does not run,
//! as user errors naming the keys.

use anneal_config::JobConfig;
use anneal_train::preflight::Degrees;
use anneal_train::{Dist, TrainError};

/// Refuses what multi-rank RL does not run: pipeline stages beside other layouts or with
/// asynchronous rollouts ([`crate::pp::check`]), context parallelism beside tensor parallelism
/// or FSDP, tensor parallelism or sharded parameters (FSDP, also together, and expert
/// parallelism, which borrows FSDP's ranks) with asynchronous rollouts, sequence
/// parallelism, an optimizer that needs whole matrices or encoded
/// gathers under FSDP, and a step's prompts that do not split into whole groups per rank. User errors naming the
/// keys. (Whether the model splits under `parallelism.tp` is checked once it is loaded.)
pub fn check_layout(cfg: &JobConfig, dist: &Dist) -> Result<(), TrainError> {
    let degrees = dist.degrees();
    check_mesh_layout(cfg, &degrees)?;
    // Applies `training.allow_tf32` for the process.
    anneal_train::device::for_job(cfg, degrees.processes())?;
    Ok(())
}

/// [`check_layout`] of the mesh's degrees alone, changing nothing in this process (what
/// [`crate::preflight`] asks).
pub(crate) fn check_mesh_layout(cfg: &JobConfig, mesh: &Degrees) -> Result<(), TrainError> {
    if cfg.lora.rank > 0 {
        return Err(TrainError::Config(
            "config: `lora.rank`: RL trains every parameter for now; export a LoRA run \
             merged (`anneal checkpoint export`) and start RL from it (drop [lora])"
                .into(),
        ));
    }
    let r = &cfg.rl;
    let ranks = mesh.dp();
    // Resolved first, so an unusable device says why (the probe's reason), as for training; on
    // GPUs each rank takes its own (`device::check`).
    anneal_train::device::check(cfg, mesh.processes())?;
    crate::pp::check(cfg, mesh)?;
    let (tp, shard) = (mesh.tp, mesh.dp_shard);
    crate::cp::check(mesh)?;
    let par = &cfg.parallelism;
    // Training splits experts both ways; the RL trainer's sharded policy does not yet.
    if tp > 1 && mesh.ep > 1 {
        return Err(TrainError::Config(format!(
            "config: `parallelism.tp` = {tp} with `parallelism.ep` = {}: `anneal rl` does not split experts by both expert and tensor parallelism yet; set parallelism.ep = 1 (tp then splits each expert) or parallelism.tp = 1",
            mesh.ep
        )));
    }
    // Under tensor parallelism the ranks of a group decode together on the training thread;
    // under FSDP the whole policy exists only while a step runs (gathered there, once): one
    // synchronous rollout per step, no sequence split (a decode step has one position).
    let together = match (tp > 1, shard > 1) {
        (true, _) => Some(("parallelism.tp", tp, "the ranks of a group roll out together on the training thread, once per step")),
        (_, true) => Some(("parallelism.dp_shard", shard, "the policy is whole only while a step runs, gathered once on the training thread for that step's rollouts")),
        _ => None,
    };
    if let Some((layout, n, why)) = together {
        let refused = [
            (r.max_staleness > 0, "rl.max_staleness", "0"),
            (r.rollout_threads > 1, "rl.rollout_threads", "1"),
            (par.tp_sequence, "parallelism.tp_sequence", "false"),
        ];
        if let Some((_, key, want)) = refused.iter().find(|(bad, _, _)| *bad) {
            return Err(TrainError::Config(format!(
                "config: `{key}` with `{layout}` ({n}): {why}; set {key} = {want}"
            )));
        }
    }
    if shard > 1 && par.fsdp_all_gather_dtype != "float32" {
        return Err(TrainError::Config(format!(
            "config: `parallelism.fsdp_all_gather_dtype` = \"{}\" with `parallelism.dp_shard` ({shard}): `anneal rl` gathers the policy in float32, so rollouts and trainer see the same bits; set parallelism.fsdp_all_gather_dtype = \"float32\"",
            par.fsdp_all_gather_dtype
        )));
    }
    // The budget plan runs a forward of the whole policy at startup; these layouts hold
    // parts of it.
    let sharded = [
        (tp, "parallelism.tp"),
        (shard, "parallelism.dp_shard"),
        (mesh.pp, "parallelism.pp"),
    ];
    if cfg.activation_checkpoint.mode == anneal_config::RecomputeMode::Budget {
        if let Some((n, key)) = sharded.iter().find(|(n, _)| *n > 1) {
            return Err(TrainError::Config(format!(
                "config: `activation_checkpoint.mode` = \"budget\" with `{key}` ({n}): `anneal rl` measures the budget's plan on the whole policy, which this layout splits; set activation_checkpoint.mode = \"full\" or \"selective\""
            )));
        }
    }
    if !r.prompts_per_step.is_multiple_of(ranks) {
        return Err(TrainError::Config(format!(
            "config: `rl.prompts_per_step` ({}) does not split evenly over {ranks} data-parallel ranks (each rank takes whole groups); make it a multiple of {ranks}",
            r.prompts_per_step
        )));
    }
    Ok(())
}
