//! The named steps of [`Trainer::train_step`]: the micro-batches' forwards and backwards (or
//! the pipeline's schedule), the gradients' sums over the ranks, the finite check, and the
//! step's extra metrics fields.

use super::Trainer;
use crate::outputs::{weighted_aux, StepOutputs};
use crate::parallel::fsdp::Fsdp;
use crate::parallel::full_matrix::OwnerFigures;
use crate::parallel::Axis;
use crate::TrainError;
use anneal_config::Training;
use anneal_data::Batch;
use anneal_engine::Tensor;
use anneal_runtime::plugins::ForwardOpts;
use std::collections::BTreeMap;

/// What a step's micro-batches left on this rank.
pub(super) struct Accumulated {
    /// This rank's micro-batch losses (every micro-batch's once summed over the ranks).
    pub losses: Vec<f32>,
    /// Losses still where the forward computed them (a GPU's), in micro-batch order after
    /// `losses`: read with the step's other scalars ([`Accumulated::read_losses`]), so a
    /// micro-batch never waits for the device.
    pub pending_losses: Vec<Tensor>,
    /// The model's auxiliary losses and statistics, summed over the micro-batches.
    pub outputs: StepOutputs,
    /// Under pipeline parallelism: this rank's micro-batches, which the schedule runs.
    pipeline_batches: Vec<Batch>,
    /// How many equal parts the step's loss is cut into over micro-batches and ranks.
    parts: usize,
}

impl Accumulated {
    /// Reads the pending losses now (one device→host copy), when something needs them before
    /// the gradient norm does.
    pub fn read_losses(&mut self) -> Result<(), TrainError> {
        let pending = std::mem::take(&mut self.pending_losses);
        self.take_losses(&anneal_engine::ops::read_values(&pending)?);
        Ok(())
    }

    /// Appends the values read for the pending losses.
    pub fn take_losses(&mut self, values: &[f64]) {
        self.pending_losses.clear();
        self.losses.extend(values.iter().map(|&v| v as f32));
    }
}

/// What the pipeline's schedule reports beside the losses.
#[derive(Default)]
pub(super) struct PipelineOut {
    /// Measured bubble and the schedule's theory.
    pub figures: Option<(f64, f64)>,
    /// Under FSDP inside the stages: the gradient rows reduce-scattered to this rank and
    /// whether each parameter got one.
    pub shard_grads: Option<(Vec<Vec<f32>>, Vec<bool>)>,
}

/// FSDP's figures of a step: peak bytes of gathered parameters, early reduce-scatters, bytes
/// sent in parameter gathers.
type FsdpFigures = (u64, u64, u64);

impl Trainer {
    /// Drops what evaluation left in the per-step counters; returns the bytes handed to
    /// collectives so far.
    pub(super) fn begin_step_counters(&self) -> u64 {
        if let Some(g) = &self.experts {
            // Evaluation's exchanges are not the step's.
            g.take_bytes();
        }
        if self.cp.is_some() {
            // Nor are its ring passes.
            crate::parallel::context::take_ring_bytes();
        }
        self.dist.comm_bytes()
    }

    /// Reads the step's global batch and runs the forward and backward of this rank's
    /// micro-batches (or of its rows of each); under pipeline parallelism keeps them for the
    /// schedule instead.
    pub(super) fn micro_batches(
        &mut self,
        t: &Training,
        n_micro: usize,
        opts: &ForwardOpts,
    ) -> Result<Accumulated, TrainError> {
        let units = self.units.clone();
        // Each part's mean loss weighs 1 / parts: the step's mean once summed over the ranks
        // (each of the cp ranks holds as many tokens of a sequence).
        let parts = self.dist.loss_parts(n_micro) * self.cp.as_ref().map_or(1, |c| c.size());
        let mut acc = Accumulated {
            losses: Vec::with_capacity(self.dist.local_micro_batches(n_micro)),
            pending_losses: Vec::new(),
            outputs: StepOutputs::default(),
            pipeline_batches: Vec::new(),
            parts,
        };
        // Every rank reads the whole global batch (so the order never depends on the number of
        // ranks) and trains on its own consecutive micro-batches, or on its rows of each.
        for i in 0..n_micro {
            // Every rank walks the whole global batch (so the order never depends on the
            // number of ranks) but reads only its own rows of it.
            let keep = self.dist.local_rows(i, n_micro, t.micro_batch_size);
            let b = self.loader.next_rows(t.micro_batch_size, keep.clone())?;
            if keep.is_empty() {
                continue;
            }
            if self.pipeline.is_some() {
                // Under context parallelism the stages run on this rank's part of each sequence.
                acc.pipeline_batches.push(match &self.cp {
                    Some(cp) => cp.local_batch(&b),
                    None => b,
                });
                continue;
            }
            if let Some(u) = &units {
                u.borrow_mut().begin_micro_batch()?;
            }
            let (loss, out) = self.batch_forward(&b, opts)?;
            acc.pending_losses.push(loss.detach());
            let aux = weighted_aux(&t.aux_loss_weights, &out.aux_losses)?;
            acc.outputs.add(aux.as_ref(), &out.aux_losses, &out.stats)?;
            let loss = match aux {
                Some(aux) => loss.add(&aux)?,
                None => loss,
            };
            let loss = if parts > 1 {
                loss.mul_scalar(1.0 / parts as f32)?
            } else {
                loss
            };
            if let Some(u) = &units {
                u.borrow_mut().begin_backward()?;
            }
            loss.backward()?;
            if let Some(u) = &units {
                u.borrow_mut().end_backward()?;
            }
        }
        Ok(acc)
    }

