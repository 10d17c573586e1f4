//! The bytes rank 0 hands to collectives in one training step, by kind, as the communicator's
//! counter (`comm_bytes` in `metrics.jsonl`) counts them: an all-reduce its buffer once, an
//! all-gather its send, a reduce-scatter its whole input, a send its bytes, a broadcast its
//! buffer at the root. Each figure follows what the trainer's code sends (see the functions
//! named beside each term).

use super::layout::{Outer, RankView};
use anneal_config::JobConfig;
use anneal_plugin_api::spec::{ModelSpec, TensorParallel};
use serde::Serialize;

/// A pipeline message's header (`pp/wire.rs`: 64 f32).
const PP_HEADER: u64 = 64 * 4;
/// The vocab-parallel cross-entropy's all-reduces per token (max, sum of exponentials, the
/// target's logit: one f32 each).
const TP_LOSS_PER_TOKEN: u64 = 12;

/// Rank 0's communication per step.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CommPlan {
    /// Bytes by kind, in the order a step sends them (kinds with no bytes left out).
    pub kinds: Vec<(String, u64)>,
    /// All of them: what `comm_bytes` logs.
    pub total: u64,
    /// Bytes by the mesh dimension they travel over (`tp`, `pp`, `cp`, `dp`), for the time
    /// estimate.
    pub by_dim: Vec<(String, u64)>,
}

impl CommPlan {
    fn add(&mut self, kind: &str, dim: &str, bytes: u64) {
        if bytes == 0 {
            return;
        }
        match self.kinds.iter_mut().find(|(k, _)| k == kind) {
            Some((_, b)) => *b += bytes,
            None => self.kinds.push((kind.to_string(), bytes)),
        }
        match self.by_dim.iter_mut().find(|(k, _)| k == dim) {
            Some((_, b)) => *b += bytes,
            None => self.by_dim.push((dim.to_string(), bytes)),
        }
        self.total += bytes;
    }

    /// The bytes of `kind` (0 when none).
    pub fn of(&self, kind: &str) -> u64 {
        self.kinds
            .iter()
            .find(|(k, _)| k == kind)
            .map_or(0, |(_, b)| *b)
    }
}

/// `dist::sum_identically` over `n` ranks of `len` f32: a reduce-scatter of the buffer padded
/// to a multiple of `n` (its whole input) and an all-gather of one block.
fn sum_identically(len: u64, n: usize) -> u64 {
    let n = n as u64;
    let padded = len.div_ceil(n) * n;
    padded * 4 + padded / n * 4
}

/// Rank 0's bytes per step (see the module docs).
pub fn plan(cfg: &JobConfig, spec: &ModelSpec, v: &RankView) -> CommPlan {
    let d = v.degrees;
    let mut c = CommPlan::default();
    let m = v.micro_batches as u64;
    let t = v.tokens as u64;
    let fsdp = v.fsdp > 1;
    if d.tp > 1 {
        tensor_parallel(&mut c, v, m, t);
    }
    if d.pp > 1 {
        pipeline(&mut c, v, m, t);
    }
    if d.cp > 1 {
        ring(&mut c, spec, v, m, t);
    }
    if let Some(moe) = &v.moe {
        experts(&mut c, moe, v, m, t);
    }
    let grads_group = d.dp() * d.cp;
    let held = v.trained().count() as u64;
    if grads_group > 1 {
        // `Dist::gather_f32` (or `cp.micro_batch_losses`) of the micro-batch losses, and
        // `StepOutputs::reduce_across`: micro-batch count, auxiliary total and the MoE
        // layers' statistics (the only statistics a spec tells of).
        let stats = v
            .moe
            .as_ref()
            .map_or(0, |moe| moe.output_floats(v.moe_layers()));
        c.add("losses and outputs", "dp", m * 4 + 8 + stats * 4);
        if fsdp {
            fsdp_traffic(&mut c, v, m);
            // `Fsdp::set_shard_grads`: a has-gradient flag per parameter over the gradient
            // group, then under HSDP the rows summed over the replicas in one buffer.
            c.add("gradient flags", "dp", held * 4);
            if d.dp_replicate > 1 {
                let rows: u64 = v.trained().map(|p| v.rows(p)).sum();
                c.add(
                    "dp gradient sum",
                    "dp",
                    sum_identically(rows, d.dp_replicate),
                );
            }
        } else {
            // `Dist::all_reduce_grads`: every gradient and a flag per parameter in one buffer.
            let len: u64 = v.trained().map(|p| p.numel()).sum::<u64>() + held;
            c.add("dp gradient sum", "dp", sum_identically(len, grads_group));
        }
    }
    // The gradient norm (`Placements::grad_norm`): one f64 per trained parameter of the
    // whole model, gathered over each axis that splits parameters (FSDP's, `tp`, `pp`).
    let axes = [d.dp_shard > 1, d.tp > 1, d.pp > 1]
        .into_iter()
        .filter(|&split| split)
        .count() as u64;
    c.add("norm sums", "dp", axes * v.all_trainable as u64 * 8);
    let _ = cfg;
    c
}

