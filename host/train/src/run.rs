//! The loop behind `anneal train`: resume, step, log, evaluate, checkpoint, stop on request.
//! In a data-parallel job every rank runs it; rank 0 alone holds the run directory (lock,
//! `config.toml`, `metrics.jsonl`) and publishes checkpoints: under DDP it saves them whole
//! (the replicas are identical), under FSDP / HSDP every rank of the first replica group writes
//! its own shard and rank 0 publishes the step once it has every rank's piece.

use crate::checkpoint::{load_dir_with, Contents};
use crate::harness::{resume_with, Resumed, RunDir, RunKind, Saver, ShardSaver};
use crate::metrics::{cpu_peak_tflops, measure_peak_tflops, Console, MetricsLog, MetricsRow};
use crate::parallel::dist::Dist;
use crate::{io_err, TrainError, Trainer};
use anneal_config::JobConfig;
use anneal_dist::led_by_rank0;
use anneal_engine::alloc;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSummary {
    /// Steps completed.
    pub steps: u64,
    /// The step this process resumed from (0 for a fresh start).
    pub resumed_from: u64,
    /// Loss of the last step.
    pub last_loss: Option<f64>,
    /// The last held-out loss.
    pub last_val_loss: Option<f64>,
    /// Whether a stop request ended the run early.
    pub stopped: bool,
}

/// Trains `cfg` in `run_dir` until `training.steps` or until `stop` is set (which ends the run
/// after the current step, with a checkpoint). A run dir with checkpoints resumes from the
/// newest complete one. Holds the run dir for its lifetime (a second process is refused) and
/// writes `config.toml`, `tokenizer.json`, `metrics.jsonl` and `checkpoints/` there, the first
/// two only once a resume was accepted.
pub fn run(cfg: &JobConfig, run_dir: &Path, stop: &AtomicBool) -> Result<RunSummary, TrainError> {
    run_dist(cfg, run_dir, stop, &anneal_dist::Single::new())
}