    /// Under pipeline parallelism, runs the schedule over the micro-batches
    /// [`Trainer::micro_batches`] kept (a stage's FSDP shards gathered once for it), taking
    /// its losses and outputs; nothing otherwise.
    pub(super) fn pipeline_schedule(
        &self,
        t: &Training,
        opts: &ForwardOpts,
        acc: &mut Accumulated,
    ) -> Result<PipelineOut, TrainError> {
        let (Some(pipe), Some(comm)) = (&self.pipeline, self.dist.pp()) else {
            return Ok(PipelineOut::default());
        };
        let sharded = self.fsdp.as_ref().zip(self.dist.shard());
        let efsdp = self.dist.experts().map(|(_, f)| f);
        let stage = self.gather_stage(true)?;
        let params = stage.as_ref().map_or(&self.params, |g| &g.params);
        let stage_opts = self.gathered_stage_opts(opts, params);
        let ctx = crate::parallel::pp::StepCtx {
            model: &self.model,
            params,
            positions: &self.positions,
            opts: stage_opts.as_ref().unwrap_or(opts),
            amp: anneal_engine::DType::parse(&t.dtype),
            aux_weights: &t.aux_loss_weights,
            // Each part's mean over its tokens, as without stages.
            scale: Some(acc.parts)
                .filter(|&parts| parts > 1)
                .map(|parts| 1.0 / parts as f32),
        };
        let r = pipe.step(comm, &ctx, &acc.pipeline_batches)?;
        acc.losses = r.losses;
        acc.outputs = r.outputs;
        acc.outputs.sum_aux_total_across(comm)?;
        // The idle share over the pipeline's ranks: their waits over their whole time.
        let mut times = [r.wait_s as f32, (r.wait_s + r.busy_s) as f32];
        comm.all_reduce_sum(&mut times)?;
        let bubble = f64::from(times[0]) / f64::from(times[1]).max(1e-12);
        let theory = pipe.theory_bubble(acc.pipeline_batches.len());
        let shard_grads = match (sharded, &stage) {
            (Some((fsdp, sc)), Some(g)) => Some(crate::parallel::pp::sharded::scatter_grads(
                fsdp, sc, efsdp, &g.named,
            )?),
            _ => None,
        };
        Ok(PipelineOut {
            figures: Some((bubble, theory)),
            shard_grads,
        })
    }

    /// Under FSDP inside pipeline stages, this rank's stage gathered whole from its shards
    /// (`training`: as leaves whose gradients are reduce-scattered after the schedule);
    /// `None` without FSDP. Collective over the shard group.
    pub(super) fn gather_stage(
        &self,
        training: bool,
    ) -> Result<Option<crate::parallel::pp::sharded::Gathered>, TrainError> {
        let efsdp = self.dist.experts().map(|(_, f)| f);
        match self.fsdp.as_ref().zip(self.dist.shard()) {
            Some((fsdp, sc)) => Ok(Some(crate::parallel::pp::sharded::gather(
                fsdp,
                sc,
                efsdp,
                &self.named,
                &self.buffers,
                training,
            )?)),
            None => Ok(None),
        }
    }

    /// Sums the step's gradients (and its losses and outputs) over the ranks that computed
    /// parts of them: sequence parallelism's partial ones over `tp`, every one over the
    /// data-parallel ranks (reduce-scattered to the shards under FSDP, the per-block driver's
    /// or the pipeline's `shard_grads`). Returns FSDP's figures of the step.
    pub(super) fn sync_grads(
        &self,
        acc: &mut Accumulated,
        shard_grads: Option<(Vec<Vec<f32>>, Vec<bool>)>,
    ) -> Result<Option<FsdpFigures>, TrainError> {
        let tp = self.dist.tp();
        // The gradients partial over tp (per-head norms; under SP every replicated one) are
        // summed once the micro-batches (or the pipeline's schedule) ran; under FSDP on the
        // shards, below.
        if let (Some(comm), None) = (tp, &self.fsdp) {
            let local = &self.named;
            self.placements
                .sum_partial_grads(Axis::Tp, comm.as_ref(), local)?;
        }
        if self.dist.grads().size() == 1 {
            return Ok(None);
        }
        acc.read_losses()?;
        let gathered = match &self.cp {
            Some(cp) => cp.micro_batch_losses(self.dist.grads(), &acc.losses)?,
            None => self.dist.gather_f32(&acc.losses)?,
        };
        acc.losses = self.dist.micro_batch_losses(gathered);
        acc.outputs.reduce_across(self.dist.grads())?;
        let (dp, replicate) = (self.dist.grads(), self.dist.replicate());
        let mut figures = None;
        match (&self.units, shard_grads) {
            (Some(u), _) => {
                let grads = u.borrow_mut().take_grads();
                match grads.device_rows {
                    Some(rows) => crate::parallel::fsdp::set_shard_grads_device(
                        dp,
                        replicate,
                        self.dist.replicate_device_comm(),
                        &self.named,
                        rows,
                        &grads.got,
                    )?,
                    None => {
                        Fsdp::set_shard_grads(dp, replicate, &self.named, grads.rows, &grads.got)?
                    }
                }
                figures = Some((
                    grads.full_bytes_peak,
                    grads.early_scatters,
                    grads.gather_bytes,
                ));
            }
            (None, Some((rows, got))) => {
                Fsdp::set_shard_grads(dp, replicate, &self.named, rows, &got)?
            }
            (None, None) => self.dist.all_reduce_grads(&self.named)?,
        }
        // Every rank of a tensor-parallel group holds the same rows of a replicated
        // parameter, so its partial gradients are summed on the shards.
        if let (Some(comm), Some(_)) = (tp, &self.fsdp) {
            let local = &self.named;
            self.placements
                .sum_partial_grads(Axis::Tp, comm.as_ref(), local)?;
        }
        Ok(figures)
    }