/// Tensor parallelism's collectives of rank 0's blocks, embedding and head over its micro-
/// batches (`engine/src/ops/tp.rs` through `runtime/src/plugins/ops_tp.rs`): without SP a
/// row-split linear all-reduces its output forward and the column-split linears before it
/// their shared input's gradient backward (`2·T·out` f32 per row-split weight); the vocab-split
/// embedding all-reduces its output, the head its input's gradient, the loss 12 bytes per
/// token. Under SP each all-reduce becomes a reduce-scatter (its whole input) and an
/// all-gather (a `1/tp` share), and the replicated parameters' partial gradients are summed
/// over the group once per step (`Placements::sum_partial_grads`, per-head weights always).
fn tensor_parallel(c: &mut CommPlan, v: &RankView, m: u64, t: u64) {
    let tp = v.degrees.tp as u64;
    let conv = |width: u64| -> u64 {
        let whole = t * width * 4;
        if v.sequence {
            whole + whole / tp
        } else {
            whole
        }
    };
    let mut per_mb = 0u64;
    let mut loss = false;
    for p in v.trained() {
        match (p.outer, p.split) {
            (None, Some(TensorParallel::Row)) => {
                let out = p.shape[p.shape.len() - 2] as u64;
                per_mb += 2 * conv(out);
            }
            (Some(Outer::Embedding), Some(_)) => per_mb += conv(p.shape[1] as u64),
            (Some(Outer::Head), Some(_)) => {
                per_mb += conv(p.shape[p.shape.len() - 1] as u64);
                loss = true;
            }
            _ => {}
        }
    }
    if loss {
        per_mb += TP_LOSS_PER_TOKEN * t;
    }
    c.add("tp collectives", "tp", m * per_mb);
    let replicated: u64 = v
        .trained()
        .filter(|p| p.split.is_none() && (v.sequence || p.per_head))
        .map(|p| v.rows(p))
        .sum();
    c.add("tp replicated gradient sum", "tp", replicated * 4);
}

/// The pipeline's sends from rank 0's stages (`pp/wire.rs`): per micro-batch, a stage that is
/// not the last sends its hidden tensor forward (a 64-f32 header and the payload), one that is
/// not the first sends the gradient of what it received back; after the schedule the losses
/// (`Pipeline::step`), the auxiliary total (`sum_aux_total_across`) and the idle times are
/// all-reduced over `pp`. The hidden tensor is taken as one `[rows, T, dim]` f32 (a share of
/// the sequence under SP); models that pass several (DeepSeek's multi-token prediction inputs)
/// send more.
fn pipeline(c: &mut CommPlan, v: &RankView, m: u64, t: u64) {
    let rows_t = if v.sequence {
        t / v.degrees.tp as u64
    } else {
        t
    };
    let hidden = rows_t * v.dim as u64 * 4;
    for (s, _) in &v.stages {
        if s + 1 < v.n_stages {
            c.add("pp sends", "pp", m * (PP_HEADER + hidden));
        }
        if *s > 0 {
            c.add("pp sends", "pp", m * hidden);
        }
    }
    c.add("losses and outputs", "pp", m * 4 + 8 + 8);
    if v.fsdp > 1 {
        // `pp/sharded.rs`: the stage's rows gathered once per step and their gradients
        // reduce-scattered once.
        let shard: u64 = v.trained().map(|p| v.rows(p)).sum();
        let whole: u64 = v
            .trained()
            .map(|p| v.rows(p) * v.shard_group(p) as u64)
            .sum();
        c.add("fsdp gathers", "dp", shard * 4);
        c.add("fsdp reduce-scatters", "dp", whole * 4);
    }
}

/// FSDP's per-block units (`fsdp/units.rs`), without pipeline: per micro-batch the outer unit
/// is gathered once and each block twice (its forward, again for its backward), a gather
/// counted as its send (the rank's padded rows); every unit's gradients are reduce-scattered
/// (the whole padded unit).
fn fsdp_traffic(c: &mut CommPlan, v: &RankView, m: u64) {
    if v.degrees.pp > 1 {
        return;
    }
    let (mut outer, mut blocks, mut scattered) = (0u64, 0u64, 0u64);
    for p in v.trained() {
        let rows = v.rows(p) * 4;
        match p.layer {
            None => outer += rows,
            Some(_) => blocks += rows,
        }
        scattered += rows * v.shard_group(p) as u64;
    }
    c.add("fsdp gathers", "dp", m * (outer + 2 * blocks));
    c.add("fsdp reduce-scatters", "dp", m * scattered);
}

