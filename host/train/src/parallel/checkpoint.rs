//! Checkpoint pieces and restores, written once for every layout of the trainer.
//!
//! A rank's tensor is a part of the whole: tensor parallelism cuts a split parameter along its
//! dim, then FSDP keeps dim-0 rows of what is left (an expert parameter's rows start at its
//! expert slice under expert parallelism), and a pipeline rank holds its stages' tensors only.
//! A checkpoint piece is dim-0 rows of the whole, so any layout reads it back:
//! - a part whose rows are rows of the whole (no cut, or a cut along dim 0: column and vocab
//!   splits) is written as it is, by the ranks that hold it alone: the first rank of every axis
//!   over which it is replicated;
//! - a part cut along another dim (a row split, an expert stack split by width) is first
//!   gathered full width over `tp` ([`SaveRows::prepare`]); the gathered rows are then written
//!   by the first tensor-parallel rank, or, when FSDP shards them, spread over the `tp` ranks
//!   (a share of the shard's rows each), so no rank holds a whole row-split tensor to save it;
//! - buffers and optimizer state that is not parameter-shaped are held whole by every rank
//!   and written by the first.
//!
//! Reading back is the mirror: each rank reads just the dim-0 rows of each tensor it keeps
//! (then cuts a row-split one's columns), from whichever shards of whatever layout hold them.

use crate::checkpoint::{CheckpointError, Loaded, PieceRef};
use crate::parallel::fsdp::Fsdp;
use crate::parallel::tp::TpLayout;
use crate::TrainError;
use anneal_dist::Collective;
use anneal_engine::{Storage, Tensor};
use anneal_runtime::plugins::{PluginModel, PluginOptimizer};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

type Named = Vec<(String, Tensor)>;

/// How this rank's trained parameters are cut from the whole: the layouts that cut them.
#[derive(Clone, Copy, Default)]
pub(crate) struct Cut<'a> {
    /// Tensor parallelism's slices.
    pub tp: Option<&'a TpLayout>,
    /// FSDP's rows (of the slices, under tensor parallelism).
    pub fsdp: Option<&'a Fsdp>,
}

impl Cut<'_> {
    /// Per trained parameter of `named` (this rank's parts, in their order): the shape its
    /// rows are taken from (the slice under tensor parallelism) and this rank's rows of it.
    fn rows(&self, named: &[(String, Tensor)]) -> Vec<(Vec<usize>, Range<usize>)> {
        match self.fsdp {
            Some(f) => f.param_rows().map(|(s, r)| (s.to_vec(), r)).collect(),
            None => named
                .iter()
                .map(|(_, p)| {
                    (
                        p.shape().to_vec(),
                        0..p.shape().first().copied().unwrap_or(1),
                    )
                })
                .collect(),
        }
    }

    /// Each trained parameter's FSDP rows of the shape they are taken from, by name (none
    /// without FSDP).
    fn fsdp_rows<'n>(&self, named: &'n [(String, Tensor)]) -> HashMap<&'n str, Range<usize>> {
        match self.fsdp {
            Some(_) => named
                .iter()
                .zip(self.rows(named))
                .map(|((n, _), (_, r))| (n.as_str(), r))
                .collect(),
            None => HashMap::new(),
        }
    }

    /// Where optimizer state `key` of parameter `name`, of the local shape `local`, sits in
    /// the shape its parameter's rows come from: `(that shape, first row)` when it is
    /// parameter-shaped (laid out as its parameter), `None` when it is held whole.
    fn state_rows(
        &self,
        named: &[(String, Tensor)],
        key: &str,
        name: &str,
        local: &[usize],
    ) -> Option<(Vec<usize>, usize)> {
        match self.fsdp {
            Some(f) => f.state_piece(named, key, local),
            None => named
                .iter()
                .find(|(n, p)| n == name && p.shape() == local)
                .map(|(_, p)| (p.shape().to_vec(), 0)),
        }
    }

    /// Where a part of parameter `name` (rows from `start` of the local shape `local`) sits in
    /// the whole, when this rank writes it as a piece: `None` for a row-split part (gathered
    /// and written apart) and for a replicated one on any tensor-parallel rank but the first.
    fn place(&self, name: &str, local: &[usize], start: usize) -> Option<(Vec<usize>, usize)> {
        let Some(tp) = self.tp else {
            return Some((local.to_vec(), start));
        };
        let (t, ranks) = tp.place();
        match (tp.is_split(name), tp.is_row_split(name)) {
            (_, true) => None,
            (true, false) => {
                let mut whole = local.to_vec();
                whole[0] *= ranks;
                Some((whole, t * local[0] + start))
            }
            (false, false) => (t == 0).then(|| (local.to_vec(), start)),
        }
    }

    /// The dim-0 rows of the whole parameter `name` (of shape `whole`) this rank keeps, given
    /// its FSDP rows `fsdp` of its slice; `None` keeps it whole.
    fn global_rows(
        &self,
        name: &str,
        whole: &[usize],
        fsdp: Option<&Range<usize>>,
    ) -> Option<Range<usize>> {
        let slice = self.tp.and_then(|tp| tp.rows_of(name, whole));
        match (fsdp, slice) {
            (Some(r), Some(s)) => Some(s.start + r.start..s.start + r.end),
            (Some(r), None) => Some(r.clone()),
            (None, s) => s,
        }
    }

    /// A part read as full-width rows of parameter `name` (or of its state) cut to this
    /// rank's columns when the parameter is split along a dim other than 0.
    fn cut_cols(&self, name: &str, t: Tensor) -> Result<Tensor, TrainError> {
        match self.tp.and_then(|tp| Some((tp, tp.split_dim(name)?))) {
            Some((tp, dim)) if dim != 0 && t.rank() > dim => tp.slice(name, &t),
            _ => Ok(t),
        }
    }
}

