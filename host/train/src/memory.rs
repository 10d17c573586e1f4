//! The memory a run will need, estimated from the model's spec before any parameter is
//! allocated, and the check that refuses a run that cannot fit in the machine.
//!
//! What is counted (a documented, deliberately conservative formula; the engine's measured peak
//! is logged as `mem_peak_bytes` to compare against):
//! - **parameters**: every declared parameter's elements × 4 bytes: training keeps f32 master
//!   weights even of a model declared in bf16 (compute runs in `training.dtype`);
//! - **gradients**: the same again (a gradient has its parameter's shape and dtype);
//! - **optimizer state**: the optimizer plugin's state tensors per parameter × elements × 4 bytes
//!   (state is kept in f32; AdamW keeps 2, SGD with momentum 1);
//! - **activations** of one micro-batch (`B × T` tokens, f32): for every matrix parameter
//!   `[out, in]` its input and output (`in + out` values per token), for every vector parameter
//!   `[d]` (norms) `2·d`, all times 2 for the elementwise intermediates between the matrices
//!   (RoPE, SwiGLU, residuals, attention statistics) and the gradients live during backward;
//!   plus `3·V` per token for the logits, their softmax and its gradient. A block recomputed in
//!   backward keeps only its input (the smallest input width of its matrices) until one block at
//!   a time is recomputed.
//! - for `anneal rl`: the published copies of the weights (one per version a rollout may use,
//!   `max_staleness + 1`), the KL reference when `kl_coef > 0`, and the rollouts' KV cache;
//!   sequences are taken as `training.seq_len` prompt tokens plus `rl.max_new_tokens` (prompt
//!   lengths are known only after tokenizing), over `prompts_per_step × group_size` rows.
//!
//! Not counted: the tokenized corpus, checkpoint snapshots, the allocator's cache of freed
//! blocks (the factor 2 above leaves room for them on the models this runs).

use crate::TrainError;
use anneal_config::{parse_device, DeviceName, JobConfig, RecomputeMode};
use anneal_engine::DType;
use anneal_plugin_api::spec::ModelSpec;
use anneal_runtime::plugins::{find, PluginOptimizer};
use std::path::Path;

/// Which command's memory to estimate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// `anneal train`: one micro-batch of `training.micro_batch_size × training.seq_len`.
    Train,
    /// `anneal rl`: rollouts and one trainer batch of `prompts_per_step × group_size` rows.
    Rl,
}

/// An estimate in bytes, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// The trained parameters.
    pub parameters: u64,
    /// Their gradients.
    pub gradients: u64,
    /// The optimizer's state.
    pub optimizer: u64,
    /// Activations kept for backward (and, for RL, the rollouts' KV cache).
    pub activations: u64,
    /// RL only: published weight versions and the KL reference.
    pub weight_copies: u64,
}

impl MemoryEstimate {
    /// Everything together.
    pub fn total(&self) -> u64 {
        [
            self.parameters,
            self.gradients,
            self.optimizer,
            self.activations,
            self.weight_copies,
        ]
        .iter()
        .fold(0u64, |a, b| a.saturating_add(*b))
    }
}

impl std::fmt::Display for MemoryEstimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (parameters {}, gradients {}, optimizer state {}, activations {}",
            human(self.total()),
            human(self.parameters),
            human(self.gradients),
            human(self.optimizer),
            human(self.activations)
        )?;
        if self.weight_copies > 0 {
            write!(f, ", weight copies {}", human(self.weight_copies))?;
        }
        f.write_str(")")
    }
}

/// How much memory the run may use, and where that figure came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Available {
    /// Bytes.
    pub bytes: u64,
    /// `MemAvailable`, `cgroup memory.max`, `training.memory_limit_mb`.
    pub source: String,
}

/// `bytes` as `12.3 GiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn elements(shape: &[usize]) -> u64 {
    shape.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64))
}

/// Activation values per token of the parameters `params` (see the module docs), before the
/// factor for elementwise intermediates.
fn values_per_token<'a>(params: impl Iterator<Item = &'a [usize]>) -> u64 {
    params.fold(0u64, |acc, shape| {
        let v = match shape {
            [out, inp] => (*out as u64).saturating_add(*inp as u64),
            [d] => 2 * *d as u64,
            // Stacked experts `[E, out, in]`: a token passes through a few of them, not all
            // (counted as two: the spec does not say the router's k).
            [_, out, inp] => 2 * (*out as u64).saturating_add(*inp as u64),
            other => elements(other),
        };
        acc.saturating_add(v)
    })
}

