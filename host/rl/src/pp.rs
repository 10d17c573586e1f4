//! `anneal rl` under pipeline parallelism (`parallelism.pp`, on its own): each pipeline rank
//! keeps its stages' parameters, buffers and optimizer state, as `anneal train` places them.
//!
//! - **Rollouts**: once per step the ranks gather every stage's tensors (exact bits,
//!   [`anneal_train::parallel::pipeline_gather`]) and every rank decodes all of the step's
//!   prompts with that whole policy on the training thread, as FSDP's rollouts run. Prompts and
//!   sampling streams are functions of (seed, prompt index, sample index), so the ranks'
//!   rollouts are identical and no rollout travels.
//! - **Trainer**: the real pipeline ([`anneal_train::parallel::Pipeline::step_with`]) over
//!   micro-batches of whole groups, padded to the step's longest row. On the last stage each
//!   micro-batch's logits give the trainer logprobs (the mismatch), the entropy and
//!   [`rl_loss`], normalized by the whole step's counts ([`WholeStep`]) so the micro-batches'
//!   losses add up to the step's; the reported loss adds every token's term in one-process
//!   order, and the last stage's metrics reach every rank. The KL reference is frozen, so each
//!   rank keeps it whole and the last stage runs its forward over the whole batch, as one
//!   process does.
//! - **Gradients**: each parameter is `Stage`-placed over `pp`, so the norm adds the stages'
//!   sums of squares exactly.
//! - **Checkpoints**: gathered whole (policy, buffers, optimizer state) and written by the
//!   first rank like one process's, so any layout resumes them; a rank restores the whole and
//!   keeps its stages.

use crate::buffer::{Item, RolloutBuffer};
use crate::loss::{
    advantages, entropies, gather_logprobs, kept_tokens, rl_loss, LossBatch, WholeStep,
};
use crate::rollout::{Group, RolloutCtx};
use crate::trainer::{
    layout, longest, metric_fields, publishable, Gathered, Layout, RlTrainer, StepOut,
};
use anneal_config::JobConfig;
use anneal_data::Batch;
use anneal_engine::invariant::set_batch_invariant;
use anneal_engine::{autograd, Tensor};
use anneal_runtime::infer::token_logprob;
use anneal_runtime::plugins::{Params, PluginModel, PluginOptimizer};
use anneal_train::harness::clip_grads;
use anneal_train::parallel::{
    pipeline_gather, pipeline_setup, Axis, Pipeline, PipelineCtx, Placement, Placements,
};
use anneal_train::preflight::Degrees;
use anneal_train::{Dist, TrainError};
use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

/// Tensors by name.
type Named = Vec<(String, Tensor)>;

/// Refuses what RL under a pipeline does not run: other parallel axes beside it, asynchronous
/// rollouts, and an interleaved schedule whose micro-batches (one per group) do not fill every
/// rank's chunks. User errors naming the keys.
pub(crate) fn check(cfg: &JobConfig, mesh: &Degrees) -> Result<(), TrainError> {
    let pp = mesh.pp;
    if pp <= 1 {
        return Ok(());
    }
    let others = [
        (mesh.dp_replicate, "parallelism.dp_replicate"),
        (mesh.dp_shard, "parallelism.dp_shard"),
        (mesh.tp, "parallelism.tp"),
        (mesh.cp, "parallelism.cp"),
    ];
    if let Some((n, key)) = others.iter().find(|(n, _)| *n > 1) {
        return Err(TrainError::Config(format!(
            "config: `{key}` ({n}) with `parallelism.pp` ({pp}): `anneal rl` runs pipeline parallel on its own, not with other layouts yet; set {key} = 1"
        )));
    }
    let r = &cfg.rl;
    let refused = [
        (r.max_staleness > 0, "rl.max_staleness", "0"),
        (r.rollout_threads > 1, "rl.rollout_threads", "1"),
    ];
    if let Some((_, key, want)) = refused.iter().find(|(bad, _, _)| *bad) {
        return Err(TrainError::Config(format!(
            "config: `{key}` with `parallelism.pp` ({pp}): the policy is whole only while a step runs, gathered over the pipeline once on the training thread for that step's rollouts; set {key} = {want}"
        )));
    }
    let v = cfg.parallelism.pp_virtual_stages;
    if v > 1 && !r.prompts_per_step.is_multiple_of(pp) {
        return Err(TrainError::Config(format!(
            "config: `rl.prompts_per_step` ({}) with `parallelism.pp_virtual_stages` ({v}): each group is one micro-batch of the pipeline, and an interleaved schedule needs a multiple of parallelism.pp ({pp}); make rl.prompts_per_step a multiple of {pp}",
            r.prompts_per_step
        )));
    }
    Ok(())
}

