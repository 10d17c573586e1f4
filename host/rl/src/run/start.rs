//! How an RL job starts on one rank: the rank's roles, and the policy it starts from (resumed
//! or initialised, placed on the device, cut to its pipeline stages or FSDP rows).

use super::place_on;
use crate::checkpoint::{restore, Progress};
use crate::cp::RlContext;
use crate::pp::PpPolicy;
use crate::setup::initial_params;
use crate::trainer::publishable;
use anneal_config::JobConfig;
use anneal_engine::{Device, Tensor};
use anneal_runtime::plugins::{Params, PluginModel, PluginOptimizer};
use anneal_train::checkpoint::{load_dir_with, CheckpointError, Contents};
use anneal_train::harness::{resume_with, split_buffers, Provenance, Resumed, RunDir, RunKind};
use anneal_train::{Console, Dist, FsdpPolicy, TpInference, TrainError};
use std::path::Path;

/// Tensors by name.
type Named = Vec<(String, Tensor)>;

/// What this rank does in the job.
pub(super) struct Roles {
    /// Under context parallelism, this rank's place in its group.
    pub cp: Option<RlContext>,
    /// Data-parallel ranks (each rolls out and trains on its share of a step's prompts).
    pub ranks: usize,
    /// A rank of the first data-parallel rank's tensor-parallel group that rolls out (not a
    /// context-parallel follower): these evaluate together.
    pub main: bool,
    /// A context-parallel rank past its group's first: it trains on the first one's rollouts.
    pub cp_follower: bool,
    /// The job's processes: the data-parallel ranks times each one's tensor-parallel,
    /// context-parallel and pipeline groups.
    pub world: usize,
    /// The first `main` rank, of the first pipeline stage: it alone writes the run's files.
    pub lead: bool,
}

impl Roles {
    /// This rank's roles in `dist` (whose data-parallel group loses the context-parallel ranks).
    pub fn of(dist: &mut Dist) -> Roles {
        let cp = RlContext::of_dist(dist);
        let cp_size = cp.as_ref().map_or(1, |c| c.size());
        let cp_follower = cp.as_ref().is_some_and(|c| c.rank() > 0);
        let (ranks, main) = (dist.size(), dist.rank() == 0 && !cp_follower);
        let world = ranks * dist.tp_degree() * cp_size * dist.pp().map_or(1, |c| c.size());
        let lead = main && dist.tp_rank() == 0 && dist.pp().is_none_or(|c| c.rank() == 0);
        Roles {
            cp,
            ranks,
            main,
            cp_follower,
            world,
            lead,
        }
    }

    /// Notes the run dir, this rank's place in the mesh and what the layouts do.
    pub fn announce(&self, dist: &Dist, console: &Console, run_dir: &Path) {
        console.note(&format!("run dir: {}", run_dir.display()));
        if self.world > 1 {
            let tp = match dist.tp_degree() {
                1 => String::new(),
                n => format!(", tensor-parallel rank {} of {n}", dist.tp_rank()),
            };
            console.note(&format!(
                "distributed: rank {} of {}{tp}; mesh {}",
                dist.rank(),
                self.ranks,
                dist.mesh().describe()
            ));
        }
        if let Some(cp) = &self.cp {
            console.note(&cp.summary());
        }
    }
}

/// Under `parallelism.tp`, the group this rank decodes and trains with (refusing an optimizer
/// that steps whole matrices); `None` otherwise.
pub(super) fn tensor_parallel(
    cfg: &JobConfig,
    dist: &Dist,
    model: &PluginModel,
    optimizer: &PluginOptimizer,
    console: &Console,
) -> Result<Option<TpInference>, TrainError> {
    let model_name = format!("{}/{}", cfg.model.plugin, cfg.model.flavor);
    let tp = TpInference::of_dist(dist, &model_name, model.spec())?;
    if let Some(tp) = &tp {
        if optimizer.spec().needs_full_matrix {
            return Err(TrainError::Config(format!(
                "config: `parallelism.tp` = {} with `optimizer.plugin` = {}: an optimizer that steps whole matrices would see this rank's slices only; set parallelism.tp = 1 or use adamw",
                tp.ranks(),
                cfg.optimizer.plugin
            )));
        }
        console.note(&tp.summary());
    }
    Ok(tp)
}

/// The policy this rank starts from, as it keeps it between steps.
pub(super) struct Start<'a> {
    /// The policy (this rank's stages, rows or slices), sorted by name.
    pub named: Named,
    /// The model's buffers.
    pub buffers: Named,
    /// The frozen KL reference (this rank's part, as `named`).
    pub reference: Option<Params>,
    /// The RL counters.
    pub progress: Progress,
    /// The checkpoint resumed (step 0 for a fresh start).
    pub resumed: Resumed,
    /// Under pipeline parallelism, the pipeline.
    pub pp: Option<PpPolicy<'a>>,
    /// Under FSDP (and expert parallelism), the row layout.
    pub fsdp: Option<FsdpPolicy>,
}

