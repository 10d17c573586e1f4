//! Tensor parallelism with FSDP (`tp` × `dp_shard`), FSDP applied last as TorchTitan does:
//! each tensor-parallel rank first keeps its slices of the split parameters ([`TpLayout`]),
//! then those local slices (and the replicated parameters) are sharded by dim-0 rows over the
//! rank's `dp_shard` group exactly as plain FSDP shards whole parameters ([`crate::fsdp`]). The
//! per-block gather hook therefore hands the runner the local slices, which the tensor-parallel
//! host ops use as they do without FSDP ([`Hook`]).
//!
//! Gradients travel the FSDP way only: reduce-scattered over `dp_shard` (then summed over
//! `dp_replicate` under HSDP), never over `tp` for a split parameter, whose slices are
//! different tensors; under sequence parallelism the replicated parameters' shard gradients are
//! then summed over `tp` ([`TpLayout::sum_replicated_grads`] on the shards: every rank of a
//! tensor-parallel group holds the same rows of them). The norm is the placements' one
//! ([`crate::parallel`]).
//!
//! Checkpoints hold global pieces, so any layout reads them: a column- or vocab-split slice's
//! shard rows are rows of the whole, written by the rank holding them; a replicated
//! parameter's by the group's first tensor-parallel rank; the shard rows of a parameter split
//! along a dim other than 0 (a row split, or a stacked experts' weight split by width) are
//! gathered over `tp` only (each rank gets its `1 / dp_shard` of the rows, full width) and the
//! `tp` ranks write a share of those rows each ([`TpFsdpSave`]), since a piece may cut dim 0
//! alone. No rank ever holds a whole row-split tensor to save it.

use crate::checkpoint::{Loaded, PieceRef};
use crate::fsdp::Fsdp;
use crate::tp::TpLayout;
use crate::TrainError;
use anneal_dist::Collective;
use anneal_engine::{Storage, Tensor};
use anneal_runtime::plugins::{
    Params, PluginModel, PluginOptimizer, Stage, StageParams, TensorParallelism,
};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

type Named = Vec<(String, Tensor)>;

/// The runner's stage hook under TP × FSDP: the FSDP driver's per-block gathers (of the local
/// slices) with the tensor-parallel context beside them.
pub(crate) struct Hook {
    /// The context the `linear` / `embedding` host ops use.
    pub tp: TensorParallelism,
}

impl StageParams for Hook {
    fn params(&self, stage: Stage) -> anneal_engine::Result<Params> {
        crate::fsdp::Hook.params(stage)
    }

    fn after_forward(&self, stage: Stage) -> anneal_engine::Result<()> {
        crate::fsdp::Hook.after_forward(stage)
    }

    fn before_backward(&self, layer: usize) -> anneal_engine::Result<()> {
        crate::fsdp::Hook.before_backward(layer)
    }

    fn tensor_parallel(&self) -> Option<TensorParallelism> {
        Some(self.tp.clone())
    }
}

/// A tensor split along a dim other than 0: this rank's share of it for its checkpoint piece,
/// `(key, rows, whole shape, first row)`.
pub(crate) type Gathered = (String, Tensor, Vec<usize>, usize);

/// What a TP × FSDP rank saves beside its own rows: its share of the row-split tensors' shard
/// rows, gathered over `tp` by [`TpFsdpSave::prepare`].
#[derive(Default)]
pub(crate) struct TpFsdpSave {
    gathered: RefCell<Vec<Gathered>>,
}

