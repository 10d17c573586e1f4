//! The loop behind `anneal rl`: rollout workers fill the versioned buffer while the trainer
//! takes batches, scores them with its own forward, applies the loss and publishes the new
//! weights by version. The run directory, resume and saving are the run harness's
//! ([`anneal_train::harness`]), as for `anneal train`.

mod layout;
mod start;
mod steps;

pub use layout::check_layout;
pub(crate) use layout::check_mesh_layout;

use crate::buffer::{Item, RolloutBuffer, Taken};
use crate::loss::LossSettings;
use crate::metrics::RlRow;
use crate::rollout::{worker, Group, PromptSource, RolloutCtx, Scorer, Share};
use crate::setup::{prepare, Setup};
use crate::trainer::{publishable, Recompute, RlTrainer};
use anneal_config::JobConfig;
use anneal_data::TextTokenizer;
use anneal_engine::Tensor;
use anneal_runtime::infer::Sampling;
use anneal_runtime::plugins::{Params, PluginModel, PluginOptimizer, TensorParallelism};
use anneal_train::harness::{RunDir, Saver, ShardSaver};
use anneal_train::parallel::{Axis, Placement, Placements};
use anneal_train::{Console, Dist, LrSchedule, TpInference, TrainError};
use start::{start_policy, tensor_parallel, Roles, Start};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;
use steps::{open_logs, RlLoop, Savers};

/// What a run gets beside its config: the environment of multi-turn episodes, and knobs for
/// tests.
#[derive(Clone, Default)]
pub struct RlOptions {
    /// Adds this to every weight the rollout side receives (the trainer keeps the exact ones):
    /// a deliberate mismatch that `logprob_mismatch_max` must see.
    pub perturb_rollout_weights: f32,
    /// The environment of `rl.environment` (the CLI loads it into the WebAssembly sandbox):
    /// each prompt is then an episode of turns instead of one completion.
    pub environment: Option<Arc<dyn crate::episode::Environment>>,
}

impl std::fmt::Debug for RlOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RlOptions")
            .field("perturb_rollout_weights", &self.perturb_rollout_weights)
            .field("environment", &self.environment.is_some())
            .finish()
    }
}

/// How an RL run ended.
#[derive(Clone, Debug, PartialEq)]
pub struct RlSummary {
    /// Steps completed.
    pub steps: u64,
    /// The step this process resumed from (0 for a fresh start).
    pub resumed_from: u64,
    /// Whether a stop request ended the run early.
    pub stopped: bool,
    /// Held-out accuracy before training and after the last evaluation.
    pub eval_first: Option<f64>,
    /// See `eval_first`.
    pub eval_last: Option<f64>,
    /// The rows this process wrote.
    pub rows: Vec<RlRow>,
}

/// Trains `cfg` with RL in `run_dir`, scoring with `scorer`, until `training.steps` or until
/// `stop` is set (which ends the run after the current step, with a checkpoint). A run dir with
/// checkpoints resumes from the newest usable one; in synchronous mode (`rl.max_staleness = 0`,
/// one rollout thread) the resumed run's metrics equal an uninterrupted run's bit for bit.
/// Holds the run dir for its lifetime and writes `config.toml`, `tokenizer.json`,
/// `metrics.jsonl` and `checkpoints/` there, the first two only once a resume was accepted.
pub fn run_rl(
    cfg: &JobConfig,
    run_dir: &Path,
    scorer: Arc<dyn Scorer>,
    stop: &AtomicBool,
    opts: &RlOptions,
) -> Result<RlSummary, TrainError> {
    run_rl_dist(cfg, run_dir, scorer, stop, opts, Dist::single())
}