/// The run's resumed or initial policy on this rank: the lead resumes `run` (the others read
/// the checkpoint it accepted), or every rank initialises it on the host (the same values on
/// any device); then it is placed on the job's device and cut to this rank's pipeline stages
/// and FSDP rows (with the optimizer state and the reference). Collective over the job.
#[allow(clippy::too_many_arguments)]
pub(super) fn start_policy<'a>(
    cfg: &JobConfig,
    run_dir: &Path,
    run: Option<&RunDir>,
    dist: &'a Dist,
    roles: &Roles,
    model: &PluginModel,
    optimizer: &mut PluginOptimizer,
    tp: Option<&TpInference>,
    provenance: &Provenance,
    console: &Console,
) -> Result<Start<'a>, TrainError> {
    let mut restored = None;
    let resumed = match run {
        // Tensors are read when asked for: under tensor parallelism a rank reads its slices.
        Some(run) => resume_with(
            cfg,
            run,
            RunKind::Rl,
            provenance,
            console,
            Contents::OnDemand,
            |l| {
                restored = Some(restore(cfg, model, optimizer, tp, l)?);
                Ok(())
            },
        ),
        None => Ok(Resumed::default()),
    };
    // A checkpoint rank 0 refuses fails every rank.
    let resumed = dist.led_by_rank0(resumed)?;
    // The other ranks continue from the checkpoint rank 0 accepted (after its checks).
    let resumed = if roles.world > 1 {
        let step = dist.broadcast_u64(resumed.step, 0)?;
        if !roles.lead && step > 0 {
            let dir = run_dir.join("checkpoints").join(format!("step-{step}"));
            console.note(&format!("resuming from {} (step {step})", dir.display()));
            // Rank 0 has verified the files.
            let loaded = load_dir_with(&dir, Contents::Trusted)?;
            restored = Some(restore(cfg, model, optimizer, tp, loaded)?);
        }
        Resumed { step, ..resumed }
    } else {
        resumed
    };
    let (named, buffers, reference, progress) = match restored {
        Some(r) => (r.named, r.buffers, r.reference, r.progress),
        None => {
            let note = |m: &str| console.note(m);
            let (named, buffers) = split_buffers(model, initial_params(cfg, model, tp, &note)?);
            let all: Named = named.iter().chain(&buffers).cloned().collect();
            let reference: Option<Params> = (cfg.rl.kl_coef > 0.0)
                .then(|| publishable(&all, 0.0))
                .transpose()?;
            (named, buffers, reference, Progress::default())
        }
    };
    // Policy, buffers, KL reference and optimizer state on the job's device (each rank on its
    // own GPU).
    let device = anneal_train::device::for_job(cfg, roles.world)?;
    let (named, buffers, reference) = place_on(device, named, buffers, reference, optimizer)?;
    // Under pipeline parallelism each rank keeps its stages' policy and optimizer state.
    let note = |m: &str| console.note(m);
    let (pp, named, buffers) =
        crate::pp::split(cfg, dist, model, named, buffers, optimizer, &note)?;
    if device != Device::Cpu {
        console.note(&format!(
            "policy, KL reference and optimizer state on {device}"
        ));
    }
    let (fsdp, named, reference) = shard(cfg, dist, model, optimizer, named, reference, console)?;
    Ok(Start {
        named,
        buffers,
        reference,
        progress,
        resumed,
        pp,
        fsdp,
    })
}

/// Under FSDP each rank keeps its rows of the policy, of the optimizer state and of the KL
/// reference it started from; under expert parallelism (which borrows the dp_shard ranks) each
/// keeps its experts. Everything unchanged otherwise.
fn shard(
    cfg: &JobConfig,
    dist: &Dist,
    model: &PluginModel,
    optimizer: &mut PluginOptimizer,
    named: Named,
    reference: Option<Params>,
    console: &Console,
) -> Result<(Option<FsdpPolicy>, Named, Option<Params>), TrainError> {
    let note = |m: &str| console.note(m);
    let fsdp = FsdpPolicy::of_dist_with_experts(cfg, dist, &named, model.spec(), optimizer, &note)?;
    let Some(f) = fsdp else {
        return Ok((None, named, reference));
    };
    if optimizer.spec().needs_full_matrix {
        return Err(TrainError::Config(format!(
            "config: `parallelism.dp_shard` with `optimizer.plugin` = {}: `anneal rl` under FSDP steps the optimizer on this rank's rows, and this optimizer needs whole matrices; set parallelism.dp_shard = 1 or use adamw",
            cfg.optimizer.plugin
        )));
    }
    let shards = f.shard(&named)?;
    let state = f.shard_state(&named, optimizer.state().clone())?;
    if !state.is_empty() {
        optimizer.load_state(&shards, state).map_err(|m| {
            TrainError::Checkpoint(CheckpointError::Mismatch(format!(
                "the optimizer state of this rank's rows: {m}"
            )))
        })?;
    }
    let reference = reference.map(|r| f.shard_map(&named, &r)).transpose()?;
    console.note(&f.summary(&shards));
    Ok((Some(f), shards, reference))
}