/// Estimates the memory of `workload` for a model with `spec`, an optimizer keeping
/// `optimizer_states` f32 tensors per parameter, and the batch and recompute settings of `cfg`.
pub fn estimate(
    spec: &ModelSpec,
    optimizer_states: usize,
    cfg: &JobConfig,
    workload: Workload,
) -> MemoryEstimate {
    let mut parameters = 0u64;
    for p in &spec.params {
        // f32 masters of low-precision floats; other dtypes (integer buffers) as declared.
        let size = DType::parse(&p.dtype).map_or(4, |d| d.size_in_bytes().max(4)) as u64;
        parameters = parameters.saturating_add(elements(&p.shape).saturating_mul(size));
    }
    let numel = spec
        .params
        .iter()
        .fold(0u64, |a, p| a.saturating_add(elements(&p.shape)));
    let optimizer = numel.saturating_mul(4 * optimizer_states as u64);
    let t = &cfg.training;
    let (rows, seq) = match workload {
        Workload::Train => (t.micro_batch_size as u64, t.seq_len as u64),
        // An episode runs to `rl.max_episode_tokens` (0: the context); one completion to
        // its prompt and `rl.max_new_tokens`.
        Workload::Rl if !cfg.rl.environment.is_empty() => (
            (cfg.rl.prompts_per_step * cfg.rl.group_size) as u64,
            match cfg.rl.max_episode_tokens {
                0 => spec.max_seq_len,
                n => n.min(spec.max_seq_len),
            } as u64,
        ),
        Workload::Rl => (
            (cfg.rl.prompts_per_step * cfg.rl.group_size) as u64,
            (t.seq_len + cfg.rl.max_new_tokens).min(spec.max_seq_len) as u64,
        ),
    };
    let tokens = rows.saturating_mul(seq);
    let f32_bytes = 4u64;
    let factor = 2u64;
    // Outside the blocks: embeddings, final norm, head, and the loss over the vocabulary.
    let outside = values_per_token(
        spec.params
            .iter()
            .filter(|p| p.layer.is_none())
            .map(|p| p.shape.as_slice()),
    )
    .saturating_mul(factor)
    .saturating_add(3 * spec.vocab_size as u64);
    // The RL trainer's forward recomputes as training's does.
    let recompute_every = match cfg.activation_checkpoint.mode {
        RecomputeMode::None => 0,
        RecomputeMode::Full => 1,
        RecomputeMode::Selective => cfg.activation_checkpoint.every,
        // The budget plan is measured at startup; here its kept bytes are the budget's share
        // of what no recompute keeps (below), plus one recomputed block.
        RecomputeMode::Budget => 0,
    };
    let budget = match cfg.activation_checkpoint.mode {
        RecomputeMode::Budget => Some(cfg.activation_checkpoint.memory_budget.clamp(0.0, 1.0)),
        _ => None,
    };
    let mut kept = outside;
    let mut largest_recomputed = 0u64;
    for i in 0..spec.n_layers {
        let shapes = || {
            spec.params
                .iter()
                .filter(move |p| p.layer == Some(i))
                .map(|p| p.shape.as_slice())
        };
        let block = values_per_token(shapes()).saturating_mul(factor);
        if recompute_every > 0 && i % recompute_every == 0 {
            let input = shapes()
                .filter_map(|s| match s {
                    [_, inp] => Some(*inp as u64),
                    _ => None,
                })
                .min()
                .unwrap_or(0);
            kept = kept.saturating_add(input);
            largest_recomputed = largest_recomputed.max(block);
        } else if let Some(b) = budget {
            kept = kept.saturating_add((block as f64 * b).ceil() as u64);
            largest_recomputed = largest_recomputed.max(block);
        } else {
            kept = kept.saturating_add(block);
        }
    }
    let per_token = kept.saturating_add(largest_recomputed);
    let mut activations = per_token.saturating_mul(tokens).saturating_mul(f32_bytes);
    let mut weight_copies = 0;
    if workload == Workload::Rl {
        // K and V of every attention layer for every row of a step's rollouts.
        let kv: u64 = spec
            .kv_cache
            .iter()
            .flatten()
            .map(|(heads, dim)| 2 * (*heads as u64) * (*dim as u64))
            .sum();
        activations =
            activations.saturating_add(kv.saturating_mul(tokens).saturating_mul(f32_bytes));
        let copies = cfg.rl.max_staleness.saturating_add(1) + u64::from(cfg.rl.kl_coef > 0.0);
        weight_copies = parameters.saturating_mul(copies);
    }
    MemoryEstimate {
        parameters,
        gradients: parameters,
        optimizer,
        activations,
        weight_copies,
    }
}

