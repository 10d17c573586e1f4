//! What a run reports: one JSON row per logged step in `<run_dir>/metrics.jsonl` (and the same
//! values as TensorBoard scalars in `<run_dir>/events.out.tfevents.*`), a line on the terminal,
//! and a progress bar when stderr is a terminal.

use crate::tensorboard::{self, EventWriter};
use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// One row of `metrics.jsonl`. Training rows carry the step statistics; evaluation rows carry
/// `val_loss` (and the training fields of the same step when both are logged together).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct MetricsRow {
    /// Optimizer steps completed.
    pub step: u64,
    /// Mean training loss of the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Global gradient norm before clipping.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Learning rate used by the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Training tokens per second since the previous row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Achieved TFLOP/s (model FLOPs, forward + backward).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tflops: Option<f64>,
    /// Model FLOPs utilization: `tflops / peak`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// Peak bytes held by tensors since the previous row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_peak_bytes: Option<u64>,
    /// Bytes this rank handed to collectives in the logged step (multi-process runs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_bytes: Option<u64>,
    /// Bytes of parameters, gradients and optimizer state rank 0 holds after the step (FSDP
    /// divides them by `dp_shard`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_bytes: Option<u64>,
    /// Held-out loss.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Chat data: the share of held-out conversations whose replies greedy decoding writes
    /// exactly.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    /// Weighted sum of the model's auxiliary losses (part of the loss trained on, not of
    /// `loss`), when it returns any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// The model's auxiliary losses (`aux_loss.<name>`) and named statistics, by name.
    #[serde(flatten)]
    pub outputs: std::collections::BTreeMap<String, serde_json::Value>,
    /// Tokens trained on so far.
    pub tokens: u64,
    /// Seconds since the run (or this resumed process) started.
    pub time: f64,
}

/// Appends rows to `metrics.jsonl`, flushing each, so readers (the web UI, a crash) see whole
/// rows only.
pub struct MetricsLog {
    path: PathBuf,
    file: File,
    events: EventWriter,
}

impl MetricsLog {
    /// Opens (appending) `<run_dir>/metrics.jsonl`, and starts a new TensorBoard event file in
    /// `run_dir` ([`crate::tensorboard`]).
    pub fn open(run_dir: &Path) -> std::io::Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        let events = EventWriter::create(run_dir)?;
        Ok(MetricsLog { path, file, events })
    }

    /// Where the rows go.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one row (a [`MetricsRow`], or an RL run's row) as one line, with the wall-clock
    /// time it was written (`wall_time`, seconds since the Unix epoch), and its numeric fields as
    /// TensorBoard scalars at its `step`.
    pub fn write<R: Serialize>(&mut self, row: &R) -> std::io::Result<()> {
        let mut value = serde_json::to_value(row).expect("metrics rows always serialize");
        if let serde_json::Value::Object(fields) = &mut value {
            fields.insert("wall_time".into(), tensorboard::unix_seconds().into());
        }
        let mut line = value.to_string();
        line.push('\n');
        self.file.write_all(line.as_bytes())?;
        self.file.flush()?;
        let step = value.get("step").and_then(|s| s.as_u64()).unwrap_or(0);
        self.events.scalars(step, &tensorboard::scalars_of(&value))
    }
}

/// The f32 peak of the CPU threads the engine computes with, in TFLOP/s: threads × FLOPs per
/// cycle of the SIMD level in use (two FMA pipes: 64 with AVX-512, 32 with AVX2, 8 otherwise) ×
/// the clock from `/proc/cpuinfo`. `None` where the clock is unknown.
pub fn cpu_peak_tflops() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz = info
        .lines()
        .filter(|l| l.starts_with("cpu MHz"))
        .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
        .fold(0.0, f64::max);
    if mhz <= 0.0 {
        return None;
    }
    let per_cycle = match anneal_engine::simd_level() {
        anneal_engine::SimdLevel::Avx512 => 64.0,
        anneal_engine::SimdLevel::Avx2 => 32.0,
        anneal_engine::SimdLevel::Baseline => 8.0,
    };
    Some(anneal_engine::num_threads() as f64 * per_cycle * mhz * 1e6 / 1e12)
}

/// The dense bf16 peak of a GPU the driver names `name`, in TFLOP/s, from the vendor's
/// datasheets (the SXM parts; `None` for a GPU not listed, whose MFU then needs
/// `metrics.peak_tflops`). MFU on a GPU is against bf16 whatever `training.dtype` is, as is
/// customary.
pub fn gpu_peak_tflops(name: &str) -> Option<f64> {
    const PEAKS: [(&str, f64); 6] = [
        ("H100", 989.0),
        ("H200", 989.0),
        ("H800", 989.0),
        ("A100", 312.0),
        ("A800", 312.0),
        ("L40S", 362.0),
    ];
    PEAKS
        .iter()
        .find(|(model, _)| name.split([' ', '-']).any(|w| w == *model))
        .map(|&(_, peak)| peak)
}

