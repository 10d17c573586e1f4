//! The loop behind `anneal rl`: rollout workers fill the versioned buffer while the trainer
//! takes batches, scores them with its own forward, applies the loss and publishes the new
//! weights by version. The run directory, resume and saving are the run harness's
//! ([`anneal_train::harness`]), as for `anneal train`.

use crate::buffer::RolloutBuffer;
use crate::buffer::{Item, Taken};
use crate::checkpoint::{restore, Progress};
use crate::loss::LossSettings;
use crate::metrics::RlRow;
use crate::rollout::{evaluate, rollout_round, worker, Group, Prompt, RolloutCtx, Scorer, Share};
use crate::setup::{initial_params, prepare, Setup};
use crate::trainer::{publishable, RlTrainer};
use anneal_config::JobConfig;
use anneal_engine::Tensor;
use anneal_runtime::infer::Sampling;
use anneal_runtime::plugins::{Params, PluginOptimizer};
use anneal_train::checkpoint::{load_dir_with, Contents};
use anneal_train::harness::Resumed;
use anneal_train::harness::{resume_with, split_buffers, RunDir, RunKind, Saver, ShardSaver};
use anneal_train::parallel::{Axis, Placement, Placements};
use anneal_train::preflight::Degrees;
use anneal_train::{
    io_err, Console, Dist, FsdpPolicy, LrSchedule, MetricsLog, TpInference, TrainError,
};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// Knobs for tests.
#[derive(Clone, Debug, Default)]
pub struct RlOptions {
    /// Adds this to every weight the rollout side receives (the trainer keeps the exact ones):
    /// a deliberate mismatch that `logprob_mismatch_max` must see.
    pub perturb_rollout_weights: f32,
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
    let r = &cfg.rl;
    let ranks = mesh.dp();
    // Resolved first, so an unusable device says why (the probe's reason), as for training; on
    // GPUs each rank takes its own (`device::check`).
    anneal_train::device::check(cfg, mesh.processes())?;
    crate::pp::check(cfg, mesh)?;
    let (tp, shard) = (mesh.tp, mesh.dp_shard);
    crate::cp::check(mesh)?;
    let par = &cfg.parallelism;
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
    if !r.prompts_per_step.is_multiple_of(ranks) {
        return Err(TrainError::Config(format!(
            "config: `rl.prompts_per_step` ({}) does not split evenly over {ranks} data-parallel ranks (each rank takes whole groups); make it a multiple of {ranks}",
            r.prompts_per_step
        )));
    }
    Ok(())
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
    let cfg = &anneal_train::harness::with_model_plugin(cfg)?;
    let r = &cfg.rl;
    check_layout(cfg, &dist)?;
    // Under context parallelism the first rank of each cp group rolls out and evaluates.
    let cp = crate::cp::RlContext::of_dist(&mut dist);
    let cp_size = cp.as_ref().map_or(1, |c| c.size());
    let cp_follower = cp.as_ref().is_some_and(|c| c.rank() > 0);
    let (ranks, main) = (dist.size(), dist.rank() == 0 && !cp_follower);
    // The whole job's processes: the data-parallel ranks times each one's tensor-parallel,
    // context-parallel and pipeline groups.
    let world = ranks * dist.tp_degree() * cp_size * dist.pp().map_or(1, |c| c.size());
    // `main` ranks (the first data-parallel rank's tensor-parallel group) evaluate together;
    // the first of them alone writes the run's files.
    let tp_rank = dist.tp_rank();
    let lead = main && tp_rank == 0 && dist.pp().is_none_or(|c| c.rank() == 0);
    // A run dir another process holds is refused before anything loads (a start refused
    // after that leaves no run dir it made, see `RunDir`).
    let run = lead.then(|| RunDir::open(run_dir)).transpose()?;
    let Setup {
        tokenizer,
        tokenizer_path,
        prompts,
        model,
        mut optimizer,
        provenance,
        skipped_prompts,
    } = prepare(cfg)?;
    // Counted in every row of metrics.jsonl when prompts were left out.
    let prompts_skipped = (skipped_prompts > 0).then_some(skipped_prompts as u64);
    let total = cfg.training.steps;
    let console = Console::new(total, 0, cfg.metrics.progress_bar && lead);
    console.note(&format!("run dir: {}", run_dir.display()));
    if world > 1 {
        let tp = match dist.tp_degree() {
            1 => String::new(),
            n => format!(", tensor-parallel rank {tp_rank} of {n}"),
        };
        console.note(&format!(
            "distributed: rank {} of {ranks}{tp}; mesh {}",
            dist.rank(),
            dist.mesh().describe()
        ));
    }
    if let Some(cp) = &cp {
        console.note(&cp.summary());
    }
    if let Some(note) = crate::preflight::skipped_note(cfg, skipped_prompts) {
        console.note(&note);
    }
    let model_name = format!("{}/{}", cfg.model.plugin, cfg.model.flavor);
    let tp = TpInference::of_dist(&dist, &model_name, model.spec())?;
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
    // The communicator of the group is installed on this thread for the whole run: rollouts,
    // evaluations and trainer steps all run here, in the same order on every rank.
    let _tp_active = tp.as_ref().map(TpInference::activate);
    let mut restored = None;
    let resumed = match &run {
        // Tensors are read when asked for: under tensor parallelism a rank reads its slices.
        Some(run) => resume_with(
            cfg,
            run,
            RunKind::Rl,
            &provenance,
            &console,
            Contents::OnDemand,
            |l| {
                restored = Some(restore(cfg, &model, &mut optimizer, tp.as_ref(), l)?);
                Ok(())
            },
        ),
        None => Ok(Resumed::default()),
    };
    // A checkpoint rank 0 refuses fails every rank.
    let resumed = dist.led_by_rank0(resumed)?;
    // The other ranks continue from the checkpoint rank 0 accepted (after its checks).
    let resumed = if world > 1 {
        let step = dist.broadcast_u64(resumed.step, 0)?;
        if !lead && step > 0 {
            let dir = run_dir.join("checkpoints").join(format!("step-{step}"));
            console.note(&format!("resuming from {} (step {step})", dir.display()));
            // Rank 0 has verified the files.
            let loaded = load_dir_with(&dir, Contents::Trusted)?;
            restored = Some(restore(cfg, &model, &mut optimizer, tp.as_ref(), loaded)?);
        }
        Resumed { step, ..resumed }
    } else {
        resumed
    };
    let (named, buffers, reference, mut progress) = match restored {
        Some(r) => (r.named, r.buffers, r.reference, r.progress),
        None => {
            let (named, buffers) = split_buffers(
                &model,
                initial_params(cfg, &model, tp.as_ref(), &|m| console.note(m))?,
            );
            let all: Vec<(String, Tensor)> = named.iter().chain(&buffers).cloned().collect();
            let reference: Option<Params> = (r.kl_coef > 0.0)
                .then(|| publishable(&all, 0.0))
                .transpose()?;
            (named, buffers, reference, Progress::default())
        }
    };
    // Read or initialised on the host (the same values on any device), then placed: policy,
    // buffers, KL reference and optimizer state (each rank on its own GPU).
    let device = anneal_train::device::for_job(cfg, world)?;
    let (named, buffers, reference) = place_on(device, named, buffers, reference, &mut optimizer)?;
    // Under pipeline parallelism each rank keeps its stages' policy and optimizer state.
    let note = |m: &str| console.note(m);
    let (pp, named, buffers) =
        crate::pp::split(cfg, &dist, &model, named, buffers, &mut optimizer, &note)?;
    if device != anneal_engine::Device::Cpu {
        console.note(&format!(
            "policy, KL reference and optimizer state on {device}"
        ));
    }
    // Under FSDP each rank keeps its rows of the policy, of the optimizer state and of the KL
    // reference it started from.
    // Under expert parallelism (which borrows the dp_shard ranks) each keeps its experts.
    let fsdp =
        FsdpPolicy::of_dist_with_experts(cfg, &dist, &named, model.spec(), &optimizer, &|m| {
            console.note(m)
        })?;
    let (named, reference) = match &fsdp {
        Some(f) => {
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
                    TrainError::Checkpoint(anneal_train::checkpoint::CheckpointError::Mismatch(
                        format!("the optimizer state of this rank's rows: {m}"),
                    ))
                })?;
            }
            let reference = reference.map(|r| f.shard_map(&named, &r)).transpose()?;
            console.note(&f.summary(&shards));
            (shards, reference)
        }
        None => (named, reference),
    };
    if let Some(run) = &run {
        run.record(cfg, &tokenizer_path)?;
    }
    // Metric times continue across restarts of the same run.
    let clock = || resumed.elapsed_s + started.elapsed().as_secs_f64();
    let params: Params = Arc::new(named.iter().chain(&buffers).cloned().collect());
    let schedule = LrSchedule::new(cfg.optimizer.lr, total, &cfg.lr_scheduler);

    let held_out = (r.eval_freq > 0 && main).then(|| prompts.held_out(r.eval_prompts));
    let share = Share {
        rank: dist.rank() as u64,
        ranks: ranks as u64,
        per_step: r.prompts_per_step as u64,
    };
    let ctx = Arc::new(RolloutCtx {
        model: model.clone(),
        tokenizer: tokenizer.clone(),
        prompts,
        scorer: scorer.clone(),
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
        next_prompt: AtomicU64::new(share.local_of(progress.rl.next_prompt)),
        share,
        failed: Mutex::new(None),
        tp: tp.as_ref().map(TpInference::context),
    });
    let per_rank = r.prompts_per_step / ranks;
    let capacity = per_rank * (r.max_staleness as usize + 1);
    let all: Vec<(String, Tensor)> = named.iter().chain(&buffers).cloned().collect();
    // Under FSDP the rollouts get each step's gathered policy (published in the loop); nothing
    // whole rests in the buffer between steps.
    let weights = match fsdp.is_some() || pp.is_some() {
        true => Params::default(),
        false => publishable(&all, opts.perturb_rollout_weights)?,
    };
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

    // Under FSDP the ranks of the first replica each write their rows and rank 0 publishes
    // the step (as `anneal train` saves FSDP); otherwise, and under TP x FSDP, the lead writes
    // whole tensors.
    let mut shard_saver = match (&fsdp, dist.save_group()) {
        (Some(_), Some(group)) if tp.is_none() => Some(ShardSaver::for_group(cfg, run_dir, group)?),
        _ => None,
    };
    let mut saver = match &fsdp {
        Some(_) if tp.is_none() => None,
        _ => run.as_ref().map(|run| Saver::new(cfg, run)),
    };
    let mut logs = match lead {
        true => Some((
            MetricsLog::open(run_dir).map_err(io_err(run_dir))?,
            crate::samples::SampleLog::open(run_dir, r, ctx.prompts.clone())?,
        )),
        false => None,
    };
    let mut summary = RlSummary {
        steps: resumed.step,
        resumed_from: resumed.step,
        stopped: false,
        eval_first: None,
        eval_last: None,
        rows: Vec::new(),
    };
    let eval =
        |params: &Params, held_out: &Option<Vec<Prompt>>| -> Result<Option<f64>, TrainError> {
            match held_out {
                Some(p) => Ok(Some(evaluate(&ctx, params, p)?)),
                None => Ok(None),
            }
        };
    // Under FSDP the evaluated policy is gathered whole by every rank (a collective); the
    // first rank evaluates.
    let whole_for_eval = |names: &[(String, Tensor)], p: &Params| -> Result<Params, TrainError> {
        match &fsdp {
            Some(f) => f.gather_map(&dist, names, p),
            None => match &pp {
                Some(pp) => pp.whole_params(p),
                None => Ok(p.clone()),
            },
        }
    };
    if resumed.step == 0 && (held_out.is_some() || (fsdp.is_some() && r.eval_freq > 0)) {
        let whole = whole_for_eval(&named, &params)?;
        if let Some(acc) = eval(&whole, &held_out)? {
            let row = RlRow {
                eval_accuracy: Some(acc),
                time: clock(),
                prompts_skipped,
                ..Default::default()
            };
            console.note(&format!("step      0  eval_accuracy {acc:.3}"));
            if let Some((log, _)) = &mut logs {
                log.write(&row).map_err(io_err(log.path()))?;
            }
            summary.eval_first = Some(acc);
            summary.eval_last = Some(acc);
            summary.rows.push(row);
        }
    }

    // Under tensor parallelism or FSDP the rollouts run on this thread (see `rollout_round`
    // below).
    // Under context parallelism the group's first rank rolls out for the group.
    let workers = match tp.is_some() || fsdp.is_some() || pp.is_some() || cp_follower {
        true => Vec::new(),
        false => spawn_workers(cfg, per_rank, &ctx, &buffer)?,
    };
    let mut placements = Placements::replicated(named.iter().map(|(n, _)| n.clone()));
    if let Some(tp) = &tp {
        placements = placements
            .with(Axis::Tp, |n| tp.placement(n))
            .with_partial_grads(Axis::Tp, |n| tp.partial_grad(n));
    }
    if fsdp.is_some() {
        placements = placements.with(Axis::DpShard, |_| Placement::Shard(0));
    }
    if let Some(pp) = &pp {
        placements = pp.placements();
    }
    let mut trainer = RlTrainer {
        model: &model,
        placements,
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
        cp: cp.as_ref(),
        pp: pp.as_ref(),
    };
    let mut last_row_time = Instant::now();
    let result = (|| -> Result<(), TrainError> {
        for version in resumed.step..total {
            // Ranks see a signal at different steps; they stop together.
            if dist.any(stop.load(Ordering::SeqCst))? {
                console.note(&format!("stop requested: ending after step {version}"));
                summary.stopped = true;
                break;
            }
            let waited = Instant::now();
            if fsdp.is_some() {
                let perturb = opts.perturb_rollout_weights;
                trainer.sharded_rollout_round(&dist, &ctx, &buffer, version, per_rank, perturb)?;
            } else if let Some(pp) = &pp {
                let perturb = opts.perturb_rollout_weights;
                pp.rollout_round(&trainer, &ctx, &buffer, version, per_rank, perturb)?;
            } else if tp.is_some() {
                // Synchronous (max_staleness 0): this step's rollouts with the current weights.
                rollout_round(&ctx, &buffer, per_rank);
            }
            let taken = match cp_follower {
                true => None,
                false => Some(buffer.take(per_rank, version).ok_or_else(|| {
                    let failed = ctx.failed.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    TrainError::Rollout(
                        failed.unwrap_or_else(|| "the rollout workers stopped".into()),
                    )
                })?),
            };
            let taken = crate::cp::share_taken(&dist, taken)?;
            let t_wait = waited.elapsed().as_secs_f64();
            let step = version + 1;
            let lr = schedule.lr(step);
            let train_started = Instant::now();
            // The row reports the first, on-policy update.
            let updates = r.updates_per_batch as u64;
            let max_norm = cfg.training.max_grad_norm;
            let out = trainer.update(
                &taken.items,
                version,
                updates,
                lr,
                max_norm,
                &mut optimizer,
                &dist,
            )?;
            let next = match fsdp.is_some() || pp.is_some() {
                // The next step gathers the updated rows (stages) for its own rollouts.
                true => Params::default(),
                false => publishable(&trainer.all(), opts.perturb_rollout_weights)?,
            };
            buffer.publish(step, next);
            let t_train = train_started.elapsed().as_secs_f64();
            // The step's groups from every rank, in prompt order.
            let taken = if ranks > 1 {
                gather_taken(&dist, taken)?
            } else {
                taken
            };
            let groups: Vec<&Group> = taken.items.iter().map(|it| &it.value).collect();
            progress.record(step, lr, &groups);

            let since_last = last_row_time.elapsed().as_secs_f64();
            last_row_time = Instant::now();
            let mut row = RlRow::of_step(step, version, lr, &taken, &out, since_last);
            row.t_train = t_train;
            row.t_wait = t_wait;
            row.prompts_skipped = prompts_skipped;
            let eval_due = r.eval_freq > 0 && (step % r.eval_freq == 0 || step == total);
            if eval_due && (main || fsdp.is_some()) {
                let whole = whole_for_eval(&trainer.named, &trainer.params)?;
                if main {
                    row.eval_accuracy = eval(&whole, &held_out)?;
                    summary.eval_last = row.eval_accuracy;
                }
            }
            row.time = clock();
            if let Some((log, sample_log)) = &mut logs {
                log.write(&row).map_err(io_err(log.path()))?;
                sample_log.write(step, &taken.items)?;
            }
            if step % cfg.metrics.log_freq == 0 || step == total || row.eval_accuracy.is_some() {
                console.note(&row.console_line());
            }
            summary.steps = step;
            summary.rows.push(row);
            let elapsed = clock();
            if (tp.is_some() || pp.is_some())
                && dist.any(saver.as_ref().is_some_and(|s| s.due(step)))?
            {
                // Every rank of the group gathers; the lead writes.
                trainer.prepare_save(&optimizer, &dist)?;
            }
            if let Some(saver) = &mut saver {
                saver.save_if_due(step, &console, |spare| {
                    trainer.snapshot(cfg, &progress, &provenance, &optimizer, elapsed, spare)
                })?;
            }
            if let (Some(saver), Some(comm)) = (&mut shard_saver, dist.save_group()) {
                saver.step_end(step, comm, &console, |spare| {
                    trainer.snapshot(cfg, &progress, &provenance, &optimizer, elapsed, spare)
                })?;
            }
        }
        if dist.grads().size() > 1 {
            if let Some(digest) = dist.check_replicas(&trainer.named)? {
                console.note(&format!(
                    "replicas identical: parameter digest {digest:016x}"
                ));
            }
        }
        Ok(())
    })();
    buffer.close();
    for w in workers {
        let _ = w.join();
    }
    result?;
    if summary.stopped {
        // A stop saves the last step (see `Saver::finish`): gathered by the whole group.
        trainer.prepare_save(&optimizer, &dist)?;
    }
    let elapsed = clock();
    if let (Some(saver), Some(comm)) = (&mut shard_saver, dist.save_group()) {
        saver.finish(
            summary.stopped,
            progress.step,
            resumed.step,
            comm,
            &console,
            |spare| trainer.snapshot(cfg, &progress, &provenance, &optimizer, elapsed, spare),
        )?;
    }
    if let Some(saver) = &mut saver {
        saver.finish(
            summary.stopped,
            progress.step,
            resumed.step,
            &console,
            |spare| trainer.snapshot(cfg, &progress, &provenance, &optimizer, elapsed, spare),
        )?;
    }
    console.done(
        summary.stopped,
        summary.steps,
        started.elapsed().as_secs_f64(),
    );
    Ok(summary)
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