/// One rank's place in the RL pipeline.
pub(crate) struct PpPolicy<'a> {
    dist: &'a Dist,
    pipeline: Pipeline,
    /// Every trained parameter of the model, sorted (the gradient norm's order).
    names: Vec<String>,
}

/// Under `parallelism.pp`, the pipeline and what this rank keeps of the whole policy `named`,
/// its `buffers` and `optimizer`'s state (its stages'); otherwise everything unchanged.
pub(crate) fn split<'a>(
    cfg: &JobConfig,
    dist: &'a Dist,
    model: &PluginModel,
    named: Named,
    buffers: Named,
    optimizer: &mut PluginOptimizer,
    note: &dyn Fn(&str),
) -> Result<(Option<PpPolicy<'a>>, Named, Named), TrainError> {
    let Some(comm) = dist.pp() else {
        return Ok((None, named, buffers));
    };
    let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    let groups = cfg.rl.prompts_per_step;
    let (pipeline, mine, my_buffers) =
        pipeline_setup(cfg, model, comm.rank(), named, buffers, groups)?;
    note(&pipeline.summary(groups));
    // The optimizer state of the other stages' parameters goes with them.
    let states: Vec<String> = optimizer
        .spec()
        .state
        .iter()
        .map(|s| s.name.clone())
        .collect();
    let keep: HashSet<String> = mine
        .iter()
        .flat_map(|(n, _)| states.iter().map(move |s| format!("{n}.{s}")))
        .collect();
    optimizer.state_mut().retain(|k, _| keep.contains(k));
    let pp = PpPolicy {
        dist,
        pipeline,
        names,
    };
    Ok((Some(pp), mine, my_buffers))
}

/// What the last stage measured of a step's micro-batches.
struct LastStage {
    /// Each token's entropy (0 where masked), summed in the one-process order at the end.
    entropy: Vec<f64>,
    /// Each token's loss term, `[N, T]`.
    terms: Vec<f32>,
    mismatch: f64,
    /// Each micro-batch's mean KL times its tokens.
    kl_sum: f64,
    dropped: usize,
}