/// [`run`] as one rank of the job whose world is `world` (`anneal_dist::init`): the mesh comes
/// from `[parallelism]`; every rank must call it.
pub fn run_dist(
    cfg: &JobConfig,
    run_dir: &Path,
    stop: &AtomicBool,
    world: &dyn anneal_dist::Collective,
) -> Result<RunSummary, TrainError> {
    let started = Instant::now();
    let cfg = &crate::harness::with_model_plugin(&crate::harness::with_hf_start(cfg)?)?;
    let dist = Dist::new(cfg, world)?;
    let (main, ranks) = (world.rank() == 0, world.size());
    // A run dir another process holds is refused before anything loads; what else can be
    // refused cheaply is, before any expensive work (a start refused here leaves no run dir it
    // made, see `RunDir`).
    let run = if main {
        Some(RunDir::open(run_dir)?)
    } else {
        None
    };
    let checked = crate::preflight::train(cfg, ranks)?;
    let total = cfg.training.steps;
    let mut console = Console::new(total, 0, cfg.metrics.progress_bar && main);
    console.note(&format!("run dir: {}", run_dir.display()));
    if ranks > 1 {
        console.note(&format!(
            "distributed: rank {} of {ranks}; mesh {}",
            world.rank(),
            dist.mesh().describe()
        ));
    }
    if let crate::BatchSplit::Rows { rows } = dist.batch_split() {
        console.note(&format!(
            "data parallel: the {} micro-batch(es) of a step do not split over the {} data-parallel ranks, so each rank trains on {rows} of the {} rows of every one",
            cfg.training.batch_size / cfg.training.micro_batch_size,
            dist.size(),
            cfg.training.micro_batch_size
        ));
    }
    // Rank 0 builds (and caches) the tokenizer and the tokenized corpus before the others
    // read them, so no two processes write one cache file; if it fails, so do they.
    if !main {
        led_by_rank0(world, Ok::<_, TrainError>(()))?;
    }
    let trainer = Trainer::from_preflight(cfg, dist, checked, &|m| console.note(m));
    let mut trainer = match main {
        true => led_by_rank0(world, trainer)?,
        false => trainer?,
    };
    if let Some(path) = trainer.start_device_collectives()? {
        console.note(&path);
    }
    let provenance = trainer.provenance().clone();
    // A sharded rank reads just its rows of the checkpoint, never the whole model.
    let contents = match trainer.is_sharded() {
        true => Contents::OnDemand,
        false => Contents::All,
    };
    let resumed = match &run {
        Some(run) => resume_with(
            cfg,
            run,
            RunKind::Train,
            &provenance,
            &console,
            contents,
            |l| trainer.restore(l),
        )
        .and_then(|resumed| {
            run.record(cfg, trainer.tokenizer().1, trainer.run_files())?;
            Ok(resumed)
        }),
        None => Ok(Resumed::default()),
    };
    // A checkpoint rank 0 refuses fails every rank.
    let resumed = led_by_rank0(world, resumed)?;
    // The other ranks continue from the checkpoint rank 0 accepted (after its checks).
    let resumed = if ranks > 1 {
        let step = trainer.dist().broadcast_u64(resumed.step, 0)?;
        if !main && step > 0 {
            let dir = run_dir.join("checkpoints").join(format!("step-{step}"));
            console.note(&format!("resuming from {} (step {step})", dir.display()));
            // Rank 0 has verified it; the others read their rows without hashing it again.
            let trusted = match contents {
                Contents::All => Contents::All,
                _ => Contents::Trusted,
            };
            trainer.restore(load_dir_with(&dir, trusted)?)?;
        }
        Resumed { step, ..resumed }
    } else {
        resumed
    };
    let (resumed_from, elapsed_before) = (resumed.step, resumed.elapsed_s);
    // Metric times continue across restarts of the same run.
    let clock = |now: Instant| elapsed_before + now.duration_since(started).as_secs_f64();
    console.set_start(resumed_from);
    let peak = if cfg.metrics.peak_tflops > 0.0 {
        cfg.metrics.peak_tflops
    } else if let anneal_engine::Device::Cuda(ordinal) = trainer.device() {
        // The host's peak says nothing of a GPU's: the GPU's own datasheet peak where it is
        // known, else no MFU unless metrics.peak_tflops says it.
        anneal_engine::cuda::probe(ordinal)
            .ok()
            .and_then(|info| crate::metrics::gpu_peak_tflops(&info.name))
            .unwrap_or(0.0)
    } else {
        cpu_peak_tflops().unwrap_or_else(measure_peak_tflops)
    };
    console.note(&format!(
        "training steps {}..={total} of {} x {} tokens; MFU against {peak:.3} TFLOP/s",
        resumed_from + 1,
        cfg.training.batch_size,
        cfg.training.seq_len
    ));
    // Under FSDP / HSDP the ranks of the first replica group each save their own shard (under
    // pipeline parallelism each stage its parameters) and rank 0 publishes; otherwise rank 0
    // saves the whole (the replicas are identical).
    let mut shard_saver = match trainer.dist().save_group() {
        Some(group) => Some(ShardSaver::for_group(cfg, run_dir, group)?),
        None => None,
    };
    let mut saver = match shard_saver {
        Some(_) => None,
        None => run.as_ref().map(|run| Saver::new(cfg, run)),
    };
    let mut log = match main {
        true => Some(MetricsLog::open(run_dir).map_err(io_err(run_dir))?),
        false => None,
    };
    let (log_freq, eval_freq) = (cfg.metrics.log_freq, cfg.metrics.eval_freq);
    let (mut window_tokens, mut window_seconds) = (0u64, 0f64);
    let mut summary = RunSummary {
        steps: trainer.step(),
        resumed_from,
        last_loss: None,
        last_val_loss: None,
        stopped: false,
    };
    // On a GPU run the device pool's peak: what limits the batch there.
    let device = trainer.device();
    alloc::reset_peak_on(device);
    while trainer.step() < total {
        // Ranks see a signal at different steps; they stop together.
        if trainer.dist().any(stop.load(Ordering::SeqCst))? {
            summary.stopped = true;
            console.note(&format!(
                "stop requested: ending after step {}",
                trainer.step()
            ));
            break;
        }
        let out = trainer.train_step()?;
        window_tokens += out.tokens;
        window_seconds += out.seconds;
        summary.steps = out.step;
        summary.last_loss = Some(out.loss);
        let last = out.step == total;
        let log_now = out.step % log_freq == 0 || last;
        let eval_now = eval_freq > 0 && (out.step % eval_freq == 0 || last);
        if log_now || eval_now {
            let mut row = MetricsRow {
                step: out.step,
                tokens: trainer.tokens(),
                ..Default::default()
            };
            if log_now {
                let tps = window_tokens as f64 / window_seconds.max(1e-9);
                let tflops = tps * trainer.flops_per_token() / 1e12;
                row.loss = Some(out.loss);
                row.grad_norm = Some(out.grad_norm);
                row.lr = Some(out.lr);
                row.tokens_per_s = Some(tps);
                row.tflops = Some(tflops);
                row.mfu = (peak > 0.0).then(|| tflops / peak);
                // The peak of the busiest rank (a collective: every rank logs the same steps).
                let peak = alloc::peak_bytes_on(device) as u64;
                row.mem_peak_bytes = Some(trainer.dist().max_u64(peak)?);
                row.comm_bytes = out.comm_bytes;
                row.state_bytes = out.state_bytes;
                row.aux_loss = out.aux_loss;
                row.outputs = out.outputs.clone();
                (window_tokens, window_seconds) = (0, 0.0);
                alloc::reset_peak_on(device);
            }
            // Sharded (or pipelined) parameters, or sequences split over cp ranks, need every
            // rank for evaluation; otherwise rank 0 evaluates alone.
            if eval_now && (main || trainer.is_sharded() || trainer.dist().cp().is_some()) {
                let eval = trainer.evaluate_full()?;
                let val_loss = eval.map(|e| e.loss);
                if main {
                    row.val_loss = val_loss;
                    row.eval_accuracy = eval.and_then(|e| e.accuracy);
                    if let Some(m) = eval.and_then(|e| e.margin) {
                        // Preference pairs: the held-out chosen-vs-rejected margin.
                        row.outputs.insert("val_margin".into(), m.into());
                    }
                    summary.last_val_loss = val_loss.or(summary.last_val_loss);
                }
            }
            row.time = clock(Instant::now());
            if let Some(log) = &mut log {
                log.write(&row).map_err(io_err(log.path()))?;
            }
            console.row(&row);
        }
        let elapsed = clock(Instant::now());
        if let (Some(saver), Some(comm)) = (&mut shard_saver, trainer.dist().save_group()) {
            if saver.due(out.step) {
                trainer.prepare_save()?;
            }
            saver.step_end(out.step, comm, &console, |spare| {
                trainer.snapshot(elapsed, spare)
            })?;
        }
        if let Some(saver) = &mut saver {
            saver.save_if_due(out.step, &console, |spare| trainer.snapshot(elapsed, spare))?;
        }
        console.progress(out.step);
    }
    if ranks > 1 && device != anneal_engine::Device::Cpu {
        // What the collectives still copy through host memory (0 once all run on device).
        let staged = anneal_engine::staged::staged_bytes();
        let steps = (summary.steps - resumed_from).max(1);
        console.note(&format!(
            "collectives: {staged} bytes staged through host memory on this rank ({} per step)",
            staged / steps
        ));
    }
    if ranks > 1 {
        if let Some(digest) = trainer.check_replicas()? {
            console.note(&format!(
                "replicas identical: parameter digest {digest:016x}"
            ));
        }
        if let Some(digest) = trainer.check_buffers()? {
            console.note(&format!(
                "buffers identical on every rank: digest {digest:016x}"
            ));
        }
    }
    let elapsed = clock(Instant::now());
    if let (Some(saver), Some(comm)) = (&mut shard_saver, trainer.dist().save_group()) {
        // A stopped run saves its last step here; the gather is cheap beside it.
        trainer.prepare_save()?;
        saver.finish(
            summary.stopped,
            trainer.step(),
            resumed_from,
            comm,
            &console,
            |spare| trainer.snapshot(elapsed, spare),
        )?;
    }
    if let Some(saver) = &mut saver {
        saver.finish(
            summary.stopped,
            trainer.step(),
            resumed_from,
            &console,
            |spare| trainer.snapshot(elapsed, spare),
        )?;
    }
    console.done(
        summary.stopped,
        summary.steps,
        started.elapsed().as_secs_f64(),
    );
    Ok(summary)
}