impl TpFsdpSave {
    /// Gathers over `tp` the shard rows of every row-split parameter in `shards` (and of its
    /// parameter-shaped optimizer state), full width, and keeps this rank's share of those
    /// rows for the next snapshot. Collective over `tp`: every rank of the save group calls it.
    pub fn prepare(
        &self,
        layout: &TpLayout,
        fsdp: &Fsdp,
        tp: &dyn Collective,
        shards: &Named,
        state: &BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        let (t, ranks) = layout.place();
        let mut out = Vec::new();
        for ((name, p), (local, rows)) in shards.iter().zip(fsdp.param_rows()) {
            // Split along a dim other than 0: a 2-d row split, or a stacked experts' weight
            // split by its width (dim 1 or 2 of `[expert, out, in]`).
            let Some(dim) = layout.split_dim(name).filter(|&d| d != 0) else {
                continue;
            };
            let mut whole = local.to_vec();
            whole[dim] *= ranks;
            let tensors = std::iter::once((format!("model/{name}"), p)).chain(
                state
                    .iter()
                    .filter(|(k, s)| param_of_state(k) == Some(name) && s.shape() == p.shape())
                    .map(|(k, s)| (format!("optim/{k}"), s)),
            );
            for (key, local_rows) in tensors {
                let full = crate::tp::gather_along(tp, local_rows, dim)?;
                // This rank's share of the shard's rows (ceil-sized blocks over tp).
                let per = rows.len().div_ceil(ranks);
                let (a, b) = ((t * per).min(rows.len()), ((t + 1) * per).min(rows.len()));
                if a < b {
                    let part = copy_rows(&full, a..b)?;
                    out.push((key, part, whole.clone(), rows.start + a));
                }
            }
        }
        *self.gathered.borrow_mut() = out;
        Ok(())
    }

    /// The row-split shares [`TpFsdpSave::prepare`] gathered, for [`pieces`].
    pub fn gathered(&self) -> std::cell::Ref<'_, Vec<Gathered>> {
        self.gathered.borrow()
    }
}

/// This rank's checkpoint pieces (see the module docs) into `out`: its rows of the column- and
/// vocab-split slices and their state, on the first tensor-parallel rank the replicated ones',
/// its `gathered` share of the row-split ones; `first` (the save group's first rank) also
/// writes the buffers and any state held whole.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pieces<'a>(
    layout: &TpLayout,
    fsdp: &Fsdp,
    first: bool,
    shards: &'a Named,
    buffers: &'a Named,
    state: &'a BTreeMap<String, Tensor>,
    gathered: &'a [Gathered],
    out: &mut Vec<PieceRef<'a>>,
) {
    let (t, ranks) = layout.place();
    // Where a local piece (of the slice shape `local`, from its row `start`) of parameter
    // `name` sits in the global tensor, when this rank writes it.
    let place = |name: &str, local: &[usize], start: usize| -> Option<(Vec<usize>, usize)> {
        match (layout.is_split(name), layout.is_row_split(name)) {
            (_, true) => None,
            (true, false) => {
                let mut whole = local.to_vec();
                whole[0] *= ranks;
                Some((whole, t * local[0] + start))
            }
            (false, false) => (t == 0).then(|| (local.to_vec(), start)),
        }
    };
    for ((n, p), (local, rows)) in shards.iter().zip(fsdp.param_rows()) {
        if let (Some(piece), false) = (place(n, local, rows.start), rows.is_empty()) {
            out.push((format!("model/{n}"), p, Some(piece)));
        }
    }
    for (key, s) in state {
        match fsdp.state_piece(shards, key, s.shape()) {
            Some((local, start)) => {
                let name = param_of_state(key).unwrap_or(key);
                if let (Some(piece), true) = (place(name, &local, start), s.numel() > 0) {
                    out.push((format!("optim/{key}"), s, Some(piece)));
                }
            }
            None if first => out.push((format!("optim/{key}"), s, None)),
            None => {}
        }
    }
    if first {
        out.extend(buffers.iter().map(|(n, b)| (format!("model/{n}"), b, None)));
    }
    out.extend(
        gathered
            .iter()
            .map(|(k, t, whole, at)| (k.clone(), t, Some((whole.clone(), *at)))),
    );
}