impl PpPolicy<'_> {
    /// Where each policy parameter lives: on its stage's rank alone.
    pub fn placements(&self) -> Placements {
        Placements::replicated(self.names.iter().cloned()).with(Axis::Pp, |_| Placement::Stage)
    }

    /// Every stage's tensors of `local` on every rank, sorted by name. Collective over `pp`.
    fn gather(&self, local: &[(String, Tensor)]) -> Result<Named, TrainError> {
        let comm = self.dist.pp().ok_or_else(no_pipeline)?;
        let mut whole = pipeline_gather(comm, local)?;
        whole.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(whole)
    }

    /// The whole policy from this rank's `params` (its stages'), for an evaluation.
    /// Collective over `pp`.
    pub fn whole_params(&self, params: &Params) -> Result<Params, TrainError> {
        let mut local: Named = params.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
        local.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Arc::new(self.gather(&local)?.into_iter().collect()))
    }

    /// This step's rollouts: the whole policy gathered and published as `version`, then every
    /// rank decodes all `groups` of the step on this thread (identically: sampling depends on
    /// the prompt and sample indices alone). Collective over `pp`.
    pub fn rollout_round(
        &self,
        trainer: &RlTrainer<'_>,
        ctx: &RolloutCtx,
        buffer: &RolloutBuffer<Group, Params>,
        version: u64,
        groups: usize,
        perturb: f32,
    ) -> Result<(), TrainError> {
        let whole = self.gather(&trainer.all())?;
        let weights = match perturb != 0.0 {
            true => publishable(&whole, perturb)?,
            false => Arc::new(whole.into_iter().collect()),
        };
        crate::rollout::rollout_round_with(ctx, buffer, version, weights, groups);
        Ok(())
    }

    /// The whole policy, buffers and optimizer state for a checkpoint, on every rank (the
    /// first writes it); the KL reference is whole already. Collective over `pp`.
    pub fn gather_for_save(
        &self,
        trainer: &RlTrainer<'_>,
        optimizer: &PluginOptimizer,
    ) -> Result<Gathered, TrainError> {
        let mut named = self.gather(&trainer.named)?;
        named.extend(self.gather(&trainer.buffers)?);
        let state: Named = optimizer
            .state()
            .iter()
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        let state: BTreeMap<String, Tensor> = self.gather(&state)?.into_iter().collect();
        Ok(Gathered {
            named,
            state,
            reference: trainer.reference.clone(),
        })
    }

    /// One trainer step through the pipeline (see the module doc): forward and backward of
    /// every group, the norm over the stages and clipping. The caller applies the optimizer.
    /// Collective over `pp`.
    pub fn step(
        &self,
        tr: &RlTrainer<'_>,
        items: &[Item<Group>],
        version: u64,
        max_grad_norm: f64,
        dist: &Dist,
    ) -> Result<StepOut, TrainError> {
        let comm = self.dist.pp().ok_or_else(no_pipeline)?;
        let _inv = set_batch_invariant(true);
        let l = layout(items, version, longest(items));
        let t = l.t;
        let rewards: Vec<f64> = items
            .iter()
            .flat_map(|it| it.value.samples.iter().map(|s| s.scored.reward))
            .collect();
        // One micro-batch per group: its rows of the padded batch.
        let mut spans: Vec<Range<usize>> = Vec::with_capacity(items.len());
        for it in items {
            let at = spans.last().map_or(0, |r| r.end);
            spans.push(at..at + it.value.samples.len());
        }
        let batches: Vec<Batch> = spans
            .iter()
            .map(|r| Batch {
                inputs: l.inputs[r.start * t..r.end * t].to_vec(),
                targets: l.targets[r.start * t..r.end * t].to_vec(),
                batch: r.len(),
                seq_len: t,
                images: Vec::new(),
                row_images: Vec::new(),
                positions: Vec::new(),
            })
            .collect();
        let positions = Tensor::from_vec((0..t as i64).collect(), &[t])?;
        let opts = tr.forward_opts(&tr.params, true);
        let n_stages = self.pipeline.layout.n_stages();
        let last_rank = self.pipeline.layout.rank_of(n_stages - 1);
        let is_last = comm.rank() == last_rank;
        let ref_logp = match (&tr.reference, is_last) {
            (Some(r), true) => Some(reference_logprobs(tr, r, &l, &positions)?),
            _ => None,
        };
        // The whole step's normalizers, so the groups' losses add up to the step's.
        let (_, keep) = advantages(tr.settings.kind, &rewards, tr.group_size);
        let whole = WholeStep {
            samples: l.n,
            kept_tokens: kept_tokens(&l.mask, &keep),
        };
        let mut last = LastStage {
            entropy: vec![0.0; l.n * t],
            terms: vec![0.0; l.n * t],
            mismatch: 0.0,
            kl_sum: 0.0,
            dropped: 0,
        };
        let mut loss = |mb: usize, out: &[Tensor], _: &Batch| -> Result<Tensor, TrainError> {
            let span = spans[mb].start * t..spans[mb].end * t;
            let logits = out
                .first()
                .ok_or_else(|| TrainError::Pipeline("the head returned nothing".into()))?;
            last.measure(&l, span.clone(), logits)?;
            let log_probs = logits.log_softmax(-1)?;
            let logp = gather_logprobs(&log_probs, &l.targets[span.clone()])?;
            let entropy_nl = (tr.settings.entropy_coef > 0.0)
                .then(|| entropies(&log_probs))
                .transpose()?;
            let out = rl_loss(
                &LossBatch {
                    logp_nl: &logp,
                    rollout_logp: &l.rollout[span.clone()],
                    ref_logp: ref_logp.as_ref().map(|r| &r[span.clone()]),
                    entropy_nl: entropy_nl.as_ref(),
                    mask: &l.mask[span.clone()],
                    rewards: &rewards[spans[mb].clone()],
                    group_size: tr.group_size,
                    whole: Some(whole),
                },
                &tr.settings,
            )?;
            let tokens: f64 = l.mask[span.clone()].iter().map(|&m| m as f64).sum();
            last.kl_sum += out.kl_mean * tokens;
            last.dropped += out.dropped_groups;
            last.terms[span].copy_from_slice(&out.terms.to_vec_f32());
            Ok(out.loss)
        };
        let ctx = PipelineCtx {
            model: tr.model,
            params: &tr.params,
            positions: &positions,
            opts: &opts,
            amp: None,
            aux_weights: &tr.aux_weights,
            // Each group's loss carries the whole step's normalizers already.
            scale: None,
        };
        // The model's auxiliary losses (a router's balancing loss) are each group's: their
        // mean over the groups stands for the step's, as the data-parallel path averages its
        // ranks' shares.
        let aux_scale = Some(1.0 / batches.len().max(1) as f32);
        let result = self
            .pipeline
            .step_with(comm, &ctx, &batches, aux_scale, &mut loss)?;
        // The step's figures, from the last stage to every rank (as bits).
        let mut figures = [0f64; 6];
        if is_last {
            let tokens = l.mask.iter().filter(|&&m| m != 0.0).count() as f64;
            let terms = std::mem::take(&mut last.terms);
            figures = [
                // Every token's term added in one-process order: the one-process loss's bits.
                Tensor::from_vec(terms, &[l.n, t])?.sum_all()?.item()? as f64,
                last.mismatch,
                last.entropy.iter().sum::<f64>(),
                tokens,
                last.kl_sum,
                last.dropped as f64,
            ];
        }
        let mut bytes: Vec<u8> = figures.iter().flat_map(|v| v.to_le_bytes()).collect();
        comm.broadcast(&mut bytes, last_rank)?;
        for (v, b) in figures.iter_mut().zip(bytes.chunks_exact(8)) {
            *v = f64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        }
        let [loss, mismatch, ent_sum, tokens, kl_sum, dropped] = figures;
        let outputs = result.outputs;
        // The auxiliary-loss total is every stage's (statistics stay per stage).
        let aux_total = outputs.aux_total()?;
        let mut aux = [
            aux_total.unwrap_or(0.0) as f32,
            f32::from(u8::from(aux_total.is_some())),
        ];
        comm.all_reduce_sum(&mut aux)?;
        let aux_loss = (aux[1] > 0.0).then_some(aux[0] as f64);
        let fields = metric_fields(&outputs)?;
        let grad_norm = tr.placements.grad_norm(dist, &tr.named)?;
        clip_grads(&tr.named, max_grad_norm, grad_norm)?;
        Ok(StepOut {
            loss,
            grad_norm,
            entropy: ent_sum / tokens.max(1.0),
            kl: tr.reference.as_ref().map(|_| kl_sum / tokens.max(1.0)),
            mismatch_max: mismatch,
            dropped_groups: dropped as usize,
            aux_loss,
            outputs: fields,
            stat_sums: outputs.stat_sums().to_vec(),
        })
    }
}

