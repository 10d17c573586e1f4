//! The devices a plan is for and the step-time estimate: FLOPs over the device's peak, the
//! pipeline's idle share, and the counted bytes over the bandwidth of the link each mesh
//! dimension's group spans (no overlap of compute and communication: an upper bound on the
//! communication part, a lower bound on the compute part).

use super::comm::CommPlan;
use super::layout::RankView;
use anneal_config::JobConfig;
use anneal_plugin_api::spec::ModelSpec;
use serde::Serialize;

/// GPUs per machine joined by NVLink (an HGX board).
const GPUS_PER_NODE: usize = 8;
/// Bytes per second between processes on one CPU machine (MPI over shared memory), a
/// conservative constant.
const CPU_LINK: f64 = 5e9;
/// The f32 TFLOP/s a CPU rank is taken at when the clock cannot be read.
const CPU_FALLBACK_TFLOPS: f64 = 0.05;

/// The device a plan is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// NVIDIA H100 SXM (80 GB).
    H100,
    /// NVIDIA H200 SXM (141 GB): the H100's compute with more memory.
    H200,
    /// This machine's CPU.
    Cpu,
}

impl std::str::FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "h100" => Ok(DeviceKind::H100),
            "h200" => Ok(DeviceKind::H200),
            "cpu" => Ok(DeviceKind::Cpu),
            other => Err(format!("unknown device '{other}'; pick h200, h100 or cpu")),
        }
    }
}

/// One device's figures.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceFigures {
    /// Its name.
    pub name: String,
    /// Dense TFLOP/s at the run's dtype.
    pub tflops: f64,
    /// Memory per device, bytes (`None` where unknown).
    pub memory_bytes: Option<u64>,
    /// Bytes per second within a machine (NVLink per direction; CPU: shared memory).
    pub intra_bps: f64,
    /// Bytes per second between machines (InfiniBand per GPU).
    pub inter_bps: f64,
}

/// The figures of `kind` for `cfg`'s dtype and processes.
pub fn figures(kind: DeviceKind, cfg: &JobConfig, processes: usize) -> DeviceFigures {
    let bf16 = matches!(cfg.training.dtype.as_str(), "bfloat16" | "bf16");
    // H100 SXM: 989 TFLOP/s dense bf16, 495 TF32 (what f32 matrix products run at).
    let gpu = |name: &str, gb: u64| DeviceFigures {
        name: name.into(),
        tflops: if bf16 { 989.0 } else { 494.5 },
        memory_bytes: Some(gb * 1_000_000_000),
        intra_bps: 450e9,
        inter_bps: 50e9,
    };
    match kind {
        DeviceKind::H100 => gpu("H100", 80),
        DeviceKind::H200 => gpu("H200", 141),
        DeviceKind::Cpu => {
            let threads = anneal_engine::num_threads().max(1) as f64;
            let per_rank = crate::cpu_peak_tflops().map(|all| {
                let t = cfg.training.threads;
                if t > 0 {
                    all / threads * t as f64
                } else {
                    all / processes.max(1) as f64
                }
            });
            DeviceFigures {
                name: "cpu".into(),
                tflops: per_rank.unwrap_or(CPU_FALLBACK_TFLOPS),
                memory_bytes: crate::memory::available(cfg).map(|a| a.bytes),
                intra_bps: CPU_LINK,
                inter_bps: CPU_LINK,
            }
        }
    }
}

/// The step-time estimate.
#[derive(Clone, Debug, Serialize)]
pub struct TimePlan {
    /// The device's name.
    pub device: String,
    /// Its figures.
    pub figures: DeviceFigures,
    /// FLOPs per step, all ranks (`flops_per_token × batch_size × seq_len`).
    pub flops: f64,
    /// Compute at the device's peak, each rank doing its share.
    pub compute_s: f64,
    /// The pipeline's idle time (`(pp − 1) / (v·m)` of the compute).
    pub bubble_s: f64,
    /// Rank 0's counted bytes over its links.
    pub comm_s: f64,
    /// All three.
    pub step_s: f64,
    /// Tokens per second of the job.
    pub tokens_per_s: f64,
    /// Whether the busiest rank's peak fits the device's memory (`None` where unknown).
    pub fits: Option<bool>,
    /// What the estimate assumes.
    pub assumptions: Vec<String>,
}

