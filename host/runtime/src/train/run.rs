//! The loop behind `anneal train`: step, log, evaluate, stop on request.

use super::metrics::{measure_peak_tflops, Console, MetricsLog, MetricsRow};
use super::{io_err, TrainError, Trainer};
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
    /// Loss of the last step.
    pub last_loss: Option<f64>,
    /// The last held-out loss.
    pub last_val_loss: Option<f64>,
    /// Whether a stop request ended the run early.
    pub stopped: bool,
}

/// Statistics of the steps since the last logged row.
#[derive(Default)]
struct Window {
    tokens: u64,
    seconds: f64,
}

/// Trains `cfg` in `run_dir` (created if needed; the resolved config is written there as
/// `config.toml` and metrics appended to `metrics.jsonl`) until `training.steps` or until `stop`
/// is set, which ends the run after the current step.
pub fn run(cfg: &JobConfig, run_dir: &Path, stop: &AtomicBool) -> Result<RunSummary, TrainError> {
    let started = Instant::now();
    std::fs::create_dir_all(run_dir).map_err(io_err(run_dir))?;
    let config_path = run_dir.join("config.toml");
    std::fs::write(&config_path, cfg.to_toml()).map_err(io_err(&config_path))?;
    let total = cfg.training.steps;
    let console = Console::new(total, 0, cfg.metrics.progress_bar);
    console.note(&format!("run dir: {}", run_dir.display()));
    let mut trainer = Trainer::new(cfg, &|m| console.note(m))?;
    let peak = if cfg.metrics.peak_tflops > 0.0 {
        cfg.metrics.peak_tflops
    } else {
        measure_peak_tflops()
    };
    console.note(&format!(
        "training {total} steps of {} x {} tokens; MFU against {peak:.3} TFLOP/s",
        cfg.training.batch_size, cfg.training.seq_len
    ));
    let mut log = MetricsLog::open(run_dir).map_err(io_err(run_dir))?;
    let (log_freq, eval_freq) = (cfg.metrics.log_freq, cfg.metrics.eval_freq);
    let mut window = Window::default();
    let mut summary = RunSummary {
        steps: trainer.step(),
        last_loss: None,
        last_val_loss: None,
        stopped: false,
    };
    let mut tokens_total = 0u64;
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
        window.tokens += out.tokens;
        window.seconds += out.seconds;
        tokens_total += out.tokens;
        summary.steps = out.step;
        summary.last_loss = Some(out.loss);
        let last = out.step == total;
        let log_now = out.step % log_freq == 0 || last;
        let eval_now = eval_freq > 0 && (out.step % eval_freq == 0 || last);
        if log_now || eval_now {
            let mut row = MetricsRow {
                step: out.step,
                tokens: tokens_total,
                ..Default::default()
            };
            if log_now {
                let tps = window.tokens as f64 / window.seconds.max(1e-9);
                let tflops = tps * trainer.flops_per_token() / 1e12;
                row.loss = Some(out.loss);
                row.grad_norm = Some(out.grad_norm);
                row.lr = Some(out.lr);
                row.tokens_per_s = Some(tps);
                row.tflops = Some(tflops);
                row.mfu = (peak > 0.0).then(|| tflops / peak);
                row.mem_peak_bytes = Some(alloc::memory_stats().peak_bytes as u64);
                window = Window::default();
                alloc::reset_peak();
            }
            if eval_now {
                row.val_loss = trainer.evaluate()?;
                summary.last_val_loss = row.val_loss.or(summary.last_val_loss);
            }
            row.time = started.elapsed().as_secs_f64();
            log.write(&row).map_err(io_err(log.path()))?;
            console.row(&row);
        }
        console.progress(out.step);
    }
    console.finish();
    console.note(&format!(
        "{} after step {} ({:.1}s)",
        if summary.stopped { "stopped" } else { "done" },
        summary.steps,
        started.elapsed().as_secs_f64()
    ));
    Ok(summary)
}