/// The number of f32 state tensors per parameter the configured optimizer keeps (it creates an
/// instance, which allocates nothing, and asks its spec).
pub fn optimizer_states(cfg: &JobConfig) -> Result<usize, TrainError> {
    let plugin = find(&cfg.optimizer.plugin)?;
    let args = serde_json::Value::Object(cfg.optimizer.args.clone());
    let optimizer = PluginOptimizer::new(plugin.name(), plugin.create(None, &args)?)?;
    Ok(optimizer.spec().state.len())
}

/// Memory this process may use: the configured limit; else, for a job on a GPU (whose
/// parameters, gradients, optimizer state and activations all live there), the GPU's memory;
/// else the smaller of `MemAvailable` and what the cgroup's limit leaves. `None` when none can
/// be read (the check is then skipped).
pub fn available(cfg: &JobConfig) -> Option<Available> {
    let limit_mb = cfg.training.memory_limit_mb;
    if limit_mb > 0 {
        return Some(Available {
            bytes: limit_mb.saturating_mul(1 << 20),
            source: "training.memory_limit_mb".into(),
        });
    }
    if let Some(DeviceName::Cuda(named)) = parse_device(&cfg.job.device) {
        // `cuda` is this rank's GPU; an unusable one is refused later, naming the reason.
        let ordinal = match cfg.job.device.as_str() {
            "cuda" => match crate::device::rank_device(anneal_engine::backend::cuda_device_count())
            {
                anneal_engine::Device::Cuda(n) => n,
                anneal_engine::Device::Cpu => named,
            },
            _ => named,
        };
        return anneal_engine::cuda::probe(ordinal)
            .ok()
            .map(|info| Available {
                bytes: info.total_mem as u64,
                source: format!("the memory of cuda:{ordinal} ({})", info.name),
            });
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| mem_available(&t))
        .map(|bytes| Available {
            bytes,
            source: "MemAvailable".into(),
        });
    let cgroup = cgroup_room(Path::new("/sys/fs/cgroup")).map(|bytes| Available {
        bytes,
        source: "the cgroup's memory limit".into(),
    });
    match (meminfo, cgroup) {
        (Some(m), Some(c)) => Some(if c.bytes < m.bytes { c } else { m }),
        (m, c) => m.or(c),
    }
}

/// `MemAvailable` of `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb.saturating_mul(1024))
}

/// What the memory cgroup of this process leaves: its limit minus what it uses that cannot be
/// reclaimed (usage less inactive file cache). Reads cgroup v2 (`memory.max`) or v1
/// (`memory/memory.limit_in_bytes`) under `root`; `None` without a limit.
fn cgroup_room(root: &Path) -> Option<u64> {
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let own = read(Path::new("/proc/self/cgroup")).unwrap_or_default();
    let v2_path = own.lines().find_map(|l| l.strip_prefix("0::"));
    let v1_path = own.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    });
    // Inside a cgroup namespace the process's own cgroup is mounted at the root.
    let candidates = |base: &Path, own: Option<&str>| {
        let mut v = Vec::new();
        if let Some(p) = own {
            v.push(base.join(p.trim_start_matches('/')));
        }
        v.push(base.to_path_buf());
        v
    };
    for dir in candidates(root, v2_path) {
        if let Some(limit) = read(&dir.join("memory.max")) {
            let used = read(&dir.join("memory.current"));
            let stat = read(&dir.join("memory.stat")).unwrap_or_default();
            return room(&limit, used.as_deref(), &stat, "inactive_file");
        }
    }
    for dir in candidates(&root.join("memory"), v1_path) {
        if let Some(limit) = read(&dir.join("memory.limit_in_bytes")) {
            let used = read(&dir.join("memory.usage_in_bytes"));
            let stat = read(&dir.join("memory.stat")).unwrap_or_default();
            return room(&limit, used.as_deref(), &stat, "total_inactive_file");
        }
    }
    None
}