/// Measures the machine's f32 matmul throughput (TFLOP/s) with the engine on all its threads:
/// the best of a few 1024³ products. Used as the MFU denominator when none is configured.
pub fn measure_peak_tflops() -> f64 {
    use anneal_engine::{DType, Tensor};
    let n = 1024;
    let a = Tensor::ones(&[n, n], DType::F32);
    let b = Tensor::ones(&[n, n], DType::F32);
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        if a.matmul(&b).is_err() {
            return 0.0;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best / 1e12
}

/// The terminal side: a log line per row and a one-line progress bar (`indicatif`) on a
/// terminal; lines print above the bar.
pub struct Console {
    bar: Option<indicatif::ProgressBar>,
}

impl Console {
    /// A console for a run of `total` steps starting after `start_step`; the bar shows only when
    /// `bar` is set and stderr is a terminal.
    pub fn new(total: u64, start_step: u64, bar: bool) -> Self {
        let bar = (bar && std::io::stderr().is_terminal()).then(|| {
            let style =
                indicatif::ProgressStyle::with_template("[{bar:30}] {pos}/{len} eta {eta_precise}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                    .progress_chars("#>-");
            let b = indicatif::ProgressBar::with_draw_target(
                Some(total),
                indicatif::ProgressDrawTarget::stderr(),
            )
            .with_style(style);
            b.set_position(start_step);
            b
        });
        Console { bar }
    }

    /// Counts ETA from `step` (after a resume): the steps before it took no time here.
    pub fn set_start(&mut self, step: u64) {
        if let Some(b) = &self.bar {
            b.set_position(step);
            b.reset_eta();
        }
    }

    /// Prints one row as a line (clearing the bar first).
    pub fn row(&self, r: &MetricsRow) {
        let mut s = format!("step {:>6}", r.step);
        let mut field = |name: &str, v: Option<String>| {
            if let Some(v) = v {
                s.push_str(&format!("  {name} {v}"));
            }
        };
        field("loss", r.loss.map(|v| format!("{v:.4}")));
        field("val_loss", r.val_loss.map(|v| format!("{v:.4}")));
        field("eval_accuracy", r.eval_accuracy.map(|v| format!("{v:.3}")));
        let output = |k: &str| r.outputs.get(k).and_then(serde_json::Value::as_f64);
        field(
            "val_margin",
            output("val_margin").map(|v| format!("{v:.3}")),
        );
        field(
            "pref_margin",
            output("pref_margin").map(|v| format!("{v:.3}")),
        );
        field("grad_norm", r.grad_norm.map(|v| format!("{v:.3}")));
        field("lr", r.lr.map(|v| format!("{v:.2e}")));
        field("tok/s", r.tokens_per_s.map(|v| format!("{v:.0}")));
        field("TFLOP/s", r.tflops.map(|v| format!("{v:.3}")));
        field("mfu", r.mfu.map(|v| format!("{:.1}%", v * 100.0)));
        field(
            "mem",
            r.mem_peak_bytes
                .map(|v| format!("{:.0}MiB", v as f64 / (1 << 20) as f64)),
        );
        field(
            "comm",
            r.comm_bytes
                .map(|v| format!("{:.1}MiB", v as f64 / (1 << 20) as f64)),
        );
        self.note(&s);
    }

    /// Any other message, on its own line (above the bar).
    pub fn note(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.suspend(|| println!("{msg}")),
            None => println!("{msg}"),
        }
    }

    /// Moves the bar to `step`.
    pub fn progress(&self, step: u64) {
        if let Some(b) = &self.bar {
            b.set_position(step);
        }
    }

    /// Ends the run's output: the progress bar, then how the run ended after `steps` steps
    /// and `seconds`.
    pub fn done(&self, stopped: bool, steps: u64, seconds: f64) {
        self.finish();
        self.note(&format!(
            "{} after step {steps} ({seconds:.1}s)",
            if stopped { "stopped" } else { "done" }
        ));
    }

    /// Removes the bar at the end.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::gpu_peak_tflops;

    #[test]
    fn known_gpus_have_their_bf16_peak_and_others_none() {
        assert_eq!(gpu_peak_tflops("NVIDIA H200"), Some(989.0));
        assert_eq!(gpu_peak_tflops("NVIDIA H100 80GB HBM3"), Some(989.0));
        assert_eq!(gpu_peak_tflops("NVIDIA A100-SXM4-80GB"), Some(312.0));
        assert_eq!(gpu_peak_tflops("CUDA emulation on the CPU"), None);
        assert_eq!(gpu_peak_tflops("NVIDIA GeForce RTX 4090"), None);
    }
}
