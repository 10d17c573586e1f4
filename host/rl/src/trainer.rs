//! The trainer side of an RL step: one batch-invariant forward over the padded batch, the
//! metrics read from its logits (trainer logprobs, entropy), the loss, backward and clipping.

use crate::buffer::Item;
use crate::checkpoint::{snapshot, train_state, Progress};
use crate::loss::{
    advantages, entropies, gather_logprobs, kept_tokens, rl_loss, LossBatch, LossSettings,
    WholeStep,
};
use crate::rollout::{Group, Sample};
use anneal_config::{JobConfig, RecomputeMode};
use anneal_engine::invariant::set_batch_invariant;
use anneal_engine::{autograd, Tensor};
use anneal_runtime::infer::{tensor_parallel_opts, token_logprob, whole_vocab};
use anneal_runtime::plugins::{ForwardOpts, Params, PluginModel, PluginOptimizer};
use anneal_train::checkpoint::Snapshot;
use anneal_train::harness::{clip_grads, Provenance};
use anneal_train::outputs::{weighted_aux, StepOutputs};
use anneal_train::parallel::{Axis, Placements};
use anneal_train::{Dist, FsdpPolicy, TpInference, TrainError};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Detached copies of the parameters: what the rollout side gets for one version (the
/// trainer's own tensors change in place at the next step).
pub(crate) fn publishable(named: &[(String, Tensor)], perturb: f32) -> Result<Params, TrainError> {
    let _g = autograd::no_grad();
    let mut out = std::collections::HashMap::new();
    for (n, p) in named {
        let copy = if perturb != 0.0 {
            p.detach().add_scalar(perturb)?
        } else {
            p.detach().mul_scalar(1.0)?
        };
        out.insert(n.clone(), copy);
    }
    Ok(Arc::new(out))
}

/// What one trainer step measured.
pub(crate) struct StepOut {
    pub loss: f64,
    pub grad_norm: f64,
    pub entropy: f64,
    /// Mean k3 KL to the reference, when the run keeps one.
    pub kl: Option<f64>,
    pub mismatch_max: f64,
    pub dropped_groups: usize,
    /// The model's weighted auxiliary losses, added to the loss that was backpropagated.
    pub aux_loss: Option<f64>,
    /// `aux_loss.<name>` and the model's statistics, as `metrics.jsonl` fields.
    pub outputs: BTreeMap<String, serde_json::Value>,
    /// The model's statistics as tensors, for its `before_optimizer_step`.
    pub stat_sums: Vec<(String, Tensor)>,
}

/// The trainer side: the policy's parameters (leaves with grad) and the frozen reference.
pub(crate) struct RlTrainer<'a> {
    pub model: &'a PluginModel,
    /// The policy by name (the same tensors as `named`), what the forward reads.
    pub params: Params,
    /// The policy sorted by name, as leaves that take gradients.
    pub named: Vec<(String, Tensor)>,
    /// The model's buffers (not trained; its `before_optimizer_step` updates them), by name.
    pub buffers: Vec<(String, Tensor)>,
    /// The frozen KL reference.
    pub reference: Option<Params>,
    pub settings: LossSettings,
    pub group_size: usize,
    /// `training.aux_loss_weights`: each auxiliary loss's weight (1 when unlisted).
    pub aux_weights: BTreeMap<String, f64>,
    /// Under tensor parallelism, the group: `named` and `reference` are this rank's slices,
    /// the forwards run over the group and their logits are made whole.
    pub tp: Option<&'a TpInference>,
    /// Under tensor parallelism, the whole policy, optimizer state and reference gathered for
    /// the next checkpoint ([`RlTrainer::prepare_save`]).
    pub gathered: Option<Gathered>,
    /// Under FSDP, the layout: `named` (and `params`) hold this rank's rows of the policy and
    /// `reference` its rows of the reference (buffers whole); a step gathers them whole.
    pub fsdp: Option<&'a FsdpPolicy>,
    /// Where each policy parameter lives over the mesh: what the gradient norm adds by.
    pub placements: Placements,
    /// Under FSDP, the whole policy gathered for this step's rollouts, which the step's first
    /// forward takes (so the trainer runs on the very tensors the rollouts decoded with).
    pub whole: Option<Vec<(String, Tensor)>>,
    /// Under context parallelism, this rank's part of every row ([`crate::cp`]).
    pub cp: Option<&'a crate::cp::RlContext>,
    /// Under pipeline parallelism, the pipeline: `named`, `buffers` and the optimizer state
    /// are this rank's stages' ([`crate::pp`]).
    pub pp: Option<&'a crate::pp::PpPolicy<'a>>,
    /// The blocks the trainer's forward recomputes in backward (`[activation_checkpoint]`).
    pub recompute: Recompute,
}