/// `limit − (used − inactive file cache)`, from the text of cgroup files; `None` for `max` or a
/// v1 "unlimited" value (which is near `i64::MAX`).
fn room(limit: &str, used: Option<&str>, stat: &str, inactive_key: &str) -> Option<u64> {
    let limit: u64 = limit.trim().parse().ok()?;
    if limit >= 1 << 60 {
        return None;
    }
    let used: u64 = used.and_then(|u| u.trim().parse().ok()).unwrap_or(0);
    let inactive: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix(inactive_key)?.trim().parse().ok())
        .unwrap_or(0);
    Some(limit.saturating_sub(used.saturating_sub(inactive)))
}

/// Refuses a run whose estimate exceeds the memory available to it (unless
/// `training.skip_memory_check`). Call it after the model's spec is known and before any
/// parameter is allocated.
pub fn check(cfg: &JobConfig, spec: &ModelSpec, workload: Workload) -> Result<(), TrainError> {
    if cfg.training.skip_memory_check {
        return Ok(());
    }
    let Some(avail) = available(cfg) else {
        return Ok(());
    };
    let estimate = estimate(spec, optimizer_states(cfg)?, cfg, workload);
    refuse_above(&estimate, &avail)
}

/// The refusal itself, separated so that it can be tested with any figures.
fn refuse_above(estimate: &MemoryEstimate, avail: &Available) -> Result<(), TrainError> {
    if estimate.total() <= avail.bytes {
        return Ok(());
    }
    Err(TrainError::Config(format!(
        "memory: the run needs about {estimate} but {} is available ({}); shrink the model (model.args) or the batch, or set training.memory_limit_mb / training.skip_memory_check = true",
        human(avail.bytes),
        avail.source
    )))
}

