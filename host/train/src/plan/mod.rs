//! `anneal plan`: what a run will hold and send per rank, computed from the config, the model's
//! spec and the optimizer's spec before anything is allocated (no weights are drawn or loaded;
//! a 671B spec plans in milliseconds).
//!
//! - [`layout`]: which parameters a rank holds and at which size (pipeline stages, tensor-
//!   parallel slices, FSDP rows), the batch each rank trains on;
//! - [`comm`]: the bytes a rank hands to collectives per step, as `comm_bytes` counts them (an
//!   all-reduce its buffer once, an all-gather its send, a reduce-scatter its whole input,
//!   sends their bytes), by kind;
//! - [`memory`]: per-rank parameters, gradients, optimizer state, activations and buffers, and
//!   the peak the allocator will report (`mem_peak_bytes`);
//! - [`moe`]: a mixture of experts' layers, experts, top-k and statistics, from the spec;
//! - [`device`]: the device table (H100, H200, this CPU) and the step-time estimate.
//!
//! The figures are rank 0's for communication (what `metrics.jsonl` logs) and the busiest
//! rank's for memory (`mem_peak_bytes` is the job's maximum).

pub mod comm;
pub mod device;
pub mod layout;
pub mod memory;
pub mod moe;

use crate::preflight::Degrees;
use crate::TrainError;
use anneal_config::JobConfig;
use anneal_plugin_api::spec::{ModelSpec, OptimizerSpec};
use serde::Serialize;

pub use comm::CommPlan;
pub use device::{DeviceKind, TimePlan};
pub use layout::RankView;
pub use memory::MemoryPlan;

/// Everything a plan is computed from.
pub struct PlanInput<'a> {
    /// The resolved job config.
    pub cfg: &'a JobConfig,
    /// The model's spec (shapes, placements, layers, FLOPs per token).
    pub spec: &'a ModelSpec,
    /// The optimizer's spec (its state tensors per parameter).
    pub optimizer: &'a OptimizerSpec,
    /// The job's processes.
    pub processes: usize,
    /// The device the estimate is for.
    pub device: DeviceKind,
}

/// A run's plan: per-rank memory, per-step communication and the estimated step time.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// The model's architecture name.
    pub model: String,
    /// Its trained parameters, all ranks together.
    pub parameters_total: u64,
    /// The mesh's degrees.
    pub mesh: Degrees,
    /// The job's processes.
    pub processes: usize,
    /// Micro-batches each data-parallel rank trains on per step.
    pub local_micro_batches: usize,
    /// Tokens in each of them on one rank (`rows × seq_len / cp`).
    pub tokens_per_micro_batch: usize,
    /// Memory of the busiest rank.
    pub memory: MemoryPlan,
    /// Rank 0's communication per step.
    pub comm: CommPlan,
    /// The estimated step time.
    pub time: TimePlan,
    /// What the figures assume, in words.
    pub assumptions: Vec<String>,
}

/// Plans the run `input` describes. Refuses what a run would refuse before any work: the mesh
/// against the processes and the batch, the pipeline split, the tensor-parallel splits, the
/// context against the model (errors name the key).
pub fn plan(input: &PlanInput<'_>) -> Result<Plan, TrainError> {
    let cfg = input.cfg;
    let degrees = crate::preflight::layout(cfg, input.processes)?;
    let t = &cfg.training;
    if t.seq_len > input.spec.max_seq_len {
        return Err(TrainError::Config(format!(
            "config: `training.seq_len`: {} is longer than the model's max_seq_len {}; lower training.seq_len or raise model.args.max_seq_len",
            t.seq_len, input.spec.max_seq_len
        )));
    }
    if degrees.tp > 1 {
        // The tensor-parallel checks a run makes (the model's support, its splits; experts
        // may be split by both `tp` and `ep`, which the views below place).
        crate::parallel::tp::TpLayout::new(cfg, input.spec, 0, degrees.tp)?;
    }
    let views = layout::views(cfg, input.spec, degrees, input.processes)?;
    let comm = comm::plan(cfg, input.spec, &views[0]);
    let memory = memory::plan(cfg, input.spec, input.optimizer, &views);
    let mut time = device::estimate(cfg, input.spec, &views[0], &comm, input.device);
    time.fits = time.figures.memory_bytes.map(|b| memory.peak <= b);
    let parameters_total = input
        .spec
        .params
        .iter()
        .filter(|p| p.trainable)
        .map(|p| p.shape.iter().product::<usize>() as u64)
        .sum();
    let mut assumptions = memory::assumptions(cfg, &views[0]);
    assumptions.extend(comm::assumptions(cfg, input.spec, &views[0]));
    assumptions.extend(time.assumptions.iter().cloned());
    Ok(Plan {
        model: input.spec.architecture.clone(),
        parameters_total,
        mesh: degrees,
        processes: input.processes,
        local_micro_batches: views[0].micro_batches,
        tokens_per_micro_batch: views[0].tokens,
        memory,
        comm,
        time,
        assumptions,
    })
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::memory::human;
        let m = &self.mesh;
        writeln!(
            f,
            "model {} ({:.2}B trained parameters) on {} process(es): pp {} × dp_replicate {} × dp_shard {} × cp {} × tp {} (ep {})",
            self.model,
            self.parameters_total as f64 / 1e9,
            self.processes,
            m.pp,
            m.dp_replicate,
            m.dp_shard,
            m.cp,
            m.tp,
            m.ep
        )?;
        writeln!(
            f,
            "per rank: {} micro-batch(es) of {} tokens per step",
            self.local_micro_batches, self.tokens_per_micro_batch
        )?;
        let mem = &self.memory;
        writeln!(f, "\nmemory per rank (pipeline rank {}):", mem.rank)?;
        for (what, bytes) in [
            ("parameters", mem.parameters),
            ("gradients", mem.gradients),
            ("optimizer state", mem.optimizer),
            ("activations", mem.activations),
            ("buffers", mem.buffers),
        ] {
            writeln!(f, "  {what:<18} {:>12}  ({bytes} B)", human(bytes))?;
        }
        writeln!(
            f,
            "  {:<18} {:>12}  ({} B)",
            "peak",
            human(mem.peak),
            mem.peak
        )?;
        if let (Some(fits), Some(cap)) = (self.time.fits, self.time.figures.memory_bytes) {
            let verdict = if fits { "fits" } else { "does NOT fit" };
            writeln!(
                f,
                "  {verdict} in {} of {} memory",
                human(cap),
                self.time.device
            )?;
        }
        writeln!(
            f,
            "\ncommunication per step (rank 0, as comm_bytes counts it):"
        )?;
        for (kind, bytes) in &self.comm.kinds {
            writeln!(f, "  {kind:<22} {:>12}  ({bytes} B)", human(*bytes))?;
        }
        writeln!(
            f,
            "  {:<22} {:>12}  ({} B)",
            "total",
            human(self.comm.total),
            self.comm.total
        )?;
        let t = &self.time;
        writeln!(f, "\nstep time on {} (estimate):", t.device)?;
        writeln!(f, "  compute        {:>10.4} s", t.compute_s)?;
        writeln!(f, "  pipeline idle  {:>10.4} s", t.bubble_s)?;
        writeln!(f, "  communication  {:>10.4} s", t.comm_s)?;
        writeln!(
            f,
            "  step           {:>10.4} s  ({:.0} tokens/s)",
            t.step_s, t.tokens_per_s
        )?;
        writeln!(f, "\nassumptions:")?;
        for a in &self.assumptions {
            writeln!(f, "  - {a}")?;
        }
        Ok(())
    }
}
