//! Tensor (and sequence) parallelism in the trainer: which parameters are split and how
//! ([`TpLayout`], from the placement every parameter declares), this rank's slices of them,
//! the group the forward's collectives run over, and what the step does beside the forward:
//! the norm counts each slice once, sequence parallelism sums the replicated parameters'
//! partial gradients, and checkpoints hold global pieces so any layout reads them.
//!
//! Like the expert group ([`crate::parallel::ep`]), the communicator lives in a thread-local while a step
//! (or an evaluation) runs: the engine's group object must be `Send + Sync` (autograd keeps it
//! for the backward), the communicators are not, and both only run on the training thread.
//!
//! Initialisation draws every parameter whole from its named stream and keeps this rank's
//! slice, so the start does not depend on the layout.

use super::nccl_groups;
use crate::TrainError;
use anneal_config::JobConfig;
use anneal_dist::Collective;
use anneal_engine::{Storage, Tensor};
use anneal_plugin_api::spec::{ModelSpec, TensorParallel as TpSplit};
use anneal_runtime::plugins::{
    Params, Stage, StageParams, TensorParallelGroup, TensorParallelism, TpGroup,
};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;

type Named = Vec<(String, Tensor)>;

/// How the model's parameters split over the tensor-parallel group, and this rank's place.
pub(crate) struct TpLayout {
    splits: Arc<HashMap<String, TpSplit>>,
    /// The dim each split parameter is cut along, and its number of dims: `[out, in]` weights
    /// are cut along 0 (column, vocab) or 1 (row), stacked experts' `[expert, out, in]` along
    /// 1 or 2.
    dims: HashMap<String, (usize, usize)>,
    /// The replicated parameters applied to each head apart (per-head norms), whose
    /// gradients are partial on every rank.
    per_head: HashSet<String>,
    rank: usize,
    ranks: usize,
    sequence: bool,
}

fn config_err(msg: String) -> TrainError {
    TrainError::Config(format!("config: {msg}"))
}

impl TpLayout {
    /// The layout of `spec` over `ranks` tensor-parallel ranks, or the user error naming the
    /// keys: a model this does not run (a plugin without tensor-parallel support, a parameter
    /// of two or more dims without a placement), heads or a split dim that `ranks` does not
    /// divide, a sequence that does not split under sequence parallelism. Experts split by
    /// width here may also be split by expert over `ep` (FSDP's expert slices of the local
    /// stacks, [`crate::parallel::fsdp::Experts`]).
    pub fn new(
        cfg: &JobConfig,
        spec: &ModelSpec,
        rank: usize,
        ranks: usize,
    ) -> Result<TpLayout, TrainError> {
        let model = format!("{}/{}", cfg.model.plugin, cfg.model.flavor);
        let mut layout = TpLayout::of_model(&model, spec, rank, ranks)?;
        let (n, key) = (ranks, "`parallelism.tp`");
        let sequence = cfg.parallelism.tp_sequence;
        let seq = cfg.training.seq_len;
        if sequence && !seq.is_multiple_of(n) {
            return Err(config_err(format!(
                "`parallelism.tp_sequence` splits `training.seq_len` ({seq}) over {key} = {n} ranks, which does not divide it; pick a seq_len that is a multiple of {n}"
            )));
        }
        layout.sequence = sequence;
        Ok(layout)
    }

