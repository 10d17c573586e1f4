//! The steps of an RL run, each a short sequence of named phases: the step's rollouts, the
//! trainer's updates, publishing the new policy, the row and samples written, evaluation and
//! saving; and the end of the run (the last save).

use super::{gather_taken, RlSummary};
use crate::buffer::{RolloutBuffer, Taken};
use crate::checkpoint::Progress;
use crate::metrics::RlRow;
use crate::rollout::{evaluate, rollout_round, Group, Prompt, RolloutCtx};
use crate::samples::SampleLog;
use crate::trainer::{publishable, RlTrainer};
use anneal_config::JobConfig;
use anneal_engine::Tensor;
use anneal_runtime::plugins::{Params, PluginOptimizer};
use anneal_train::harness::{Provenance, Saver, ShardSaver};
use anneal_train::{io_err, Console, Dist, LrSchedule, MetricsLog, TrainError};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Where a run's checkpoints go: this rank's rows (the first replica's ranks under FSDP, as
/// `anneal train` saves FSDP), or whole tensors from the lead (one process, TP, PP, CP, TP ×
/// FSDP).
pub(super) struct Savers {
    pub shard: Option<ShardSaver>,
    pub whole: Option<Saver>,
}

/// One run's state between steps, beside the trainer and the optimizer.
pub(super) struct RlLoop<'a> {
    pub cfg: &'a JobConfig,
    pub dist: &'a Dist,
    pub console: &'a Console,
    pub provenance: &'a Provenance,
    pub ctx: Arc<RolloutCtx>,
    pub buffer: Arc<RolloutBuffer<Group, Params>>,
    /// Groups this rank rolls out per step.
    pub per_rank: usize,
    /// Data-parallel ranks.
    pub ranks: usize,
    /// This rank evaluates (see `Roles::main`).
    pub main: bool,
    /// A context-parallel follower: it takes its group's first rank's rollouts.
    pub cp_follower: bool,
    /// See `RlOptions::perturb_rollout_weights`.
    pub perturb: f32,
    pub schedule: LrSchedule,
    pub progress: Progress,
    /// Prompts left out for not fitting the context, counted in every row when some were.
    pub prompts_skipped: Option<u64>,
    /// The held-out prompts (on `main` ranks with evaluation on).
    pub held_out: Option<Vec<Prompt>>,
    /// `metrics.jsonl` and `samples.jsonl` (the lead's).
    pub logs: Option<(MetricsLog, SampleLog)>,
    pub savers: Savers,
    pub summary: RlSummary,
    /// Seconds of the run before this process, and when this process started.
    pub clock: (f64, Instant),
    pub last_row: Instant,
}

