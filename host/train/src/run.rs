//! The loop behind `anneal train`: resume, step, log, evaluate, checkpoint, stop on request.

use crate::harness::{resume, RunDir, RunKind, Saver};
use crate::metrics::{cpu_peak_tflops, measure_peak_tflops, Console, MetricsLog, MetricsRow};
use crate::{io_err, TrainError, Trainer};
use anneal_config::JobConfig;
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
    let started = Instant::now();
    let cfg = &crate::harness::with_model_plugin(cfg)?;
    let run = RunDir::open(run_dir)?;
    let total = cfg.training.steps;
    let mut console = Console::new(total, 0, cfg.metrics.progress_bar);
    console.note(&format!("run dir: {}", run_dir.display()));
    let mut trainer = Trainer::new(cfg, &|m| console.note(m))?;
    let provenance = trainer.provenance().clone();
    let resumed = resume(cfg, &run, RunKind::Train, &provenance, &console, |l| {
        trainer.restore(l)
    })?;
    run.record(cfg, trainer.tokenizer().1)?;
    let (resumed_from, elapsed_before) = (resumed.step, resumed.elapsed_s);
    // Metric times continue across restarts of the same run.
    let clock = |now: Instant| elapsed_before + now.duration_since(started).as_secs_f64();
    console.set_start(resumed_from);
    let peak = if cfg.metrics.peak_tflops > 0.0 {
        cfg.metrics.peak_tflops
    } else {
        cpu_peak_tflops().unwrap_or_else(measure_peak_tflops)
    };
    console.note(&format!(
        "training steps {}..={total} of {} x {} tokens; MFU against {peak:.3} TFLOP/s",
        resumed_from + 1,
        cfg.training.batch_size,
        cfg.training.seq_len
    ));
    let mut saver = Saver::new(cfg, &run);
    let mut log = MetricsLog::open(run_dir).map_err(io_err(run_dir))?;
    let (log_freq, eval_freq) = (cfg.metrics.log_freq, cfg.metrics.eval_freq);
    let (mut window_tokens, mut window_seconds) = (0u64, 0f64);
    let mut summary = RunSummary {
        steps: trainer.step(),
        resumed_from,
        last_loss: None,
        last_val_loss: None,
        stopped: false,
    };
    alloc::reset_peak();
    while trainer.step() < total {
        if stop.load(Ordering::SeqCst) {
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
                row.mem_peak_bytes = Some(alloc::memory_stats().peak_bytes as u64);
                row.aux_loss = out.aux_loss;
                row.outputs = out.outputs.clone();
                (window_tokens, window_seconds) = (0, 0.0);
                alloc::reset_peak();
            }
            if eval_now {
                row.val_loss = trainer.evaluate()?;
                summary.last_val_loss = row.val_loss.or(summary.last_val_loss);
            }
            row.time = clock(Instant::now());
            log.write(&row).map_err(io_err(log.path()))?;
            console.row(&row);
        }
        let elapsed = clock(Instant::now());
        saver.save_if_due(out.step, &console, |spare| trainer.snapshot(elapsed, spare))?;
        console.progress(out.step);
    }
    let elapsed = clock(Instant::now());
    saver.finish(
        summary.stopped,
        trainer.step(),
        resumed_from,
        &console,
        |spare| trainer.snapshot(elapsed, spare),
    )?;
    console.done(
        summary.stopped,
        summary.steps,
        started.elapsed().as_secs_f64(),
    );
    Ok(summary)
}