/// This rank's shards of the local slices of every parameter, the buffers whole, and the
/// optimizer state of the shards, from a checkpoint of any layout: each tensor read as just
/// the rows this rank keeps (a row-split one's shard rows full width, then cut to this rank's
/// columns). `shards` are the current shards in the trainer's order, laid out by `fsdp`; with
/// `staged` (a pipeline rank's stages) the parameters outside them and their state are neither
/// read nor handed to the optimizer.
pub(crate) fn restore(
    layout: &TpLayout,
    fsdp: &Fsdp,
    ckpt: &Loaded,
    model: &PluginModel,
    (shards, staged): (&Named, bool),
    optimizer: &mut PluginOptimizer,
) -> Result<(Named, Named), TrainError> {
    let (t, _) = layout.place();
    let rows: HashMap<&str, Range<usize>> = shards
        .iter()
        .zip(fsdp.param_rows())
        .map(|((n, _), (_, r))| (n.as_str(), r))
        .collect();
    // The global rows of parameter `name` (whole shape `whole`) this rank keeps.
    let global_rows = |name: &str, whole: &[usize]| -> Option<Range<usize>> {
        let r = rows.get(name)?.clone();
        match layout.rows_of(name, whole) {
            Some(slice) => Some(t * slice.len() + r.start..t * slice.len() + r.end),
            None => Some(r),
        }
    };
    let keep = |name: &str| !staged || rows.contains_key(name);
    let loaded =
        crate::harness::params_of_rows_from_checkpoint(ckpt, model, "model", &keep, &global_rows)?
            .into_iter()
            .map(|(n, p)| Ok((n.clone(), cut_cols(layout, &n, p)?)))
            .collect::<Result<Named, TrainError>>()?;
    let (named, buffers) = crate::harness::split_buffers(model, loaded);
    let wholes: HashMap<&str, &[usize]> = model
        .spec()
        .params
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    let mut state = BTreeMap::new();
    for name in ckpt.names() {
        let Some(key) = name.strip_prefix("optim/") else {
            continue;
        };
        let shape = ckpt.describe(name).map(|d| d.0).unwrap_or_default();
        let param = param_of_state(key).unwrap_or(key);
        if !keep(param) {
            continue;
        }
        let s = match wholes.get(param) {
            // Parameter-shaped state is laid out as its parameter.
            Some(&w) if w == shape => match global_rows(param, w) {
                Some(r) => cut_cols(layout, param, ckpt.rows(name, r)?)?,
                None => ckpt.tensor(name)?,
            },
            _ => ckpt.tensor(name)?,
        };
        state.insert(key.to_string(), s);
    }
    optimizer.load_state(&named, state).map_err(|m| {
        TrainError::Checkpoint(crate::checkpoint::CheckpointError::Mismatch(format!(
            "{}: {m}",
            ckpt.dir.display()
        )))
    })?;
    Ok((named, buffers))
}

/// The rows of a parameter split along a dim other than 0 (or of its state) cut to this
/// rank's part of that dim; `t` otherwise.
fn cut_cols(layout: &TpLayout, name: &str, t: Tensor) -> Result<Tensor, TrainError> {
    match layout.split_dim(name) {
        Some(dim) if dim != 0 && t.rank() > dim => layout.slice(name, &t),
        _ => Ok(t),
    }
}

/// Rows `rows` of `t`, a fresh copy (the piece must not keep the whole alive).
fn copy_rows(t: &Tensor, rows: Range<usize>) -> Result<Tensor, TrainError> {
    let view = t.narrow(0, rows.start, rows.len())?;
    let bytes = view.contiguous()?.to_bytes();
    Ok(Tensor::from_storage(
        Storage::from_bytes(view.dtype(), &bytes),
        view.shape(),
    )?)
}

/// The parameter an optimizer state key `<param>.<state>` belongs to.
fn param_of_state(key: &str) -> Option<&str> {
    key.rsplit_once('.').map(|(p, _)| p)
}