    /// The layout of `spec` (named `model` in errors) over `ranks` ranks, without sequence
    /// parallelism: the checks of [`TpLayout::new`] that concern the model alone. A matrix
    /// declared replicated (FSDP does not shard it: a router) stays whole on every rank.
    pub(crate) fn of_model(
        model: &str,
        spec: &ModelSpec,
        rank: usize,
        ranks: usize,
    ) -> Result<TpLayout, TrainError> {
        let n = ranks;
        let key = "`parallelism.tp`";
        let hf = spec.hf.as_ref().map(|h| &h.config);
        let field = |k: &str| hf.and_then(|c| c.get(k)).and_then(|v| v.as_u64());
        // The plugin says whether its forward runs on a rank's share of heads and widths.
        if !spec.parallel.tensor {
            return Err(config_err(format!(
                "{key} = {n}: {model} ({} / {}) does not declare tensor-parallel support (its plugin's `ModelSpec::parallel.tensor`); set parallelism.tp = 1",
                spec.architecture,
                hf.and_then(|c| c.get("model_type"))
                    .and_then(|v| v.as_str())
                    .unwrap_or("no Hugging Face model_type")
            )));
        }
        for (k, arg) in [
            ("num_attention_heads", "n_heads"),
            ("num_key_value_heads", "n_kv_heads"),
        ] {
            if let Some(h) = field(k) {
                if !h.is_multiple_of(n as u64) {
                    return Err(config_err(format!(
                        "{key} = {n} does not divide the {h} {} of {model} (`model.args.{arg}`); each rank must hold whole heads: pick a tp that divides {h}",
                        if arg == "n_heads" { "attention heads" } else { "key/value heads" }
                    )));
                }
            }
        }
        let mut splits = HashMap::new();
        let mut dims = HashMap::new();
        for p in &spec.params {
            match p.placement.tensor_parallel {
                Some(split) => {
                    // `[out, in]`, or stacked experts' `[expert, out, in]`.
                    let experts = p.placement.expert_dim == Some(0);
                    let ndim = if experts { 3 } else { 2 };
                    let dim = cut_dim(split, ndim);
                    let size = p.shape.get(dim).copied().unwrap_or(0);
                    if p.shape.len() != ndim || !size.is_multiple_of(n) {
                        return Err(config_err(format!(
                            "{key} = {n} does not divide dim {dim} of parameter {} {:?} of {model} ({}); pick a tp that divides it",
                            p.name,
                            p.shape,
                            what_dim(split, experts)
                        )));
                    }
                    splits.insert(p.name.clone(), split);
                    dims.insert(p.name.clone(), (dim, ndim));
                }
                // Kept whole on every rank (a router: every rank routes the whole batch).
                None if p.shape.len() == 2 && !p.placement.fsdp => {}
                None if p.shape.len() >= 2 => {
                    return Err(config_err(format!(
                        "{key} = {n}: parameter {} {:?} of {model} declares no tensor-parallel placement (column, row or vocab), so it cannot be split; set parallelism.tp = 1",
                        p.name, p.shape
                    )));
                }
                None => {}
            }
        }
        let per_head = spec
            .params
            .iter()
            .filter(|p| p.placement.per_head && p.placement.tensor_parallel.is_none())
            .map(|p| p.name.clone())
            .collect();
        Ok(TpLayout {
            splits: Arc::new(splits),
            dims,
            per_head,
            rank,
            ranks,
            sequence: false,
        })
    }

    /// One line for the console.
    pub fn summary(&self) -> String {
        let count = |s: TpSplit| self.splits.values().filter(|&&v| v == s).count();
        format!(
            "tp: rank {} of {}: {} column-, {} row- and {} vocab-split parameters{}",
            self.rank,
            self.ranks,
            count(TpSplit::Column),
            count(TpSplit::Row),
            count(TpSplit::Vocab),
            if self.sequence {
                "; sequence parallel"
            } else {
                ""
            }
        )
    }

    /// Whether parameter `name` is split along a dim other than 0 (a weight by its input
    /// features; stacked experts by either), which a checkpoint piece (whole dim-0 rows)
    /// cannot hold: such tensors are gathered whole for a save.
    pub fn is_row_split(&self, name: &str) -> bool {
        self.dims.get(name).is_some_and(|&(dim, _)| dim != 0)
    }

    /// The dim parameter `name` is split along, when it is split.
    pub fn split_dim(&self, name: &str) -> Option<usize> {
        self.dims.get(name).map(|&(dim, _)| dim)
    }

    /// How parameter `name` lies over the tensor-parallel ranks: split along its cut dim, or
    /// whole on every rank.
    pub fn placement(&self, name: &str) -> crate::parallel::Placement {
        match self.split_dim(name) {
            Some(dim) => crate::parallel::Placement::Shard(dim),
            None => crate::parallel::Placement::Replicate,
        }
    }

    /// Whether parameter `name` is split.
    pub fn is_split(&self, name: &str) -> bool {
        self.splits.contains_key(name)
    }

    /// The split dim of `name` and this rank's range of it, given the whole shape.
    pub(crate) fn piece(&self, name: &str, whole: &[usize]) -> Option<(usize, Range<usize>)> {
        let (dim, _) = *self.dims.get(name)?;
        let len = whole.get(dim)? / self.ranks;
        Some((dim, self.rank * len..(self.rank + 1) * len))
    }

