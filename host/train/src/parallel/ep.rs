//! The expert group's exchange for expert parallelism: what the MoE layers
//! (`anneal_engine::ops::moe_ffn_ep`) send token rows over. The trainer activates it around a
//! step's (or an evaluation's) forwards and backwards; the FSDP driver's stage hook hands it to
//! the model runner (`StageParams::expert_parallel`), which gives it to the MoE host op, so a
//! plugin never sees it. A pipeline stage, whose parameters are gathered once per step, hands
//! it over through [`resident_opts`]; its expert group is the shard ranks of the same stage,
//! which run the same schedule and so reach each MoE layer's exchange in the same order.
//!
//! Like the FSDP driver, it lives in a thread-local while active: the engine's exchange object
//! must be `Send + Sync` (autograd keeps it for the backward), the communicators are not, and
//! both only ever run on the training thread.

use super::nccl_groups;
use crate::TrainError;
use anneal_dist::{Collective, Pending};
use anneal_engine::ops::{
    staged_start_rows, ExpertExchange, ExpertParallel, RowsInFlight, TensorInFlight,
};
use anneal_engine::Tensor;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

/// The expert group of this rank: its own communicator (split from the expert group's at the
/// first activation) and the bytes sent through it.
pub(crate) struct ExpertGroup {
    comm: RefCell<Option<Box<dyn Collective>>>,
    /// `(rank, ranks)` once split.
    place: Cell<(usize, usize)>,
    bytes: Cell<u64>,
}

thread_local! {
    /// The expert group active on this thread.
    static ACTIVE: RefCell<Option<Rc<ExpertGroup>>> = const { RefCell::new(None) };
}

/// Keeps an expert group active on this thread until dropped.
pub(crate) struct ActiveGroup(());

impl Drop for ActiveGroup {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.borrow_mut().take());
    }
}

impl ExpertGroup {
    /// A group not yet split (collectives wait for the first step: rank 0 builds its trainer
    /// while the others wait for it).
    pub fn new() -> Rc<ExpertGroup> {
        Rc::new(ExpertGroup {
            comm: RefCell::new(None),
            place: Cell::new((0, 1)),
            bytes: Cell::new(0),
        })
    }

    /// Makes `this` the group of the MoE layers run on this thread until the guard drops;
    /// `ep` is the expert group's communicator (collective at the first call, which splits it).
    pub fn activate(
        this: &Rc<ExpertGroup>,
        ep: &dyn Collective,
    ) -> Result<ActiveGroup, TrainError> {
        if this.comm.borrow().is_none() {
            let comm = ep.split(0, ep.rank() as u32)?;
            this.place.set((comm.rank(), comm.size()));
            *this.comm.borrow_mut() = Some(comm);
        }
        ACTIVE.with(|a| *a.borrow_mut() = Some(this.clone()));
        Ok(ActiveGroup(()))
    }

    /// Bytes this rank sent in expert exchanges since the last call.
    pub fn take_bytes(&self) -> u64 {
        self.bytes.replace(0)
    }
}

/// The active group's exchange for the MoE layers, if a group is active on this thread.
pub(crate) fn current() -> Option<ExpertParallel> {
    let group = ACTIVE.with(|a| a.borrow().clone())?;
    let (rank, ranks) = group.place.get();
    Some(ExpertParallel {
        exchange: Arc::new(Exchange { rank, ranks }),
    })
}

fn err(msg: impl std::fmt::Display) -> anneal_engine::Error {
    anneal_engine::Error::Invalid {
        op: "expert exchange",
        msg: msg.to_string(),
    }
}

/// Runs `f` on the active group's communicator, counting `bytes` sent.
fn with_comm<T>(
    bytes: usize,
    f: impl FnOnce(&dyn Collective) -> Result<T, anneal_dist::DistError>,
) -> anneal_engine::Result<T> {
    let group = ACTIVE
        .with(|a| a.borrow().clone())
        .ok_or_else(|| err("an expert exchange outside a training step"))?;
    let comm = group.comm.borrow();
    let comm = comm
        .as_ref()
        .ok_or_else(|| err("an expert exchange before the group was split"))?;
    group.bytes.set(group.bytes.get() + bytes as u64);
    f(comm.as_ref()).map_err(err)
}