/// A row-split tensor's rows this rank writes: `(key, rows, whole shape, first row)`.
type Gathered = (String, Tensor, Vec<usize>, usize);

/// The row-split tensors' rows this rank writes in the next checkpoint, gathered over `tp`
/// before the snapshot (a snapshot cannot talk).
#[derive(Default)]
pub(crate) struct SaveRows {
    gathered: RefCell<Vec<Gathered>>,
}

impl SaveRows {
    /// Gathers over `tp` (full width) this rank's rows of every parameter of `named` split
    /// along a dim other than 0, and of its parameter-shaped optimizer state, and keeps the
    /// rows this rank writes (see the module docs). Collective over `tp`: every rank of the
    /// save group calls it.
    pub fn prepare(
        &self,
        cut: Cut<'_>,
        tp: &dyn Collective,
        named: &Named,
        state: &BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        let Some(layout) = cut.tp else {
            return Ok(());
        };
        let (t, ranks) = layout.place();
        // Under FSDP the tp ranks share the writing; without it the first writes every row.
        let (share, writers) = match cut.fsdp {
            Some(_) => (t, ranks),
            None => (t, 1),
        };
        let mut out = Vec::new();
        for ((name, p), (local, rows)) in named.iter().zip(cut.rows(named)) {
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
                let full = crate::parallel::tp::gather_along(tp, local_rows, dim)?;
                let per = rows.len().div_ceil(writers);
                let (a, b) = (
                    (share * per).min(rows.len()),
                    ((share + 1) * per).min(rows.len()),
                );
                if a < b {
                    out.push((key, copy_rows(&full, a..b)?, whole.clone(), rows.start + a));
                }
            }
        }
        *self.gathered.borrow_mut() = out;
        Ok(())
    }

    /// The rows [`SaveRows::prepare`] gathered.
    pub fn gathered(&self) -> std::cell::Ref<'_, Vec<Gathered>> {
        self.gathered.borrow()
    }
}