/// Which blocks the trainer's forward recomputes in backward instead of keeping their
/// activations: long episodes make the step's rows long. Recomputing changes no value, so
/// the losses and logprobs are the same bits.
#[derive(Clone, Debug, Default)]
pub(crate) struct Recompute {
    /// Every block whose index is a multiple of this (0: none).
    pub every: usize,
    /// The blocks a memory-budget plan chose (`mode = "budget"`).
    pub layers: Option<Arc<Vec<bool>>>,
}

impl Recompute {
    /// The plan of `cfg.activation_checkpoint`; a `budget` is measured on `params` (the whole
    /// policy) for a step's rows of `rows` × `seq_len` tokens.
    pub fn plan(
        cfg: &JobConfig,
        model: &PluginModel,
        params: &Params,
        (rows, seq_len): (usize, usize),
        note: &dyn Fn(&str),
    ) -> Result<Recompute, TrainError> {
        let ac = &cfg.activation_checkpoint;
        Ok(match ac.mode {
            RecomputeMode::None => Recompute::default(),
            RecomputeMode::Full => Recompute {
                every: 1,
                layers: None,
            },
            RecomputeMode::Selective => Recompute {
                every: ac.every,
                layers: None,
            },
            RecomputeMode::Budget => {
                let plan = anneal_runtime::plugins::recompute::plan_for_training(
                    model,
                    params,
                    rows,
                    seq_len,
                    anneal_engine::DType::parse(&cfg.training.dtype),
                    ac.memory_budget,
                )?;
                note(&plan.summary());
                Recompute {
                    every: 0,
                    layers: Some(Arc::new(plan.recompute)),
                }
            }
        })
    }
}

/// Whole tensors gathered over the tensor-parallel group for a checkpoint.
pub(crate) struct Gathered {
    pub named: Vec<(String, Tensor)>,
    pub state: BTreeMap<String, Tensor>,
    pub reference: Option<Params>,
}

/// The padded batch layout shared by the trainer forward and the loss: row `i` holds sample
/// `i`'s tokens but the last as inputs; position `t` predicts token `t + 1`.
pub(crate) struct Layout {
    pub n: usize,
    pub t: usize,
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
    pub mask: Vec<f32>,
    pub rollout: Vec<f32>,
    pub current: Vec<bool>,
}

/// The longest input row of `items` (at least 1).
pub(crate) fn longest(items: &[Item<Group>]) -> usize {
    items
        .iter()
        .flat_map(|it| it.value.samples.iter())
        .map(|s| s.tokens.len() - 1)
        .max()
        .unwrap_or(1)
        .max(1)
}