/// [`run_rl`] as one rank of a data-parallel job (`parallelism.dp_replicate` ranks, from
/// [`Dist::unbatched`]): each rank rolls out and scores its share of every step's prompts
/// ([`Share`]: whole groups, the same prompts whatever the number of ranks), trains on them
/// and sums the gradients with the others, so every replica applies the same update. Rank 0
/// alone holds the run directory, evaluates and writes metrics, samples (the step's groups
/// from every rank) and checkpoints; the others continue from the checkpoint it resumed.
/// With `parallelism.dp_shard` (FSDP, HSDP with `dp_replicate`) each rank keeps its rows of
/// the policy, optimizer state and KL reference ([`FsdpPolicy`]): a step gathers the policy
/// whole once for its rollouts (on the training thread) and its trainer forward, reduce-scatters
/// the gradients and steps the optimizer on the rows; the first replica's ranks write their
/// rows of each checkpoint. With `parallelism.tp` as well the rows are of this rank's
/// tensor-parallel slices, gathered to the slices (see [`crate::tp_fsdp`]).
/// With `parallelism.cp` the ranks of a cp group train on the first
/// one's rollouts, each running its part of every row ([`crate::cp`]).
pub fn run_rl_dist(
    cfg: &JobConfig,
    run_dir: &Path,
    scorer: Arc<dyn Scorer>,
    stop: &AtomicBool,
    opts: &RlOptions,
    mut dist: Dist,
) -> Result<RlSummary, TrainError> {
    let started = Instant::now();
    let cfg =
        &anneal_train::harness::with_model_plugin(&anneal_train::harness::with_hf_start(cfg)?)?;
    let r = &cfg.rl;
    check_layout(cfg, &dist)?;
    let roles = Roles::of(&mut dist);
    let dist = dist;
    // A run dir another process holds is refused before anything loads (a start refused
    // after that leaves no run dir it made, see `RunDir`).
    let run = roles.lead.then(|| RunDir::open(run_dir)).transpose()?;
    let Setup {
        tokenizer,
        tokenizer_path,
        prompts,
        model,
        mut optimizer,
        provenance,
        skipped_prompts,
        eval_prompts,
    } = prepare(cfg)?;
    let total = cfg.training.steps;
    let console = Console::new(total, 0, cfg.metrics.progress_bar && roles.lead);
    roles.announce(&dist, &console, run_dir);
    if let Some(note) = crate::preflight::skipped_note(cfg, skipped_prompts) {
        console.note(&note);
    }
    let tp = tensor_parallel(cfg, &dist, &model, &optimizer, &console)?;
    // The communicator of the group is installed on this thread for the whole run: rollouts,
    // evaluations and trainer steps all run here, in the same order on every rank.
    let _tp_active = tp.as_ref().map(TpInference::activate);
    let Start {
        named,
        buffers,
        reference,
        progress,
        resumed,
        pp,
        fsdp,
    } = start_policy(
        cfg,
        run_dir,
        run.as_ref(),
        &dist,
        &roles,
        &model,
        &mut optimizer,
        tp.as_ref(),
        &provenance,
        &console,
    )?;
    if let Some(run) = &run {
        run.record(cfg, &tokenizer_path, &Default::default())?;
    }
    let share = Share {
        rank: dist.rank() as u64,
        ranks: roles.ranks as u64,
        per_step: r.prompts_per_step as u64,
    };
    let next_prompt = share.local_of(progress.rl.next_prompt);
    let tp_ctx = tp.as_ref().map(TpInference::context);
    let env = opts
        .environment
        .clone()
        .map(|e| crate::setup::env_ctx(cfg, e, &tokenizer, &tokenizer_path))
        .transpose()?;
    let ctx = rollout_ctx(
        cfg,
        &model,
        &tokenizer,
        prompts,
        scorer,
        (share, next_prompt),
        (tp_ctx, env),
    );
    let per_rank = r.prompts_per_step / roles.ranks;
    // Under FSDP or PP the rollouts get each step's gathered policy (published in the loop);
    // nothing whole rests in the buffer between steps.
    let on_this_thread = tp.is_some() || fsdp.is_some() || pp.is_some() || roles.cp_follower;
    let all: Vec<(String, Tensor)> = named.iter().chain(&buffers).cloned().collect();
    let weights = match fsdp.is_some() || pp.is_some() {
        true => Params::default(),
        false => publishable(&all, opts.perturb_rollout_weights)?,
    };
    let capacity = per_rank * (r.max_staleness as usize + 1);
    let buffer = Arc::new(RolloutBuffer::<Group, Params>::new(
        weights.clone(),
        r.max_staleness,
        capacity,
    ));
    if resumed.step > 0 {
        // A resumed policy is version `step`: the first take is at that version.
        buffer.publish(resumed.step, weights);
    }
    console.note(&format!(
        "rl: {} steps of {} prompts x {} samples, loss {:?}, max_staleness {}, {} rollout thread(s)",
        total, r.prompts_per_step, r.group_size, r.loss, r.max_staleness, r.rollout_threads
    ));
    // Planned on the whole policy (a layout that shards it refuses `budget`, `check_layout`),
    // for a group's episodes at their longest.
    // What the trainer's forward reads (the same tensors as `named` and `buffers`).
    let params: Params = Arc::new(all.iter().cloned().collect());
    let recompute = {
        let rows = r.group_size;
        let longest = match (r.environment.is_empty(), r.max_episode_tokens) {
            (false, n) if n > 0 => n.min(model.spec().max_seq_len),
            _ => model.spec().max_seq_len,
        };
        Recompute::plan(cfg, &model, &params, (rows, longest), &|m| {
            console.note(&format!("rl trainer: {m}"))
        })?
    };
    let mut trainer = RlTrainer {
        model: &model,
        placements: policy_placements(&named, tp.as_ref(), fsdp.is_some(), pp.as_ref()),
        params,
        named,
        buffers,
        reference,
        settings: LossSettings::from_config(r),
        group_size: r.group_size,
        aux_weights: cfg.training.aux_loss_weights.clone(),
        tp: tp.as_ref(),
        gathered: None,
        fsdp: fsdp.as_ref(),
        whole: None,
        cp: roles.cp.as_ref(),
        pp: pp.as_ref(),
        recompute,
    };
    let mut steps = RlLoop {
        cfg,
        dist: &dist,
        console: &console,
        provenance: &provenance,
        held_out: (r.eval_freq > 0 && roles.main)
            .then(|| eval_prompts.unwrap_or_else(|| ctx.prompts.held_out(r.eval_prompts))),
        logs: roles
            .lead
            .then(|| open_logs(run_dir, cfg, &ctx))
            .transpose()?,
        ctx,
        buffer: buffer.clone(),
        per_rank,
        ranks: roles.ranks,
        main: roles.main,
        cp_follower: roles.cp_follower,
        perturb: opts.perturb_rollout_weights,
        schedule: LrSchedule::new(cfg.optimizer.lr, total, &cfg.lr_scheduler),
        progress,
        prompts_skipped: (skipped_prompts > 0).then_some(skipped_prompts as u64),
        savers: savers(
            cfg,
            run_dir,
            run.as_ref(),
            &dist,
            fsdp.is_some() && tp.is_none(),
        )?,
        summary: RlSummary {
            steps: resumed.step,
            resumed_from: resumed.step,
            stopped: false,
            eval_first: None,
            eval_last: None,
            rows: Vec::new(),
        },
        clock: (resumed.elapsed_s, started),
        last_row: Instant::now(),
    };
    steps.evaluate_start(&trainer)?;
    // Under tensor parallelism, FSDP or PP the rollouts run on this thread (see
    // `RlLoop::rollouts`); a context-parallel group's first rank rolls out for the group.
    let workers = match on_this_thread {
        true => Vec::new(),
        false => spawn_workers(cfg, per_rank, &steps.ctx, &buffer)?,
    };
    let result = steps.run(&mut trainer, &mut optimizer, stop);
    buffer.close();
    for w in workers {
        let _ = w.join();
    }
    result?;
    steps.finish(&mut trainer, &optimizer)
}