    /// The dim-0 rows of `name` this rank holds, when it is split by rows of the whole
    /// (column and vocab splits): what it reads of a checkpoint.
    pub fn rows_of(&self, name: &str, whole: &[usize]) -> Option<Range<usize>> {
        self.piece(name, whole)
            .and_then(|(dim, r)| (dim == 0).then_some(r))
    }

    /// This rank's slice of `t` (the whole tensor `name`), a fresh copy; `t` itself when
    /// `name` is not split.
    pub fn slice(&self, name: &str, t: &Tensor) -> Result<Tensor, TrainError> {
        match self.piece(name, t.shape()) {
            None => Ok(t.clone()),
            Some((dim, r)) => {
                let view = t.detach().narrow(dim as isize, r.start, r.len())?;
                let bytes = view.contiguous()?.to_bytes();
                let t =
                    Tensor::from_storage(Storage::from_bytes(view.dtype(), &bytes), view.shape())?;
                // The copy lives where the whole one does.
                super::staged::place(t, view.device())
            }
        }
    }

    /// This rank's slices of whole trainable parameters, as trainable leaves.
    pub fn slice_params(&self, full: Named) -> Result<Named, TrainError> {
        full.into_iter()
            .map(|(n, p)| {
                if !self.is_split(&n) {
                    return Ok((n, p));
                }
                let t = self.slice(&n, &p)?.requires_grad_();
                Ok((n, t))
            })
            .collect()
    }

    /// The forward's tensor-parallel context.
    pub fn context(&self) -> TensorParallelism {
        TensorParallelism {
            group: TensorParallelGroup {
                group: Arc::new(Group {
                    rank: self.rank,
                    ranks: self.ranks,
                }),
            },
            splits: self.splits.clone(),
            sequence: self.sequence,
        }
    }

    /// Whether parameter `name`'s gradient is partial on each rank of the group (summed over
    /// it before use): a replicated parameter applied per head (each rank applies it to its
    /// share of the heads) always, and every replicated one under sequence parallelism (the
    /// norms, applied to the rank's share of the sequence). The others see whole activations
    /// on every rank and their gradients are already equal.
    pub fn partial_grad(&self, name: &str) -> bool {
        !self.is_split(name) && (self.sequence || self.per_head.contains(name))
    }

    /// This rank's place in the group: `(rank, ranks)`.
    pub fn place(&self) -> (usize, usize) {
        (self.rank, self.ranks)
    }
}

/// The dim a split cuts of a weight with `ndim` dims: `[out, in]`, or stacked experts'
/// `[expert, out, in]` (the vocabulary is the first dim of a table).
fn cut_dim(split: TpSplit, ndim: usize) -> usize {
    match split {
        TpSplit::Vocab => 0,
        TpSplit::Column => ndim - 2,
        TpSplit::Row => ndim - 1,
    }
}

fn what_dim(split: TpSplit, experts: bool) -> &'static str {
    match (split, experts) {
        (TpSplit::Column, false) => "its output features: heads × head_dim or model.args.ffn_dim",
        (TpSplit::Row, false) => "its input features: heads × head_dim or model.args.ffn_dim",
        (TpSplit::Column | TpSplit::Row, true) => {
            "each expert's width: model.args.moe.expert_ffn_dim"
        }
        (TpSplit::Vocab, _) => "the vocabulary: model.args.vocab_size",
    }
}

/// This rank's slice `local` of a tensor split along `dim` joined with the other ranks' (in
/// rank order) into the whole. Collective over `comm`.
pub(crate) fn gather_along(
    comm: &dyn Collective,
    local: &Tensor,
    dim: usize,
) -> Result<Tensor, TrainError> {
    let shape = local.shape();
    // `[outer, len, inner]` around `dim`: each rank's block of `len · inner` values per outer
    // index lands side by side.
    let outer: usize = shape[..dim].iter().product();
    let block: usize = shape[dim..].iter().product();
    let n = comm.size();
    let mine = local.contiguous()?.to_vec_f32();
    let mut all = vec![0f32; mine.len() * n];
    comm.all_gather((&mine[..]).into(), (&mut all[..]).into())?;
    let mut whole = vec![0f32; mine.len() * n];
    for r in 0..n {
        for i in 0..outer {
            let src = &all[r * mine.len() + i * block..r * mine.len() + (i + 1) * block];
            let at = (i * n + r) * block;
            whole[at..at + block].copy_from_slice(src);
        }
    }
    let mut shape = shape.to_vec();
    shape[dim] *= n;
    super::staged::rebuild(whole, &shape, local.dtype(), local.device())
}

