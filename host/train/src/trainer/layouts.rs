//! The parallel layouts a trainer takes once built whole, in the order TorchTitan applies
//! them: context parallelism's positions and ring, tensor parallelism's slices, the pipeline's
//! stages, then FSDP last (over a stage's parameters or the whole model's blocks), each with
//! the expert groups expert parallelism needs.

use super::Trainer;
use crate::parallel::ep::ExpertGroup;
use crate::parallel::fsdp::{Fsdp, GatherCodec, Units};
use crate::parallel::{Axis, Placement, Placements};
use crate::TrainError;
use anneal_config::JobConfig;
use std::cell::RefCell;
use std::rc::Rc;

impl Trainer {
    /// Applies the layouts of the trainer's mesh (`self.dist`) to its whole parameters:
    /// afterwards `named` holds this rank's part (slices, stages, shards) and `params` what
    /// the forward reads. User errors name the keys.
    pub(super) fn apply_layouts(
        &mut self,
        cfg: &JobConfig,
        note: &dyn Fn(&str),
    ) -> Result<(), TrainError> {
        let t = &cfg.training;
        let mut placements = Placements::replicated(self.named.iter().map(|(n, _)| n.clone()));
        if let Some(ring) = self.dist.take_ring_comm() {
            let cp = crate::parallel::cp::Context::activate(ring);
            self.positions = cp.positions(t.seq_len)?;
            note(&cp.summary(t.seq_len));
            self.cp = Some(cp);
        }
        if let Some(comm) = self.dist.tp() {
            let layout = crate::parallel::tp::TpLayout::new(
                cfg,
                self.model.spec(),
                comm.rank(),
                comm.size(),
            )?;
            if self.optimizer.spec().needs_full_matrix {
                return Err(TrainError::Config(format!(
                    "config: `parallelism.tp` = {} with `optimizer.plugin` = {}: an optimizer that steps whole matrices would see this rank's slices only; set parallelism.tp = 1 or use adamw",
                    comm.size(),
                    cfg.optimizer.plugin
                )));
            }
            note(&layout.summary());
            placements = placements
                .with(Axis::Tp, |n| layout.placement(n))
                .with_partial_grads(Axis::Tp, |n| layout.partial_grad(n));
            self.named = layout.slice_params(std::mem::take(&mut self.named))?;
            self.params = self.resident_params();
            self.tp = Some(layout);
        }
        if let Some(comm) = self.dist.pp() {
            let micro = self
                .dist
                .local_micro_batches(t.batch_size / t.micro_batch_size);
            let all = std::mem::take(&mut self.named);
            let buffers = std::mem::take(&mut self.buffers);
            let (pipeline, mine, my_buffers) =
                crate::parallel::pp::setup(cfg, &self.model, comm.rank(), all, buffers, micro)?;
            note(&pipeline.summary(micro));
            self.named = mine;
            self.buffers = my_buffers;
            self.params = self.resident_params();
            self.pipeline = Some(pipeline);
            placements = placements.with(Axis::Pp, |_| Placement::Stage);
        }
        if let (Some(comm), Some(_)) = (self.dist.shard(), &self.pipeline) {
            // FSDP inside the stages: the shards rest here; a step gathers the stage whole
            // (crate::parallel::pp::sharded), its experts to this rank's slice under expert parallelism.
            let experts = crate::parallel::ep::layout_of(
                cfg,
                &self.dist,
                self.model.spec(),
                &self.optimizer,
                note,
            )?;
            self.experts = experts.as_ref().map(|_| ExpertGroup::new());
            let fsdp = Fsdp::new(&self.named, comm.rank(), comm.size(), experts.as_ref());
            note(&format!(
            "fsdp: this rank's stage parameters sharded over {} rank(s), gathered once per step",
            comm.size()
        ));
            self.named = fsdp.shard(&self.named)?;
            self.fsdp = Some(fsdp);
            self.release_full();
        } else if let Some(comm) = self.dist.shard() {
            let spec = self.model.spec();
            let layers: std::collections::HashMap<&str, Option<usize>> = spec
                .params
                .iter()
                .map(|p| (p.name.as_str(), p.layer))
                .collect();
            let par = &cfg.parallelism;
            let block = usize::try_from(par.fsdp_all_gather_block).unwrap_or(0);
            let codec = GatherCodec::parse(&par.fsdp_all_gather_dtype, block)?;
            let experts = crate::parallel::ep::layout_of(
                cfg,
                &self.dist,
                self.model.spec(),
                &self.optimizer,
                note,
            )?;
            self.experts = experts.as_ref().map(|_| ExpertGroup::new());
            let units = Units::new(
                &self.named,
                |name| layers.get(name).copied().flatten(),
                spec.n_layers,
                (comm.rank(), comm.size()),
                experts.as_ref(),
                codec,
            );
            note(&units.summary());
            let fsdp = Fsdp::new(&self.named, comm.rank(), comm.size(), experts.as_ref());
            self.named = fsdp.shard(&self.named)?;
            self.fsdp = Some(fsdp);
            self.units = Some(Rc::new(RefCell::new(units)));
            self.release_full();
        }
        if self.fsdp.is_some() {
            // Every parameter's padded rows (a stage's, under pipeline parallelism).
            placements = placements.with(Axis::DpShard, |_| Placement::Shard(0));
        }
        self.placements = placements;
        Ok(())
    }
}