/// The stride of mesh dimension `dim` (`tp` innermost, row-major `pp, dp_replicate,
/// dp_shard, cp, ep, tp`; `ep` borrows `dp_shard`'s ranks) and its group's span in ranks.
fn span(v: &RankView, dim: &str) -> usize {
    let d = v.degrees;
    match dim {
        "tp" => d.tp,
        "cp" => d.cp * d.tp,
        // An expert group: `ep` consecutive `dp_shard` ranks of one `cp` coordinate.
        "ep" => d.ep * d.cp * d.tp,
        // The gradient group: dp_replicate × dp_shard × cp.
        "dp" => d.dp_replicate * d.dp_shard * d.cp * d.tp,
        "pp" => d.pp * d.dp() * d.cp * d.tp,
        _ => d.processes(),
    }
}

/// Estimates a step of `cfg` on `kind` (see the module docs).
pub fn estimate(
    cfg: &JobConfig,
    spec: &ModelSpec,
    v: &RankView,
    comm: &CommPlan,
    kind: DeviceKind,
) -> TimePlan {
    let d = v.degrees;
    let processes = d.processes();
    let fig = figures(kind, cfg, processes);
    let tokens = (cfg.training.batch_size * cfg.training.seq_len) as f64;
    let flops = spec.flops_per_token_at(cfg.training.seq_len) * tokens;
    let compute_s = flops / (processes as f64 * fig.tflops * 1e12);
    let virtual_stages = cfg.parallelism.pp_virtual_stages.max(1) as f64;
    let bubble_s = if d.pp > 1 {
        compute_s * (d.pp as f64 - 1.0) / (virtual_stages * v.micro_batches.max(1) as f64)
    } else {
        0.0
    };
    let comm_s: f64 = comm
        .by_dim
        .iter()
        .map(|(dim, bytes)| {
            let bps = if span(v, dim) <= GPUS_PER_NODE {
                fig.intra_bps
            } else {
                fig.inter_bps
            };
            *bytes as f64 / bps
        })
        .sum();
    let step_s = compute_s + bubble_s + comm_s;
    let assumptions = vec![
        format!(
            "step time: {:.3e} FLOPs per token (the spec's, attention at seq_len {}) x {} tokens over {} rank(s) at {:.1} TFLOP/s each ({}), no overlap of compute and communication",
            spec.flops_per_token_at(cfg.training.seq_len),
            cfg.training.seq_len,
            tokens as u64,
            processes,
            fig.tflops,
            match kind {
                DeviceKind::Cpu if crate::cpu_peak_tflops().is_some() =>
                    "this CPU's f32 peak from its clock and SIMD level, shared by the ranks".to_string(),
                DeviceKind::Cpu => format!("a conservative {CPU_FALLBACK_TFLOPS} TFLOP/s: the clock is unknown"),
                _ if matches!(cfg.training.dtype.as_str(), "bfloat16" | "bf16") => "dense bf16 peak".into(),
                _ => "dense TF32 peak: training.dtype is float32".into(),
            }
        ),
        match kind {
            DeviceKind::Cpu => format!("links: {:.0} GB/s between processes (shared memory, a conservative constant)", CPU_LINK / 1e9),
            _ => format!(
                "links: NVLink {:.0} GB/s per direction for groups within {GPUS_PER_NODE} GPUs, InfiniBand {:.0} GB/s per GPU beyond; the counted bytes over that bandwidth",
                fig.intra_bps / 1e9,
                fig.inter_bps / 1e9
            ),
        },
    ];
    TimePlan {
        device: fig.name.clone(),
        fits: None,
        figures: fig,
        flops,
        compute_s,
        bubble_s,
        comm_s,
        step_s,
        tokens_per_s: tokens / step_s.max(1e-12),
        assumptions,
    }
}