/// The MoE layers' own traffic on rank 0's stages, per layer and micro-batch
/// (`engine/src/ops/moe_layer.rs`, `moe_ep.rs`). Under tensor parallelism the routing
/// weights' gradient (`T·k` f32) is summed backward (`tp_copy`), and under SP each rank's
/// router logits (`T/tp · E` f32) are gathered forward. Under expert parallelism the per-expert
/// counts (an i64 per expert for each of the two halves) go out forward, and the routed rows
/// (`T·k` of `dim` f32, this rank's own experts' included) go out and their gradients come
/// back, as do the rows this rank's experts drew: `2·(routed + drawn)·dim·4` bytes, taken at an
/// even routing (drawn = routed). The measured figure moves with the routing.
fn experts(c: &mut CommPlan, moe: &super::moe::Moe, v: &RankView, m: u64, t: u64) {
    let layers = v.moe_layers();
    let k = moe.top_k as u64;
    if v.degrees.tp > 1 {
        let mut per_layer = t * k * 4;
        if v.sequence {
            per_layer += t / v.degrees.tp as u64 * moe.experts as u64 * 4;
        }
        c.add("tp routing", "tp", m * layers * per_layer);
    }
    if v.degrees.ep > 1 {
        let counts = 2 * moe.experts as u64 * 8;
        let rows = 4 * t * k * v.dim as u64 * 4;
        c.add("ep exchanges", "ep", m * layers * (counts + rows));
    }
}

/// Context parallelism's attention ring (`engine/src/ops/ring_attention.rs` over
/// `context.rs`' `RankRing`): per block and micro-batch, `cp − 1` forward passes of the keys
/// and values (f32) with their i64 positions, `cp` backward passes adding their gradients
/// (a rank's share of the KV heads under tp).
fn ring(c: &mut CommPlan, spec: &ModelSpec, v: &RankView, m: u64, t: u64) {
    let cp = v.degrees.cp as u64;
    let mut per_mb = 0u64;
    for (_, blocks) in &v.stages {
        for l in blocks.clone() {
            let Some(Some((heads, head_dim))) = spec.kv_cache.get(l) else {
                continue;
            };
            let kv = (*heads * *head_dim / v.degrees.tp) as u64;
            per_mb += (cp - 1) * (2 * t * kv * 4 + t * 8) + cp * (4 * t * kv * 4 + t * 8);
        }
    }
    c.add("cp ring", "cp", m * per_mb);
}

/// What the communication figures leave out or assume, in words.
pub fn assumptions(cfg: &JobConfig, spec: &ModelSpec, v: &RankView) -> Vec<String> {
    let d = v.degrees;
    let mut out = vec![
        "communication is rank 0's, counted as comm_bytes counts it (an all-reduce its buffer once, an all-gather its send, a reduce-scatter its whole input, sends their bytes)".to_string(),
    ];
    // The layouts `tests/plan_cli.rs` checks to the byte: one kind of parallelism at a time.
    // (`ep` borrows `dp_shard`'s ranks: EP(2) over FSDP(2) is checked too.)
    let kinds = [d.pp, d.dp_replicate * d.dp_shard, d.cp, d.tp]
        .iter()
        .filter(|&&n| n > 1)
        .count();
    let exact = kinds <= 1 || (d.pp == 1 && d.cp == 1 && d.tp == 1);
    if !exact {
        out.push("this composition of layouts is modelled term by term but not checked against a run: treat its bytes as an estimate".into());
    }
    if d.ep > 1 {
        out.push("expert exchanges (ep) are counted at an even routing (each rank's experts draw as many rows as its tokens send out): the measured bytes move with the routing".into());
    }
    if v.moe
        .as_ref()
        .is_some_and(|m| m.top_k == m.experts && spec.active_params.is_none())
    {
        out.push("the spec gives no active parameters: every expert is taken as routed to".into());
    }
    if cfg.activation_checkpoint.mode != anneal_config::RecomputeMode::None
        && (d.dp_shard > 1 || d.cp > 1)
    {
        out.push(
            "recomputed blocks gather (FSDP) and pass the ring (CP) again; not counted".into(),
        );
    }
    if d.dp_shard > 1 && cfg.parallelism.fsdp_all_gather_dtype != "float32" {
        out.push(format!(
            "FSDP gathers are counted in float32; parallelism.fsdp_all_gather_dtype = \"{}\" sends less",
            cfg.parallelism.fsdp_all_gather_dtype
        ));
    }
    out
}