/// What the rollouts of this rank read: the policy's model, the tokenizer, the prompts it takes
/// (`share`, from `next_prompt` on), the scorer and the sampling settings.
fn rollout_ctx(
    cfg: &JobConfig,
    model: &Arc<PluginModel>,
    tokenizer: &Arc<TextTokenizer>,
    prompts: PromptSource,
    scorer: Arc<dyn Scorer>,
    (share, next_prompt): (Share, u64),
    (tp, env): (Option<TensorParallelism>, Option<crate::episode::EnvCtx>),
) -> Arc<RolloutCtx> {
    let r = &cfg.rl;
    Arc::new(RolloutCtx {
        model: model.clone(),
        tokenizer: tokenizer.clone(),
        prompts,
        scorer,
        prepend_eos: r.prepend_eos,
        group_size: r.group_size,
        max_new_tokens: r.max_new_tokens,
        sampling: Sampling {
            temperature: r.temperature,
            top_k: r.top_k,
            top_p: r.top_p,
            seed: cfg.training.seed,
            eos: None,
        },
        next_prompt: AtomicU64::new(next_prompt),
        share,
        failed: Mutex::new(None),
        tp,
        env,
    })
}

/// Where each policy parameter lives over the mesh (what the gradient norm adds by): split
/// and partial over `tp`, rows over `dp_shard`, or the pipeline's stages.
fn policy_placements(
    named: &[(String, Tensor)],
    tp: Option<&TpInference>,
    sharded: bool,
    pp: Option<&crate::pp::PpPolicy>,
) -> Placements {
    if let Some(pp) = pp {
        return pp.placements();
    }
    let mut placements = Placements::replicated(named.iter().map(|(n, _)| n.clone()));
    if let Some(tp) = tp {
        placements = placements
            .with(Axis::Tp, |n| tp.placement(n))
            .with_partial_grads(Axis::Tp, |n| tp.partial_grad(n));
    }
    if sharded {
        placements = placements.with(Axis::DpShard, |_| Placement::Shard(0));
    }
    placements
}