impl RlLoop<'_> {
    /// Seconds of the run so far (metric times continue across restarts of the same run).
    fn elapsed(&self) -> f64 {
        self.clock.0 + self.clock.1.elapsed().as_secs_f64()
    }

    /// The steps from the resumed one to `training.steps`, or until `stop` (seen by any rank:
    /// they stop together); then the replicas' digest check. Collective over the job.
    pub fn run(
        &mut self,
        trainer: &mut RlTrainer,
        optimizer: &mut PluginOptimizer,
        stop: &AtomicBool,
    ) -> Result<(), TrainError> {
        let total = self.cfg.training.steps;
        for version in self.summary.resumed_from..total {
            if self.dist.any(stop.load(Ordering::SeqCst))? {
                let note = format!("stop requested: ending after step {version}");
                self.console.note(&note);
                self.summary.stopped = true;
                break;
            }
            self.step(trainer, optimizer, version)?;
        }
        if self.dist.grads().size() > 1 {
            if let Some(digest) = self.dist.check_replicas(&trainer.named)? {
                let note = format!("replicas identical: parameter digest {digest:016x}");
                self.console.note(&note);
            }
        }
        Ok(())
    }

    /// One step on policy `version`: its rollouts, the updates, the new policy published, the
    /// row written, evaluation and saving when due.
    fn step(
        &mut self,
        trainer: &mut RlTrainer,
        optimizer: &mut PluginOptimizer,
        version: u64,
    ) -> Result<(), TrainError> {
        let waited = Instant::now();
        let taken = self.rollouts(trainer, version)?;
        let t_wait = waited.elapsed().as_secs_f64();
        let step = version + 1;
        let lr = self.schedule.lr(step);
        let train_started = Instant::now();
        let r = &self.cfg.rl;
        let (updates, max_norm) = (r.updates_per_batch as u64, self.cfg.training.max_grad_norm);
        let items = &taken.items;
        let out = trainer.update(items, version, updates, lr, max_norm, optimizer, self.dist)?;
        let next = match trainer.fsdp.is_some() || trainer.pp.is_some() {
            // The next step gathers the updated rows (stages) for its own rollouts.
            true => Params::default(),
            false => publishable(&trainer.all(), self.perturb)?,
        };
        self.buffer.publish(step, next);
        let t_train = train_started.elapsed().as_secs_f64();
        // The step's groups from every rank, in prompt order.
        let taken = match self.ranks > 1 {
            true => gather_taken(self.dist, taken)?,
            false => taken,
        };
        let groups: Vec<&Group> = taken.items.iter().map(|it| &it.value).collect();
        self.progress.record(step, lr, &groups);
        let since_last = self.last_row.elapsed().as_secs_f64();
        self.last_row = Instant::now();
        // The row reports the first, on-policy update.
        let mut row = RlRow::of_step(step, version, lr, &taken, &out, since_last);
        (row.t_train, row.t_wait) = (t_train, t_wait);
        row.prompts_skipped = self.prompts_skipped;
        let total = self.cfg.training.steps;
        let eval_freq = r.eval_freq;
        if eval_freq > 0 && (step.is_multiple_of(eval_freq) || step == total) {
            if let Some(acc) = self.evaluate(trainer)? {
                row.eval_accuracy = Some(acc);
                self.summary.eval_last = Some(acc);
            }
        }
        row.time = self.elapsed();
        self.write_row(row, Some((step, &taken)))?;
        self.save_if_due(trainer, optimizer, step)
    }

    /// This step's rollouts as the layout makes them (gathered rows or stages decoded on this
    /// thread, a tensor-parallel group decoding together, or the workers' batches), taken from
    /// the buffer; a context-parallel group's first rank's, shared with its followers.
    fn rollouts(&self, trainer: &mut RlTrainer, version: u64) -> Result<Taken<Group>, TrainError> {
        let (ctx, buffer, n) = (&self.ctx, &self.buffer, self.per_rank);
        if trainer.fsdp.is_some() {
            trainer.sharded_rollout_round(self.dist, ctx, buffer, version, n, self.perturb)?;
        } else if let Some(pp) = trainer.pp {
            pp.rollout_round(trainer, ctx, buffer, version, n, self.perturb)?;
        } else if trainer.tp.is_some() {
            // Synchronous (max_staleness 0): this step's rollouts with the current weights.
            rollout_round(ctx, buffer, n);
        }
        let taken = match self.cp_follower {
            true => None,
            false => Some(buffer.take(n, version).ok_or_else(|| {
                let failed = ctx.failed.lock().unwrap_or_else(|e| e.into_inner()).clone();
                TrainError::Rollout(failed.unwrap_or_else(|| "the rollout workers stopped".into()))
            })?),
        };
        crate::cp::share_taken(self.dist, taken)
    }

    /// The held-out accuracy of the current policy, made whole first (under FSDP every rank
    /// gathers it: a collective; under PP the stages are gathered); `None` on ranks that do
    /// not evaluate.
    fn evaluate(&self, trainer: &RlTrainer) -> Result<Option<f64>, TrainError> {
        if !self.main && trainer.fsdp.is_none() {
            return Ok(None);
        }
        let whole = whole_policy(self.dist, trainer, &trainer.named, &trainer.params)?;
        match (&self.held_out, self.main) {
            (Some(p), true) => Ok(Some(evaluate(&self.ctx, &whole, p)?)),
            _ => Ok(None),
        }
    }

    /// The row before any training (step 0) with the starting policy's held-out accuracy,
    /// when a fresh run evaluates. Collective under FSDP.
    pub fn evaluate_start(&mut self, trainer: &RlTrainer) -> Result<(), TrainError> {
        let evaluates =
            self.held_out.is_some() || (trainer.fsdp.is_some() && self.cfg.rl.eval_freq > 0);
        if self.summary.resumed_from > 0 || !evaluates {
            return Ok(());
        }
        if let Some(acc) = self.evaluate(trainer)? {
            let row = RlRow {
                eval_accuracy: Some(acc),
                time: self.elapsed(),
                prompts_skipped: self.prompts_skipped,
                ..Default::default()
            };
            self.console
                .note(&format!("step      0  eval_accuracy {acc:.3}"));
            (self.summary.eval_first, self.summary.eval_last) = (Some(acc), Some(acc));
            self.write_row(row, None)?;
        }
        Ok(())
    }

    /// Writes `row` (and a step's samples) to the lead's logs, prints it when due and keeps it
    /// in the summary.
    fn write_row(
        &mut self,
        row: RlRow,
        step: Option<(u64, &Taken<Group>)>,
    ) -> Result<(), TrainError> {
        if let Some((log, sample_log)) = &mut self.logs {
            log.write(&row).map_err(io_err(log.path()))?;
            if let Some((step, taken)) = step {
                sample_log.write(step, &taken.items)?;
            }
        }
        if let Some((step, _)) = step {
            let total = self.cfg.training.steps;
            let due = step.is_multiple_of(self.cfg.metrics.log_freq) || step == total;
            if due || row.eval_accuracy.is_some() {
                self.console.note(&row.console_line());
            }
            self.summary.steps = step;
        }
        self.summary.rows.push(row);
        Ok(())
    }

    /// Saves `step` when due: under TP or PP the group first gathers what the lead writes.
    fn save_if_due(
        &mut self,
        trainer: &mut RlTrainer,
        optimizer: &PluginOptimizer,
        step: u64,
    ) -> Result<(), TrainError> {
        let elapsed = self.elapsed();
        let due = self.savers.whole.as_ref().is_some_and(|s| s.due(step));
        if (trainer.tp.is_some() || trainer.pp.is_some()) && self.dist.any(due)? {
            // Every rank of the group gathers; the lead writes.
            trainer.prepare_save(optimizer, self.dist)?;
        }
        let (cfg, progress, provenance) = (self.cfg, &self.progress, self.provenance);
        if let Some(saver) = &mut self.savers.whole {
            saver.save_if_due(step, self.console, |spare| {
                trainer.snapshot(cfg, progress, provenance, optimizer, elapsed, spare)
            })?;
        }
        if let (Some(saver), Some(comm)) = (&mut self.savers.shard, self.dist.save_group()) {
            saver.step_end(step, comm, self.console, |spare| {
                trainer.snapshot(cfg, progress, provenance, optimizer, elapsed, spare)
            })?;
        }
        Ok(())
    }

    /// The end of the run: a stop saves its last step (gathered by the whole group), and the
    /// savers write what is still due. Returns the run's summary.
    pub fn finish(
        mut self,
        trainer: &mut RlTrainer,
        optimizer: &PluginOptimizer,
    ) -> Result<RlSummary, TrainError> {
        let s = &self.summary;
        if s.stopped {
            trainer.prepare_save(optimizer, self.dist)?;
        }
        let (stopped, last, resumed) = (s.stopped, self.progress.step, s.resumed_from);
        let elapsed = self.elapsed();
        let (cfg, progress, provenance) = (self.cfg, &self.progress, self.provenance);
        if let (Some(saver), Some(comm)) = (&mut self.savers.shard, self.dist.save_group()) {
            saver.finish(stopped, last, resumed, comm, self.console, |spare| {
                trainer.snapshot(cfg, progress, provenance, optimizer, elapsed, spare)
            })?;
        }
        if let Some(saver) = &mut self.savers.whole {
            saver.finish(stopped, last, resumed, self.console, |spare| {
                trainer.snapshot(cfg, progress, provenance, optimizer, elapsed, spare)
            })?;
        }
        let secs = self.clock.1.elapsed().as_secs_f64();
        self.console.done(stopped, self.summary.steps, secs);
        Ok(self.summary)
    }
}

/// The whole policy for an evaluation: under FSDP gathered from every rank's rows (a
/// collective), under PP from the stages, otherwise `params` itself.
fn whole_policy(
    dist: &Dist,
    trainer: &RlTrainer,
    names: &[(String, Tensor)],
    params: &Params,
) -> Result<Params, TrainError> {
    match (trainer.fsdp, trainer.pp) {
        (Some(f), _) => f.gather_map(dist, names, params),
        (None, Some(pp)) => pp.whole_params(params),
        (None, None) => Ok(params.clone()),
    }
}

/// The lead's `metrics.jsonl` and `samples.jsonl`.
pub(super) fn open_logs(
    run_dir: &Path,
    cfg: &JobConfig,
    ctx: &RolloutCtx,
) -> Result<(MetricsLog, SampleLog), TrainError> {
    Ok((
        MetricsLog::open(run_dir).map_err(io_err(run_dir))?,
        SampleLog::open(run_dir, &cfg.rl, ctx.prompts.clone())?,
    ))
}