/// `items` padded to `t` positions (at least [`longest`]).
pub(crate) fn layout(items: &[Item<Group>], version: u64, t: usize) -> Layout {
    let samples: Vec<(u64, &Sample)> = items
        .iter()
        .flat_map(|it| it.value.samples.iter().map(move |s| (it.version, s)))
        .collect();
    let n = samples.len();
    let mut l = Layout {
        n,
        t,
        inputs: vec![0; n * t],
        targets: vec![0; n * t],
        mask: vec![0.0; n * t],
        rollout: vec![0.0; n * t],
        current: Vec::with_capacity(n),
    };
    for (i, (v, s)) in samples.iter().enumerate() {
        let len = s.tokens.len() - 1;
        l.inputs[i * t..i * t + len].copy_from_slice(&s.tokens[..len]);
        l.targets[i * t..i * t + len].copy_from_slice(&s.tokens[1..]);
        for (j, &lp) in s.logprobs.iter().enumerate() {
            // An environment's tokens are context, not actions: they are not trained on.
            if s.is_policy(j) {
                let k = i * t + s.prompt_len - 1 + j;
                l.mask[k] = 1.0;
                l.rollout[k] = lp;
            }
        }
        l.current.push(*v == version);
    }
    l
}

impl RlTrainer<'_> {
    /// A checkpoint of the policy, `optimizer`'s state and the KL reference after `progress`.
    pub fn snapshot(
        &self,
        cfg: &JobConfig,
        progress: &Progress,
        provenance: &Provenance,
        optimizer: &PluginOptimizer,
        elapsed_s: f64,
        spare: Vec<Vec<u8>>,
    ) -> Snapshot {
        // Under TP x FSDP the checkpoint holds the whole tensors `prepare_save` gathered.
        if let (Some(fsdp), None) = (self.fsdp, self.tp) {
            // This rank's rows of everything, as FSDP training writes them.
            let state = train_state(cfg, progress, provenance, elapsed_s);
            let mut pieces = Vec::new();
            let named = self.named.iter().map(|(n, t)| (n, t));
            let buffers = self.buffers.iter().map(|(n, t)| (n, t));
            fsdp.pieces("model", named, buffers, &mut pieces);
            fsdp.state_pieces(&self.named, optimizer.state(), &mut pieces);
            if let Some(r) = &self.reference {
                // The reference holds every trained parameter (a copy of the policy), so its
                // shards line up with the layout.
                let shards = self.named.iter().filter_map(|(n, _)| r.get_key_value(n));
                let mut whole: Vec<(&String, &Tensor)> = r
                    .iter()
                    .filter(|(n, _)| self.named.binary_search_by(|(m, _)| m.cmp(n)).is_err())
                    .collect();
                whole.sort_by(|a, b| a.0.cmp(b.0));
                fsdp.pieces("ref", shards, whole, &mut pieces);
            }
            return Snapshot::capture_pieces(state, pieces, spare);
        }
        match &self.gathered {
            Some(g) => snapshot(
                cfg,
                progress,
                provenance,
                elapsed_s,
                &g.named,
                &g.state,
                g.reference.as_ref(),
                spare,
            ),
            None => snapshot(
                cfg,
                progress,
                provenance,
                elapsed_s,
                &self.all(),
                optimizer.state(),
                self.reference.as_ref(),
                spare,
            ),
        }
    }

    /// Under tensor parallelism, gathers the whole policy, optimizer state and KL reference
    /// for the snapshot that follows (a checkpoint holds whole tensors, whatever the layout;
    /// under TP x FSDP the rows are first gathered to slices over `dp_shard`).
    /// Collective over the group: every rank calls it before a save, whether or not it writes.
    pub fn prepare_save(
        &mut self,
        optimizer: &PluginOptimizer,
        dist: &Dist,
    ) -> Result<(), TrainError> {
        if let Some(pp) = self.pp {
            self.gathered = Some(pp.gather_for_save(self, optimizer)?);
            return Ok(());
        }
        let Some(tp) = self.tp else {
            return Ok(());
        };
        let slices = crate::tp_fsdp::Slices::of(self, optimizer.state(), dist)?;
        let all: Vec<(String, Tensor)> =
            slices.named.iter().chain(&self.buffers).cloned().collect();
        let reference = match &slices.reference {
            Some(r) => {
                let mut sorted: Vec<(String, Tensor)> =
                    r.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                Some(Arc::new(tp.whole(&sorted)?.into_iter().collect()))
            }
            None => None,
        };
        self.gathered = Some(Gathered {
            named: tp.whole(&all)?,
            state: tp.whole_state(&slices.named, &slices.state)?,
            reference,
        });
        Ok(())
    }

    /// The forward options of the trainer's forwards over `params`.
    pub(crate) fn forward_opts(&self, params: &Params, training: bool) -> ForwardOpts {
        ForwardOpts {
            training,
            ring: self.cp.map(|c| c.ring()),
            // Only a forward that keeps activations for backward has any to recompute.
            recompute_every: if training { self.recompute.every } else { 0 },
            recompute_layers: self.recompute.layers.clone().filter(|_| training),
            ..tensor_parallel_opts(params, self.tp.map(|t| t.context()).as_ref())
        }
    }

    /// The logits of a forward, whole-vocabulary rows under tensor parallelism.
    fn whole(&self, logits: Tensor) -> Result<Tensor, TrainError> {
        let tp = self.tp.map(|t| t.context());
        let logits = whole_vocab(self.model, logits, tp.as_ref())?;
        match self.cp {
            Some(cp) => cp.whole_rows(&logits),
            None => Ok(logits),
        }
    }

    /// The policy's parameters and buffers, sorted by name within each.
    pub fn all(&self) -> Vec<(String, Tensor)> {
        self.named.iter().chain(&self.buffers).cloned().collect()
    }

    pub fn zero_grad(&self) {
        for (_, p) in &self.named {
            p.zero_grad();
        }
    }

    /// Forward (batch-invariant, like the rollouts), metrics from the logits, loss, backward
    /// and clipping. The caller applies the optimizer.
    ///
    /// With several data-parallel ranks `items` are this rank's whole groups of the step: rows
    /// are padded to the step's longest, the loss is normalized by the step's counts, the
    /// gradients are summed over the ranks before the norm, and the measured values are the
    /// step's (the reported loss adds every rank's token terms in the one-process order, so
    /// it is that loss's bits).
    pub fn step(
        &mut self,
        items: &[Item<Group>],
        version: u64,
        max_grad_norm: f64,
        dist: &Dist,
    ) -> Result<StepOut, TrainError> {
        if let Some(pp) = self.pp {
            return pp.step(self, items, version, max_grad_norm, dist);
        }
        let _inv = set_batch_invariant(true);
        let ranks = dist.size();
        let t = match ranks {
            1 => longest(items),
            _ => dist.max_u64(longest(items) as u64)? as usize,
        };
        let t = self.cp.map_or(t, |cp| cp.padded(t));
        let l = layout(items, version, t);
        let rewards: Vec<f64> = items
            .iter()
            .flat_map(|it| it.value.samples.iter().map(|s| s.scored.reward))
            .collect();
        // On the policy's device (positions stay on the host, where RoPE and attention read
        // them).
        // Under context parallelism this rank's part of every row, at its global positions.
        let (ids, positions) = match self.cp {
            Some(cp) => cp.local(&l.inputs, l.n, l.t)?,
            None => (
                Tensor::from_slice(&l.inputs, &[l.n, l.t])?,
                Tensor::from_vec((0..l.t as i64).collect(), &[l.t])?,
            ),
        };
        let ids = ids.to_device(anneal_runtime::infer::device_of(&self.params))?;
        // Under FSDP the forward runs on the whole policy: the one the rollouts decoded with
        // (a later update of the same batch gathers the updated rows afresh).
        let policy = match self.fsdp {
            Some(f) => Some(match self.whole.take() {
                Some(w) => w,
                None => f.gather(dist, &self.named, true)?,
            }),
            None => None,
        };
        let params: Params = match &policy {
            Some(w) => Arc::new(w.iter().chain(&self.buffers).cloned().collect()),
            None => self.params.clone(),
        };
        // Under expert parallelism the forward and backward run this rank's experts, token rows
        // exchanged over the expert group.
        let _experts = self
            .fsdp
            .map(|f| f.activate_experts(dist))
            .transpose()?
            .flatten();
        let fwd = match self.fsdp {
            Some(f) => f.trainer_opts(&self.forward_opts(&params, true), &params),
            None => self.forward_opts(&params, true),
        };
        // The model's auxiliary losses (a router's balancing loss) train the policy as they do
        // in `anneal train`; its statistics are reported.
        let full = self.model.forward_full(&params, &ids, &positions, &fwd)?;
        let aux = weighted_aux(&self.aux_weights, &full.aux_losses)?;
        let mut outputs = StepOutputs::default();
        outputs.add(aux.as_ref(), &full.aux_losses, &full.stats)?;
        // Whole rows under tensor parallelism: the rollout sampled and scored the same rows.
        let logits = self.whole(full.logits)?;
        let v = logits.shape()[2];
        // Trainer logprobs through the same function as the rollout's, and the entropy.
        let rows = logits.to_vec_f32();
        let (mut mismatch, mut ent_sum, mut tokens) = (0f64, 0f64, 0usize);
        for k in 0..l.n * l.t {
            if l.mask[k] == 0.0 {
                continue;
            }
            let row = &rows[k * v..(k + 1) * v];
            if l.current[k / l.t] {
                let lp = token_logprob(row, l.targets[k] as usize);
                mismatch = mismatch.max((lp - l.rollout[k]).abs() as f64);
            }
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
            let h: f64 = row
                .iter()
                .map(|&x| {
                    let lp = x as f64 - m - z.ln();
                    -lp.exp() * lp
                })
                .sum();
            ent_sum += h;
            tokens += 1;
        }
        drop(rows);
        let reference = match (self.fsdp, &self.reference) {
            (Some(f), Some(r)) => Some(f.gather_map(dist, &self.named, r)?),
            (_, r) => r.clone(),
        };
        let ref_logp = match &reference {
            Some(refp) => {
                let _g = autograd::no_grad();
                let rl =
                    self.model
                        .forward(refp, &ids, &positions, &self.forward_opts(refp, false))?;
                let rl = self.whole(rl)?;
                let rr = rl.to_vec_f32();
                Some(
                    (0..l.n * l.t)
                        .map(|k| {
                            if l.mask[k] == 0.0 {
                                0.0
                            } else {
                                token_logprob(&rr[k * v..(k + 1) * v], l.targets[k] as usize)
                            }
                        })
                        .collect::<Vec<f32>>(),
                )
            }
            None => None,
        };
        let log_probs = logits.log_softmax(-1)?;
        let logp = gather_logprobs(&log_probs, &l.targets)?;
        let entropy_nl = (self.settings.entropy_coef > 0.0)
            .then(|| entropies(&log_probs))
            .transpose()?;
        let whole = if ranks > 1 {
            let (_, keep) = advantages(self.settings.kind, &rewards, self.group_size);
            let kept = sum_over(dist, &[kept_tokens(&l.mask, &keep)])?;
            Some(WholeStep {
                samples: l.n * ranks,
                kept_tokens: kept[0],
            })
        } else {
            None
        };
        let out = rl_loss(
            &LossBatch {
                logp_nl: &logp,
                rollout_logp: &l.rollout,
                ref_logp: ref_logp.as_deref(),
                entropy_nl: entropy_nl.as_ref(),
                mask: &l.mask,
                rewards: &rewards,
                group_size: self.group_size,
                whole,
            },
            &self.settings,
        )?;
        // Summed over data-parallel × cp ranks: each holds part of the step's tokens.
        outputs.reduce_across(dist.grads())?;
        let fields = metric_fields(&outputs)?;
        let loss = if ranks > 1 {
            // Every rank's terms in rank order are the one-process batch's rows in order.
            let all = dist.gather_f32(&out.terms.to_vec_f32())?;
            // On this rank's device, summed as the one process sums its terms.
            anneal_engine::staged::from_host_f32(all, &[l.n * ranks, l.t], out.terms.device())?
                .sum_all()?
                .item()? as f64
        } else {
            out.loss.item()? as f64
        };
        let parts = ranks * self.cp.map_or(1, |c| c.size());
        match aux {
            // Each rank's auxiliary loss is its share's; the summed gradients average them.
            Some(aux) if parts > 1 => out
                .loss
                .add(&aux.mul_scalar(1.0 / parts as f32)?)?
                .backward()?,
            Some(aux) => out.loss.add(&aux)?.backward()?,
            None => out.loss.backward()?,
        }
        // Gradients partial over tp (per-head norms: each rank applies them to its heads)
        // are summed over its ranks first, as in pretraining; under FSDP on the gathered
        // slices, which hold them, before the reduce-scatter.
        if let Some(comm) = dist.axis(Axis::Tp) {
            let grads = policy.as_deref().unwrap_or(&self.named);
            self.placements.sum_partial_grads(Axis::Tp, comm, grads)?;
        }
        match (self.fsdp, &policy) {
            // The whole policy's gradients to this rank's rows, summed over the ranks.
            (Some(f), Some(w)) => f.reduce_grads(dist, w, &self.named)?,
            _ => dist.all_reduce_grads(&self.named)?,
        }
        drop((params, policy, reference));
        let grad_norm = self.placements.grad_norm(dist, &self.named)?;
        clip_grads(&self.named, max_grad_norm, grad_norm)?;
        let (mut entropy, mut kl, mut dropped) = (
            ent_sum / tokens.max(1) as f64,
            out.kl_mean,
            out.dropped_groups,
        );
        if ranks > 1 {
            let t = tokens as f64;
            let local = [ent_sum, t, out.kl_mean * t, out.dropped_groups as f64];
            let sums = sum_over(dist, &local)?;
            entropy = sums[0] / sums[1].max(1.0);
            kl = sums[2] / sums[1].max(1.0);
            dropped = sums[3] as usize;
            mismatch = max_over(dist, mismatch)?;
        }
        Ok(StepOut {
            loss,
            grad_norm,
            entropy,
            kl: self.reference.as_ref().map(|_| kl),
            mismatch_max: mismatch,
            dropped_groups: dropped,
            aux_loss: outputs.aux_total()?,
            outputs: fields,
            stat_sums: outputs.stat_sums().to_vec(),
        })
    }
}