/// The line `anneal config show` prints: the estimate and what is available, or why there is
/// no estimate.
pub fn describe(cfg: &JobConfig, workload: Workload) -> String {
    let spec = crate::harness::model_plugin_name(cfg)
        .and_then(|name| Ok(find(&name)?))
        .and_then(|p| {
            let args = serde_json::Value::Object(cfg.model.args.clone());
            let inst = p.create(Some(&cfg.model.flavor), &args)?;
            Ok(anneal_runtime::plugins::PluginModel::new(p.name(), inst)?)
        });
    let estimate = spec.and_then(|m| Ok(estimate(m.spec(), optimizer_states(cfg)?, cfg, workload)));
    match estimate {
        Ok(e) => {
            let avail = available(cfg).map_or("unknown".into(), |a| {
                format!("{} ({})", human(a.bytes), a.source)
            });
            format!("{e}; available: {avail}")
        }
        Err(e) => format!("unavailable ({e})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::spec::{Init, ParamSpec};

    fn param(name: &str, shape: &[usize], layer: Option<usize>) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: "f32".into(),
            init: Init::Zeros,
            placement: Default::default(),
            layer,
            hf: None,
            trainable: true,
        }
    }

    /// Embedding [10, 4], one block with a norm [4] and a matrix [8, 4], head [10, 4].
    fn spec() -> ModelSpec {
        ModelSpec {
            active_params: None,
            architecture: "test".into(),
            n_layers: 1,
            vocab_size: 10,
            max_seq_len: 16,
            flops_per_token: 0.0,
            context_flops_per_token: 0.0,
            params: vec![
                param("emb", &[10, 4], None),
                param("l.norm", &[4], Some(0)),
                param("l.w", &[8, 4], Some(0)),
                param("out", &[10, 4], None),
            ],
            kv_cache: vec![Some((2, 2))],
            hf: None,
            parallel: Default::default(),
        }
    }

    fn cfg(mode: RecomputeMode) -> JobConfig {
        let mut c = JobConfig::default();
        c.training.micro_batch_size = 2;
        c.training.seq_len = 8;
        c.activation_checkpoint.mode = mode;
        c
    }

    #[test]
    fn counts_parameters_state_and_activations_by_the_documented_formula() {
        let e = estimate(&spec(), 2, &cfg(RecomputeMode::None), Workload::Train);
        let numel = 40 + 4 + 32 + 40;
        assert_eq!(e.parameters, numel * 4);
        assert_eq!(e.gradients, numel * 4);
        assert_eq!(e.optimizer, numel * 4 * 2);
        // Outside: (10+4)·2 ·2 + 3·10 = 86; block: (2·4 + 8+4)·2 = 40; 16 tokens, f32.
        assert_eq!(e.activations, (86 + 40) * 16 * 4);
        assert_eq!(e.weight_copies, 0);
        // Recomputing the block keeps its input (4) and one block at a time (40).
        let r = estimate(&spec(), 2, &cfg(RecomputeMode::Full), Workload::Train);
        assert_eq!(r.activations, (86 + 4 + 40) * 16 * 4);
    }

    #[test]
    fn rl_counts_weight_copies_and_the_kv_cache() {
        let mut c = cfg(RecomputeMode::None);
        c.rl.prompts_per_step = 2;
        c.rl.group_size = 3;
        c.rl.max_new_tokens = 4;
        c.rl.max_staleness = 1;
        c.rl.kl_coef = 0.1;
        let e = estimate(&spec(), 1, &c, Workload::Rl);
        // 6 rows × min(8 + 4, 16) = 72 tokens; KV: 2·2·2 = 8 values per token.
        assert_eq!(e.activations, (126 + 8) * 72 * 4);
        assert_eq!(e.weight_copies, e.parameters * 3);
        // Episodes run to `max_episode_tokens`: 6 rows × 10 tokens.
        c.rl.environment = "env.wasm".into();
        c.rl.max_episode_tokens = 10;
        let episodes = estimate(&spec(), 1, &c, Workload::Rl);
        assert_eq!(episodes.activations, (126 + 8) * 60 * 4);
        // The RL trainer recomputes as training does: the block's input (4) and one block
        // at a time (40) beside what is outside the blocks (86).
        c.activation_checkpoint.mode = RecomputeMode::Full;
        let recomputed = estimate(&spec(), 1, &c, Workload::Rl);
        assert_eq!(recomputed.activations, (86 + 4 + 40 + 8) * 60 * 4);
    }

    #[test]
    fn huge_shapes_saturate_instead_of_overflowing() {
        let mut s = spec();
        s.params
            .push(param("huge", &[usize::MAX, usize::MAX], Some(0)));
        let e = estimate(&s, 2, &cfg(RecomputeMode::None), Workload::Train);
        assert_eq!(e.total(), u64::MAX);
    }

    #[test]
    fn a_run_above_the_limit_is_refused_with_both_figures() {
        let e = MemoryEstimate {
            parameters: 3 << 30,
            gradients: 3 << 30,
            optimizer: 6 << 30,
            activations: 1 << 30,
            weight_copies: 0,
        };
        let avail = Available {
            bytes: 8 << 30,
            source: "MemAvailable".into(),
        };
        let msg = refuse_above(&e, &avail).unwrap_err().to_string();
        assert!(
            msg.contains("13.0 GiB") && msg.contains("8.0 GiB") && msg.contains("MemAvailable"),
            "{msg}"
        );
        assert!(!msg.contains('\n'));
        let roomy = Available {
            bytes: 13 << 30,
            source: "x".into(),
        };
        assert!(refuse_above(&e, &roomy).is_ok());
    }

    #[test]
    fn reads_meminfo_and_cgroup_files() {
        let meminfo = "MemTotal:  24684084 kB\nMemFree: 1 kB\nMemAvailable:   22822976 kB\n";
        assert_eq!(mem_available(meminfo), Some(22_822_976 * 1024));
        assert_eq!(room("max\n", Some("100"), "", "inactive_file"), None);
        assert_eq!(
            room(
                "9223372036854771712\n",
                Some("5"),
                "",
                "total_inactive_file"
            ),
            None
        );
        let stat = "anon 10\ninactive_file 300\nactive_file 5\n";
        assert_eq!(
            room("1000\n", Some("500\n"), stat, "inactive_file"),
            Some(800)
        );
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(12), "12 B");
    }
}