impl LastStage {
    /// The mismatch and the entropies of the tokens `span` of the padded batch from their
    /// micro-batch's `logits` (`[rows, T, V]`), as the one-process trainer reads them.
    fn measure(
        &mut self,
        l: &Layout,
        span: Range<usize>,
        logits: &Tensor,
    ) -> Result<(), TrainError> {
        let v = logits.shape().last().copied().unwrap_or(0);
        let rows = logits.to_vec_f32();
        for k in span.clone() {
            if l.mask[k] == 0.0 {
                continue;
            }
            let at = k - span.start;
            let row = &rows[at * v..(at + 1) * v];
            if l.current[k / l.t] {
                let lp = token_logprob(row, l.targets[k] as usize);
                self.mismatch = self.mismatch.max((lp - l.rollout[k]).abs() as f64);
            }
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
            self.entropy[k] = row
                .iter()
                .map(|&x| {
                    let lp = x as f64 - m - z.ln();
                    -lp.exp() * lp
                })
                .sum();
        }
        Ok(())
    }
}

/// The KL reference's logprob of each target of `l` (0 where masked): its forward over the
/// whole batch, as one process runs it.
fn reference_logprobs(
    tr: &RlTrainer<'_>,
    reference: &Params,
    l: &Layout,
    positions: &Tensor,
) -> Result<Vec<f32>, TrainError> {
    let _g = autograd::no_grad();
    let ids = Tensor::from_slice(&l.inputs, &[l.n, l.t])?
        .to_device(anneal_runtime::infer::device_of(reference))?;
    let logits = tr.model.forward(
        reference,
        &ids,
        positions,
        &tr.forward_opts(reference, false),
    )?;
    let v = logits.shape()[2];
    let rows = logits.to_vec_f32();
    Ok((0..l.n * l.t)
        .map(|k| match l.mask[k] == 0.0 {
            true => 0.0,
            false => token_logprob(&rows[k * v..(k + 1) * v], l.targets[k] as usize),
        })
        .collect())
}

fn no_pipeline() -> TrainError {
    TrainError::Pipeline("pipeline parallel RL without a pipeline communicator".into())
}