/// The model's auxiliary losses and statistics as `metrics.jsonl` fields; a statistic named
/// like one of `anneal rl`'s own fields is the plugin's error.
pub(crate) fn metric_fields(
    outputs: &StepOutputs,
) -> Result<BTreeMap<String, serde_json::Value>, TrainError> {
    let fields = outputs.fields()?;
    if let Some(name) = fields.keys().find(|n| crate::metrics::RlRow::has_field(n)) {
        return Err(anneal_engine::Error::Invalid {
            op: "plugin",
            msg: format!("the model named a statistic '{name}', an anneal rl metrics field"),
        }
        .into());
    }
    Ok(fields)
}

/// Every data-parallel rank's `local`, gathered and added in rank order (so every rank gets
/// the same bits).
fn sum_over(dist: &Dist, local: &[f64]) -> Result<Vec<f64>, TrainError> {
    let bits: Vec<i64> = local.iter().map(|v| v.to_bits() as i64).collect();
    let mut all = vec![0i64; bits.len() * dist.size()];
    dist.dp()
        .all_gather((&bits[..]).into(), (&mut all[..]).into())?;
    let mut sums = vec![0f64; local.len()];
    for rank in all.chunks(local.len()) {
        for (s, &b) in sums.iter_mut().zip(rank) {
            *s += f64::from_bits(b as u64);
        }
    }
    Ok(sums)
}

/// The largest of every data-parallel rank's `local`.
fn max_over(dist: &Dist, local: f64) -> Result<f64, TrainError> {
    let bits = [local.to_bits() as i64];
    let mut all = vec![0i64; dist.size()];
    dist.dp()
        .all_gather((&bits[..]).into(), (&mut all[..]).into())?;
    Ok(all
        .into_iter()
        .map(|b| f64::from_bits(b as u64))
        .fold(f64::NEG_INFINITY, f64::max))
}