thread_local! {
    /// The tensor-parallel communicator active on this thread.
    static ACTIVE: RefCell<Option<Rc<dyn Collective>>> = const { RefCell::new(None) };
}

/// Keeps a tensor-parallel communicator active on this thread until dropped.
pub(crate) struct ActiveTp(());

impl Drop for ActiveTp {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.borrow_mut().take());
    }
}

/// Makes `comm` the communicator of the tensor-parallel ops run on this thread until the guard
/// drops.
pub(crate) fn activate(comm: &Rc<dyn Collective>) -> ActiveTp {
    ACTIVE.with(|a| *a.borrow_mut() = Some(comm.clone()));
    ActiveTp(())
}

fn err(msg: impl std::fmt::Display) -> anneal_engine::Error {
    anneal_engine::Error::Invalid {
        op: "tensor-parallel collective",
        msg: msg.to_string(),
    }
}

fn with_comm<T>(
    f: impl FnOnce(&dyn Collective) -> Result<T, anneal_dist::DistError>,
) -> anneal_engine::Result<T> {
    let comm = ACTIVE
        .with(|a| a.borrow().clone())
        .ok_or_else(|| err("a tensor-parallel op outside a training step"))?;
    f(comm.as_ref()).map_err(err)
}

/// What the engine holds: the group's shape; the communicator is looked up when used.
struct Group {
    rank: usize,
    ranks: usize,
}

impl TpGroup for Group {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> anneal_engine::Result<()> {
        with_comm(|c| c.all_reduce_sum(buf))
    }

    fn all_gather(&self, local: &[f32]) -> anneal_engine::Result<Vec<f32>> {
        let mut out = vec![0f32; local.len() * self.ranks];
        with_comm(|c| c.all_gather(local.into(), (&mut out[..]).into()))?;
        Ok(out)
    }

    fn reduce_scatter_sum(&self, send: &[f32]) -> anneal_engine::Result<Vec<f32>> {
        let mut out = vec![0f32; send.len() / self.ranks.max(1)];
        with_comm(|c| c.reduce_scatter_sum(send, &mut out))?;
        Ok(out)
    }

    // The tensor forms take NCCL on device buffers when the job installed a `tp`
    // communicator ([`super::nccl_groups`]), else stage through host memory as the slices do.

    fn all_reduce_sum_tensor(&self, x: &Tensor) -> anneal_engine::Result<Tensor> {
        match nccl_groups::comm_for(nccl_groups::Group::Tp, x) {
            Some(nccl) => nccl_groups::all_reduce(&nccl, x),
            None => anneal_engine::ops::staged_all_reduce(self, x),
        }
    }

    fn all_gather_tensor(&self, x: &Tensor) -> anneal_engine::Result<Tensor> {
        match nccl_groups::comm_for(nccl_groups::Group::Tp, x) {
            Some(nccl) => nccl_groups::all_gather(&nccl, x),
            None => anneal_engine::ops::staged_all_gather(self, x),
        }
    }

    fn reduce_scatter_sum_tensor(&self, x: &Tensor) -> anneal_engine::Result<Tensor> {
        match nccl_groups::comm_for(nccl_groups::Group::Tp, x) {
            Some(nccl) => nccl_groups::reduce_scatter(&nccl, x),
            None => anneal_engine::ops::staged_reduce_scatter(self, x),
        }
    }
}

/// The stage hook of a tensor-parallel forward without FSDP: every stage reads the rank's
/// resident slices, and the runner gets the tensor-parallel context.
pub(crate) struct TpHook {
    /// What every stage reads.
    pub params: Params,
    /// The context the `linear` / `embedding` host ops use.
    pub tp: TensorParallelism,
}

impl StageParams for TpHook {
    fn params(&self, _stage: Stage) -> anneal_engine::Result<Params> {
        Ok(self.params.clone())
    }

    fn after_forward(&self, _stage: Stage) -> anneal_engine::Result<()> {
        Ok(())
    }

    fn before_backward(&self, _layer: usize) -> anneal_engine::Result<()> {
        Ok(())
    }

    fn tensor_parallel(&self) -> Option<TensorParallelism> {
        Some(self.tp.clone())
    }
}