/// The run's savers: under FSDP (without TP) the first replica's ranks each write their rows
/// and rank 0 publishes the step (as `anneal train` saves FSDP); otherwise, and under TP x
/// FSDP, the lead writes whole tensors.
fn savers(
    cfg: &JobConfig,
    run_dir: &Path,
    run: Option<&RunDir>,
    dist: &Dist,
    rows: bool,
) -> Result<Savers, TrainError> {
    let shard = match (rows, dist.save_group()) {
        (true, Some(group)) => Some(ShardSaver::for_group(cfg, run_dir, group)?),
        _ => None,
    };
    let whole = match rows {
        true => None,
        false => run.map(|run| Saver::new(cfg, run)),
    };
    Ok(Savers { shard, whole })
}

/// Starts `rl.rollout_threads` workers, each batching its share of a step's prompts into one
/// decode. With `rl.rollout_compute_threads`, each computes on a private pool of that many
/// threads instead of sharing the trainer's, so rollouts and training overlap on separate cores
/// rather than taking turns on all of them.
fn spawn_workers(
    cfg: &JobConfig,
    per_step: usize,
    ctx: &Arc<RolloutCtx>,
    buffer: &Arc<RolloutBuffer<Group, Params>>,
) -> Result<Vec<JoinHandle<()>>, TrainError> {
    let r = &cfg.rl;
    let max_groups = per_step.div_ceil(r.rollout_threads);
    let pools = (0..r.rollout_threads)
        .map(|_| {
            (r.rollout_compute_threads > 0)
                .then(|| {
                    rayon::ThreadPoolBuilder::new()
                        .num_threads(r.rollout_compute_threads)
                        .build()
                })
                .transpose()
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TrainError::Rollout(format!("cannot start a rollout thread pool: {e}")))?;
    Ok(pools
        .into_iter()
        .map(|pool| {
            let (ctx, buffer) = (ctx.clone(), buffer.clone());
            std::thread::spawn(move || match pool {
                Some(pool) => pool.install(|| worker(ctx, buffer, max_groups)),
                None => worker(ctx, buffer, max_groups),
            })
        })
        .collect())
}

/// Every data-parallel rank's taken groups, in rank order (which is prompt order: see
/// [`Share`]), on every rank: what the step's metrics and `samples.jsonl` report. The groups
/// travel as JSON, padded to the longest rank's bytes.
fn gather_taken(dist: &Dist, taken: Taken<Group>) -> Result<Taken<Group>, TrainError> {
    let mine: Vec<(u64, &Group)> = taken
        .items
        .iter()
        .map(|it| (it.version, &it.value))
        .collect();
    let bytes = serde_json::to_vec(&(taken.dropped, mine))
        .map_err(|e| TrainError::Rollout(format!("cannot encode this rank's groups: {e}")))?;
    let mut lens = vec![0i64; dist.size()];
    let len = [bytes.len() as i64];
    dist.dp()
        .all_gather((&len[..]).into(), (&mut lens[..]).into())?;
    let block = lens.iter().copied().max().unwrap_or(0).max(0) as usize;
    let mut padded = bytes;
    padded.resize(block, 0);
    let mut all = vec![0u8; block * dist.size()];
    dist.dp()
        .all_gather((&padded[..]).into(), (&mut all[..]).into())?;
    let mut out = Taken {
        items: Vec::new(),
        dropped: 0,
    };
    for (chunk, &n) in all.chunks(block.max(1)).zip(&lens) {
        let (dropped, items): (usize, Vec<(u64, Group)>) =
            serde_json::from_slice(&chunk[..n as usize]).map_err(|e| {
                TrainError::Rollout(format!("cannot decode another rank's groups: {e}"))
            })?;
        out.dropped += dropped;
        out.items.extend(
            items
                .into_iter()
                .map(|(version, value)| Item { version, value }),
        );
    }
    Ok(out)
}

/// Tensors by name.
type Named = Vec<(String, Tensor)>;

/// The policy, buffers and `optimizer`'s state (`anneal_train::device::place_policy`) and the
/// KL reference moved to `device`; unchanged on the CPU.
fn place_on(
    device: anneal_engine::Device,
    named: Named,
    buffers: Named,
    reference: Option<Params>,
    optimizer: &mut PluginOptimizer,
) -> Result<(Named, Named, Option<Params>), TrainError> {
    let (named, buffers) = anneal_train::device::place_policy(device, named, buffers, optimizer)?;
    let reference = match reference {
        Some(r) if device != anneal_engine::Device::Cpu => {
            let whole = r.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
            let placed = anneal_train::device::place(whole, device)?;
            Some(Arc::new(placed.into_iter().collect()))
        }
        other => other,
    };
    Ok((named, buffers, reference))
}