    /// Fails the step with [`TrainError::NonFinite`] (its gradients dropped, nothing applied)
    /// when its loss, auxiliary loss or gradient norm is not a number.
    pub(super) fn check_finite(&mut self, step: u64, values: [f64; 3]) -> Result<(), TrainError> {
        let names = ["loss", "auxiliary loss", "gradient norm"];
        for (what, value) in names.into_iter().zip(values) {
            if !value.is_finite() {
                self.zero_grad();
                self.release_full();
                return Err(TrainError::NonFinite { step, what, value });
            }
        }
        Ok(())
    }

    /// The step's `metrics.jsonl` fields beyond the loss: the model's outputs and what each
    /// layout measured.
    pub(super) fn step_fields(
        &self,
        outputs: StepOutputs,
        fsdp: Option<FsdpFigures>,
        pipeline: Option<(f64, f64)>,
        owner: Option<OwnerFigures>,
    ) -> Result<BTreeMap<String, serde_json::Value>, TrainError> {
        let mut fields = outputs.fields()?;
        if let Some((peak, early, gathered)) = fsdp {
            // Bytes of full (gathered) parameters this rank held at once during the
            // step: about the outer unit and two blocks, not the whole model.
            fields.insert("fsdp_full_bytes_peak".into(), peak.into());
            // Block reduce-scatters that overlapped the rest of the backward.
            fields.insert("fsdp_early_scatters".into(), early.into());
            // Bytes this rank sent in parameter all-gathers (as encoded).
            fields.insert("fsdp_gather_bytes".into(), gathered.into());
        }
        if self.cp.is_some() {
            // Bytes this rank's attention ring sent (keys, values and their positions
            // forward; with their gradients backward; again for recomputed blocks).
            fields.insert(
                "cp_ring_bytes".into(),
                crate::parallel::context::take_ring_bytes().into(),
            );
        }
        if let Some(g) = &self.experts {
            // Bytes this rank sent in the MoE layers' expert exchanges (counts and
            // token rows, forward and backward).
            fields.insert("ep_a2a_bytes".into(), g.take_bytes().into());
        }
        if let Some((measured, theory)) = pipeline {
            // The pipeline ranks' time waiting on a neighbour over their whole time
            // in the schedule, beside the schedule's theory.
            fields.insert("pp_bubble".into(), measured.into());
            fields.insert("pp_bubble_theory".into(), theory.into());
        }
        if let Some(o) = owner {
            // The owner layout of a whole-matrix optimizer (Muon) on this rank: the
            // matrices it updated whole, their estimated work and the bytes it sent.
            fields.insert("owner_matrices".into(), o.owned.into());
            fields.insert("owner_work".into(), o.work.into());
            fields.insert("owner_bytes".into(), o.bytes.into());
        }
        if self.lora.is_some() {
            // What LoRA trains and what its optimizer holds, against the frozen base.
            let numel = |v: &[(String, Tensor)]| v.iter().map(|(_, p)| p.numel()).sum::<usize>();
            let optimizer: usize = (self.optimizer.state().values())
                .map(|t| t.numel() * t.dtype().size_in_bytes())
                .sum();
            fields.insert("trainable_params".into(), numel(&self.named).into());
            fields.insert("frozen_params".into(), numel(&self.frozen).into());
            fields.insert("optimizer_bytes".into(), optimizer.into());
        }
        if let super::data::Loader::Stream(s) = &self.loader {
            // Seconds the trainer has waited on the background tokenization since start.
            fields.insert("data_wait_s".into(), s.waited().as_secs_f64().into());
        }
        if let super::data::Loader::Mixture(m) = &self.loader {
            // Rows drawn from each source of the mixture so far (every rank reads the whole
            // global batch, so this counts the job's rows).
            fields.insert("data_source_rows".into(), m.rows_per_source().into());
        }
        Ok(fields)
    }
}