/// This rank's checkpoint pieces into `out` (see the module docs): its parts of the trained
/// parameters `named` and of their optimizer state `state`, the `gathered` rows of the
/// row-split ones; `first` (the first rank of every axis the tensors held whole are
/// replicated over) also writes the `buffers` and any state held whole.
pub(crate) fn pieces<'a>(
    cut: Cut<'_>,
    first: bool,
    (named, buffers): (&'a Named, &'a Named),
    state: &'a BTreeMap<String, Tensor>,
    gathered: &'a [Gathered],
    out: &mut Vec<PieceRef<'a>>,
) {
    // A rank past a tensor's last rows holds none of it; the first writes a tensor of none.
    let writes =
        |rows: bool, whole: &[usize]| rows || (first && whole.first().is_none_or(|&r| r == 0));
    for ((n, p), (local, rows)) in named.iter().zip(cut.rows(named)) {
        if let (Some(piece), true) = (
            cut.place(n, &local, rows.start),
            writes(!rows.is_empty(), &local),
        ) {
            out.push((format!("model/{n}"), p, Some(piece)));
        }
    }
    for (key, s) in state {
        let name = param_of_state(key).unwrap_or(key);
        match cut.state_rows(named, key, name, s.shape()) {
            Some((local, start)) => {
                if let (Some(piece), true) = (
                    cut.place(name, &local, start),
                    writes(s.numel() > 0, &local),
                ) {
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

/// This rank's parts of the model's tensors under `prefix` (trained parameters and buffers)
/// that `keep` picks by name, from a checkpoint of any layout, each read as just the rows this
/// rank keeps; `named` are the current parts of the trained parameters, in their order (their
/// FSDP rows). Never more than one whole tensor is held.
pub(crate) fn read_params(
    cut: Cut<'_>,
    ckpt: &Loaded,
    model: &PluginModel,
    (prefix, keep): (&str, &dyn Fn(&str) -> bool),
    named: &[(String, Tensor)],
) -> Result<Named, TrainError> {
    let fsdp = cut.fsdp_rows(named);
    let rows = |name: &str, whole: &[usize]| cut.global_rows(name, whole, fsdp.get(name));
    crate::harness::params_of_rows_from_checkpoint(ckpt, model, prefix, keep, &rows)?
        .into_iter()
        .map(|(n, t)| Ok((n.clone(), cut.cut_cols(&n, t)?)))
        .collect()
}

/// The optimizer state of a checkpoint of any layout loaded into `optimizer` for `named`
/// (this rank's parts of the trained parameters, as [`read_params`] read them): a
/// parameter-shaped state read as its parameter is, any other whole. With `own_only` (a
/// pipeline rank's stages) the state of parameters outside `named` is neither read nor
/// handed to the optimizer.
pub(crate) fn read_optimizer(
    cut: Cut<'_>,
    ckpt: &Loaded,
    (named, own_only): (&[(String, Tensor)], bool),
    optimizer: &mut PluginOptimizer,
) -> Result<(), TrainError> {
    let fsdp = cut.fsdp_rows(named);
    let mut state = BTreeMap::new();
    for name in ckpt.names() {
        let Some(key) = name.strip_prefix("optim/") else {
            continue;
        };
        let param = param_of_state(key).unwrap_or(key);
        if own_only && !named.iter().any(|(n, _)| n == param) {
            continue;
        }
        let shape = ckpt.describe(name).map(|d| d.0).unwrap_or_default();
        let whole = ckpt.describe(&format!("model/{param}")).map(|d| d.0);
        let s = match whole {
            // Parameter-shaped state is laid out as its parameter.
            Some(w) if w == shape => match cut.global_rows(param, w, fsdp.get(param)) {
                Some(r) => cut.cut_cols(param, ckpt.rows(name, r)?)?,
                None => cut.cut_cols(param, ckpt.tensor(name)?)?,
            },
            _ => ckpt.tensor(name)?,
        };
        state.insert(key.to_string(), s);
    }
    optimizer.load_state(named, state).map_err(|m| {
        TrainError::Checkpoint(CheckpointError::Mismatch(format!(
            "{}: {m}",
            ckpt.dir.display()
        )))
    })
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

/// The parameter an optimizer state key `<param>.<state>` belongs to (state names carry no
/// dot, parameter names do).
pub(crate) fn param_of_state(key: &str) -> Option<&str> {
    key.rsplit_once('.').map(|(p, _)| p)
}