/// What the engine holds: the group's shape; the communicator is looked up when used.
struct Exchange {
    rank: usize,
    ranks: usize,
}

struct InFlight(Box<dyn Pending>);

impl RowsInFlight for InFlight {
    fn wait(self: Box<Self>) -> anneal_engine::Result<Vec<f32>> {
        self.0.wait().map_err(err)
    }
}

impl ExpertExchange for Exchange {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn all_to_all(&self, send: &[i64]) -> anneal_engine::Result<Vec<i64>> {
        let n = send.len() / self.ranks.max(1);
        let counts = vec![n; self.ranks];
        let mut recv = vec![0i64; n * self.ranks];
        with_comm(send.len() * 8, |c| {
            c.all_to_all_v(send.into(), &counts, (&mut recv[..]).into(), &counts)
        })?;
        Ok(recv)
    }

    fn start(
        &self,
        send: Vec<f32>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> anneal_engine::Result<Box<dyn RowsInFlight>> {
        let pending = with_comm(send.len() * 4, |c| {
            c.iall_to_all_v(send, send_counts, recv_counts)
        })?;
        Ok(Box::new(InFlight(pending)))
    }

    /// NCCL on device buffers when the job installed an `ep` communicator of this group's
    /// ranks ([`super::nccl_groups`]); staged through host memory otherwise.
    fn start_rows(
        &self,
        x: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> anneal_engine::Result<Box<dyn TensorInFlight>> {
        use anneal_dist::Collective as _;
        let nccl = nccl_groups::comm_for(nccl_groups::Group::Ep, x)
            .filter(|n| n.size() == self.ranks && n.rank() == self.rank);
        let Some(nccl) = nccl else {
            return staged_start_rows(self, x, send_rows, recv_rows);
        };
        // Counted as the staged path counts it: f32 values sent (the `ep_bytes` metric).
        let width = x.shape().get(1).copied().unwrap_or(0);
        let values = send_rows.iter().sum::<usize>() * width;
        with_comm(values * 4, |_| Ok(()))?;
        let rows = nccl_groups::exchange_rows(&nccl, x, send_rows, recv_rows)?;
        Ok(Box::new(Arrived(rows)))
    }
}

/// Rows an NCCL exchange has already delivered (it waits for its stream before returning).
struct Arrived(Tensor);

impl TensorInFlight for Arrived {
    fn wait(self: Box<Self>) -> anneal_engine::Result<Tensor> {
        Ok(self.0)
    }
}

/// The expert-parallel layout of the model's expert parameters for this rank, or the user error
/// naming the keys: a model without experts, experts that do not split over `ep`, an expert
/// dim other than 0, an optimizer that needs whole matrices.
pub(crate) fn expert_layout(
    cfg: &anneal_config::JobConfig,
    spec: &anneal_plugin_api::spec::ModelSpec,
    optimizer: &anneal_runtime::plugins::PluginOptimizer,
    ep: &dyn anneal_dist::Collective,
    efsdp: &dyn anneal_dist::Collective,
) -> Result<crate::parallel::fsdp::Experts, TrainError> {
    let n = ep.size();
    let model = format!("{}/{}", cfg.model.plugin, cfg.model.flavor);
    if spec.parallel.experts_outside_moe_op {
        return Err(TrainError::Config(format!(
            "config: `parallelism.ep` = {n}: {model} runs its experts with its own grouped products (a latent mixture of experts), not the host's MoE op that expert parallelism splits; set parallelism.ep = 1"
        )));
    }
    let mut names = std::collections::HashSet::new();
    for p in &spec.params {
        match p.placement.expert_dim {
            None => {}
            Some(0) => {
                let e = p.shape.first().copied().unwrap_or(0);
                if !e.is_multiple_of(n) {
                    return Err(TrainError::Config(format!(
                        "config: `parallelism.ep` = {n} does not divide the {e} experts of {model} (parameter {}); pick an ep that divides {e}",
                        p.name
                    )));
                }
                names.insert(p.name.clone());
            }
            Some(d) => {
                return Err(TrainError::Config(format!(
                    "config: `parallelism.ep` = {n}: parameter {} of {model} indexes its experts on dim {d}, and expert parallelism splits dim 0 only; set parallelism.ep = 1",
                    p.name
                )))
            }
        }
    }
    if names.is_empty() {
        return Err(TrainError::Config(format!(
            "config: `parallelism.ep` = {n}, but {model} has no experts (no parameter declares an expert dim); set parallelism.ep = 1"
        )));
    }
    if optimizer.spec().needs_full_matrix {
        return Err(TrainError::Config(format!(
            "config: `parallelism.ep` = {n} with `optimizer.plugin` = {}: an optimizer that steps whole matrices does not run under expert parallelism yet; set parallelism.ep = 1 or use adamw",
            cfg.optimizer.plugin
        )));
    }
    Ok(crate::parallel::fsdp::Experts {
        names,
        slice: (ep.rank(), n),
        efsdp: (efsdp.rank(), efsdp.size()),
    })
}

/// The stage source of a forward whose parameters are all resident under expert parallelism
/// (a pipeline stage's, gathered once per step): every stage reads `params`, whose expert
/// weights are this rank's slice of the experts, and the MoE layers exchange token rows over
/// the group active on this thread.
struct ResidentExperts {
    params: anneal_runtime::plugins::Params,
    /// Under `tp` too: the slices' tensor-parallel context.
    tp: Option<anneal_runtime::plugins::TensorParallelism>,
}

impl anneal_runtime::plugins::StageParams for ResidentExperts {
    fn params(
        &self,
        _stage: anneal_runtime::plugins::Stage,
    ) -> anneal_engine::Result<anneal_runtime::plugins::Params> {
        Ok(self.params.clone())
    }

    fn after_forward(&self, _stage: anneal_runtime::plugins::Stage) -> anneal_engine::Result<()> {
        Ok(())
    }

    fn before_backward(&self, _layer: usize) -> anneal_engine::Result<()> {
        Ok(())
    }

    fn expert_parallel(&self) -> Option<ExpertParallel> {
        current()
    }

    fn tensor_parallel(&self) -> Option<anneal_runtime::plugins::TensorParallelism> {
        self.tp.clone()
    }
}

/// `opts` for a forward over the resident `params` whose MoE layers run expert-parallel over
/// the active group (a pipeline stage under `pp` × `ep`), with `tp`'s context when the
/// parameters are tensor-parallel slices too.
pub(crate) fn resident_opts(
    opts: &anneal_runtime::plugins::ForwardOpts,
    params: &anneal_runtime::plugins::Params,
    tp: Option<anneal_runtime::plugins::TensorParallelism>,
) -> anneal_runtime::plugins::ForwardOpts {
    let mut opts = opts.clone();
    opts.stage_params = Some(Arc::new(ResidentExperts {
        params: params.clone(),
        tp,
    }));
    opts
}

/// The expert-parallel layout of the expert parameters under `ep > 1` (see
/// [`expert_layout`]), with its line for the log; `None` without expert parallelism.
pub(crate) fn layout_of(
    cfg: &anneal_config::JobConfig,
    dist: &crate::parallel::dist::Dist,
    spec: &anneal_plugin_api::spec::ModelSpec,
    optimizer: &anneal_runtime::plugins::PluginOptimizer,
    note: &dyn Fn(&str),
) -> Result<Option<crate::parallel::fsdp::Experts>, TrainError> {
    let Some((ep, efsdp)) = dist.experts() else {
        return Ok(None);
    };
    let e = expert_layout(cfg, spec, optimizer, ep, efsdp)?;
    note(&format!(
        "ep: {} expert parameters in {} slices of experts (this rank: slice {}), each sharded over {} rank(s)",
        e.names.len(),
        e.slice.1,
        e.slice.0,
        e.efsdp.1
    ));
    Ok(Some(e))
}
