//! Expert parallelism for a policy trained outside the pretraining step (`anneal rl` under
//! `parallelism.ep`, which borrows the `dp_shard` ranks). Each rank keeps its slice of the
//! experts ([`Experts`]: `1 / ep` of every expert stack, sharded again over the efsdp ranks
//! holding the same slice) beside its FSDP rows of the dense parameters, with their optimizer
//! state. A step's gather ([`FsdpPolicy::gather`]) makes the dense parameters whole and the
//! experts this rank's slice: the trainer's forward runs on that with the expert group active
//! ([`FsdpPolicy::activate_experts`], [`FsdpPolicy::trainer_opts`]), so its MoE layers send
//! token rows to the experts' ranks ([`crate::parallel::ep`]) and each rank computes and keeps
//! its own experts' gradients. The rollouts decode token by token with no exchange, so they
//! get the experts made whole over the expert group ([`FsdpPolicy::whole_experts`], exact f32):
//! a row's arithmetic in an expert is the same on any rank (batch-invariant products), so the
//! trainer's logprobs are the rollouts' bits.

use super::FsdpPolicy;
use crate::parallel::ep::{ActiveGroup, ExpertGroup};
use crate::parallel::fsdp::{Experts, Fsdp};
use crate::{Dist, TrainError};
use anneal_config::JobConfig;
use anneal_dist::{Collective, Dim0Shard};
use anneal_engine::Tensor;
use anneal_runtime::plugins::{ForwardOpts, Params, PluginOptimizer};
use std::rc::Rc;

type Named = Vec<(String, Tensor)>;

/// The expert-parallel part of a sharded policy: which parameters are experts and this
/// rank's slice of them, and the expert group the MoE layers exchange rows over.
pub(in crate::parallel::fsdp) struct PolicyExperts {
    layout: Experts,
    group: Rc<ExpertGroup>,
}

/// Keeps the policy's expert group active on this thread (for a trainer step's forward and
/// backward) until dropped.
pub struct ExpertsActive(#[allow(dead_code)] ActiveGroup);

impl FsdpPolicy {
    /// The layout of the whole trainable parameters `named` (sorted by name) over the
    /// `dp_shard` group of `dist`, when parameters are sharded; under `parallelism.ep` each
    /// rank keeps its slice of the experts (see the module docs). A model or optimizer that
    /// expert parallelism does not take is a user error naming the keys; `note` gets the
    /// layout's line for the log.
    pub fn of_dist_with_experts(
        cfg: &JobConfig,
        dist: &Dist,
        named: &[(String, Tensor)],
        spec: &anneal_plugin_api::spec::ModelSpec,
        optimizer: &PluginOptimizer,
        note: &dyn Fn(&str),
    ) -> Result<Option<FsdpPolicy>, TrainError> {
        let Some(layout) = crate::parallel::ep::layout_of(cfg, dist, spec, optimizer, note)? else {
            return Ok(FsdpPolicy::of_dist(dist, named));
        };
        let Some(comm) = dist.shard() else {
            return Err(TrainError::Config(
                "config: `parallelism.ep` needs `parallelism.dp_shard` ranks to borrow".into(),
            ));
        };
        Ok(Some(FsdpPolicy {
            fsdp: Fsdp::new(named, comm.rank(), comm.size(), Some(&layout)),
            place: (comm.rank(), comm.size()),
            experts: Some(PolicyExperts {
                layout,
                group: ExpertGroup::new(),
            }),
        }))
    }

    /// Whether the experts are split over an expert group.
    pub fn expert_parallel(&self) -> bool {
        self.experts.is_some()
    }

    /// The communicator an expert parameter's rows are sharded over (the ranks holding the
    /// same slice of experts), under expert parallelism.
    pub(super) fn efsdp<'a>(&self, dist: &'a Dist) -> Option<&'a dyn Collective> {
        self.experts.as_ref()?;
        dist.experts().map(|(_, efsdp)| efsdp)
    }

    /// `gathered` (from [`FsdpPolicy::gather`]) with every expert parameter's slice made whole
    /// over the expert group (the slices in expert order, exact f32), not trainable; the dense
    /// tensors are passed as they are. Unchanged without expert parallelism. Collective over
    /// the expert group.
    pub fn whole_experts(&self, dist: &Dist, gathered: Named) -> Result<Named, TrainError> {
        let Some(e) = &self.experts else {
            return Ok(gathered);
        };
        let (ep, _) = dist.experts().ok_or_else(|| {
            TrainError::Config("ep: an expert-parallel policy without an expert group".into())
        })?;
        let (slice, slices) = e.layout.slice;
        gathered
            .into_iter()
            .map(|(n, t)| {
                if !e.layout.names.contains(&n) {
                    return Ok((n, t));
                }
                let mut shape = t.shape().to_vec();
                if let Some(d0) = shape.first_mut() {
                    *d0 *= slices;
                }
                // The slices divide the experts evenly (checked by the layout): no padding.
                let rows = Dim0Shard::new(&shape, slice, slices);
                let whole = rows.all_gather(ep, &t.to_vec_f32())?;
                let whole = crate::parallel::staged::rebuild(whole, &shape, t.dtype(), t.device())?;
                Ok((n, whole))
            })
            .collect()
    }

    /// Activates the expert group on this thread for a trainer step (collective over the group
    /// the first time, which splits its communicator); `None` without expert parallelism.
    pub fn activate_experts(&self, dist: &Dist) -> Result<Option<ExpertsActive>, TrainError> {
        let Some(e) = &self.experts else {
            return Ok(None);
        };
        let (ep, _) = dist.experts().ok_or_else(|| {
            TrainError::Config("ep: an expert-parallel policy without an expert group".into())
        })?;
        Ok(Some(ExpertsActive(ExpertGroup::activate(&e.group, ep)?)))
    }

    /// `opts` for the trainer's forward over `params` (from [`FsdpPolicy::gather`]): under
    /// expert parallelism every stage reads `params` and the MoE layers run their experts over
    /// the active group; `opts` as they are otherwise.
    pub fn trainer_opts(&self, opts: &ForwardOpts, params: &Params) -> ForwardOpts {
        match &self.experts {
            Some(_) => crate::parallel::ep::resident_opts(opts, params, None),
            None => opts.clone(),
        }
    }
}
