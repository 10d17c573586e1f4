//! Sharded data parallelism (FSDP, ZeRO-3 layout): between steps every rank holds only its
//! dim-0 rows of each parameter, of its gradient and of its optimizer state
//! ([`anneal_dist::Dim0Shard`]), so those bytes fall as 1/N. A training step gathers the
//! parameters block by block ([`units`]: each block's right before its forward and again for
//! its backward, freed in between, its gradients reduce-scattered as its backward ends); then,
//! in HSDP, the gradient rows are summed over the replicas, and the optimizer steps on the
//! shards. Evaluation runs block by block too. Checkpoints are sharded: every rank saves its own
//! rows ([`Fsdp::param_rows`], [`Fsdp::state_piece`]) and reads back just its rows of any
//! checkpoint, whatever layout wrote it ([`Fsdp::state_rows`]).
//!
//! With expert parallelism (`ep > 1`, [`Experts`]) an expert parameter (one that declares
//! `expert_dim = 0`) is first cut into `ep` slices of whole experts, rank `s` of `dp_shard`
//! keeping slice `s % ep` (never gathered: its experts run here), and that slice is then
//! sharded like any parameter over the `efsdp = dp_shard / ep` ranks that hold the same
//! experts. Its pieces in checkpoints are global rows, so any layout reads them back.

mod gather_codec;
mod policy;
mod units;

pub(crate) use gather_codec::GatherCodec;
pub use policy::{ExpertsActive, FsdpPolicy};
pub(crate) use units::{set_shard_grads_device, Active, Hook, Units};

use crate::checkpoint::PieceRef;
use crate::parallel::staged;
use crate::TrainError;
use anneal_dist::{Collective, Dim0Shard};
use anneal_engine::{Device, Tensor};
use std::collections::{BTreeMap, HashSet};
use std::ops::Range;

/// The expert-parallel layout of the expert parameters (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct Experts {
    /// The expert parameters (those declaring `expert_dim = 0`).
    pub names: HashSet<String>,
    /// This rank's expert slice and the slices (`ep`).
    pub slice: (usize, usize),
    /// This rank's place among the ranks holding the same slice, and their number (`efsdp`).
    pub efsdp: (usize, usize),
}

impl Experts {
    /// For parameter `name` of `shape`: the rows of its expert slice on this rank
    /// (`offset`, local shape) and its shard over the efsdp ranks; `None` for a dense one.
    fn layout(&self, name: &str, shape: &[usize]) -> Option<(usize, Vec<usize>, Dim0Shard)> {
        if !self.names.contains(name) {
            return None;
        }
        let (i, ep) = self.slice;
        let per = shape.first().copied().unwrap_or(0) / ep.max(1);
        let mut local = shape.to_vec();
        if let Some(d0) = local.first_mut() {
            *d0 = per;
        }
        let shard = Dim0Shard::new(&local, self.efsdp.0, self.efsdp.1);
        Some((i * per, local, shard))
    }
}

/// Tensors by name.
type Named = Vec<(String, Tensor)>;

/// How each trained parameter (in the trainer's name order) is sharded over `dp_shard`.
pub(crate) struct Fsdp {
    /// Per parameter: the shape it is sharded as (the whole; an expert parameter's slice of
    /// experts on this rank) and this rank's rows of that.
    layout: Vec<(Vec<usize>, Dim0Shard)>,
    /// Per parameter: its whole shape and the first row of its sharded part in it (0 but for
    /// expert parameters under expert parallelism).
    whole: Vec<(Vec<usize>, usize)>,
    /// Per parameter: whether it is an expert parameter sharded over the efsdp ranks (under
    /// expert parallelism) rather than over `dp_shard`.
    expert: Vec<bool>,
}

impl Fsdp {
    /// The layout of `named` (full parameters) for rank `rank` of `ranks` shards, expert
    /// parameters laid out by `experts` when there is expert parallelism.
    pub fn new(
        named: &[(String, Tensor)],
        rank: usize,
        ranks: usize,
        experts: Option<&Experts>,
    ) -> Fsdp {
        let (mut layout, mut whole, mut expert) = (Vec::new(), Vec::new(), Vec::new());
        for (n, p) in named {
            let shape = p.shape().to_vec();
            let e = experts.and_then(|e| e.layout(n, &shape));
            expert.push(e.is_some());
            match e {
                Some((offset, local, shard)) => {
                    layout.push((local, shard));
                    whole.push((shape, offset));
                }
                None => {
                    layout.push((shape.clone(), Dim0Shard::new(&shape, rank, ranks)));
                    whole.push((shape, 0));
                }
            }
        }
        Fsdp {
            layout,
            whole,
            expert,
        }
    }

    /// Per trained parameter (in the trainer's name order): whether it is an expert parameter
    /// whose shard lies over the efsdp ranks (its [`Fsdp::layouts`] shape is then this rank's
    /// slice of the experts).
    pub fn experts(&self) -> &[bool] {
        &self.expert
    }

    /// Each trained parameter's full shape and this rank's rows, in the trainer's name order.
    pub fn layouts(&self) -> &[(Vec<usize>, Dim0Shard)] {
        &self.layout
    }

    /// This rank's rows of each full parameter, as trainable leaves.
    pub fn shard(&self, full: &[(String, Tensor)]) -> Result<Named, TrainError> {
        full.iter()
            .zip(self.layout.iter().zip(&self.whole))
            .map(|((n, p), ((shape, s), (_, offset)))| {
                let from = offset * s.row_len;
                let t = match p.device() {
                    // On a GPU the rows are cut there (the same values, no host round trip).
                    Device::Cuda(_) if !s.is_empty() => {
                        let flat = p.detach().contiguous()?.reshape(&[p.numel()])?;
                        let rows = flat.narrow(0, from + s.start * s.row_len, s.len())?;
                        let t = Tensor::zeros_on(&s.shape(shape), p.dtype(), p.device())?;
                        t.copy_from(&rows.reshape(&s.shape(shape))?)?;
                        t
                    }
                    _ => {
                        let values = p.to_vec_f32();
                        let rows = s.slice(&values[from..]).to_vec();
                        staged::rebuild(rows, &s.shape(shape), p.dtype(), p.device())?
                    }
                };
                Ok((n.clone(), t.requires_grad_()))
            })
            .collect()
    }

    /// Sets each shard's gradient from the step's gradient rows ([`Units::take_grads`]), first
    /// summed over the replicas when `replicate` is given (HSDP). A parameter that no
    /// data-parallel rank got a gradient for (`got` false on every rank of `dp`) keeps none, as
    /// in one process.
    pub fn set_shard_grads(
        dp: &dyn Collective,
        replicate: Option<&dyn Collective>,
        shards: &[(String, Tensor)],
        rows: Vec<Vec<f32>>,
        got: &[bool],
    ) -> Result<(), TrainError> {
        let mut flags: Vec<f32> = got.iter().map(|&g| if g { 1.0 } else { 0.0 }).collect();
        if dp.size() > 1 {
            dp.all_reduce_sum(&mut flags)?;
        }
        let rows = match replicate {
            Some(rep) => {
                // One buffer for every parameter: one collective instead of one per parameter.
                let mut flat = rows.concat();
                crate::parallel::dist::sum_identically(rep, &mut flat)?;
                let mut at = 0;
                rows.iter()
                    .map(|r| {
                        at += r.len();
                        flat[at - r.len()..at].to_vec()
                    })
                    .collect()
            }
            None => rows,
        };
        for (((_, shard), rows), flag) in shards.iter().zip(rows).zip(flags) {
            if flag > 0.0 {
                let g = staged::rebuild_like(rows, shard)?;
                shard.set_grad(Some(g))?;
            }
        }
        Ok(())
    }

    /// This rank's rows of each trained parameter (in layout order) and its full shape: where
    /// its shard sits in the whole, for checkpoint pieces and for reading a checkpoint back.
    pub fn param_rows(&self) -> impl Iterator<Item = (&[usize], Range<usize>)> {
        self.layout
            .iter()
            .zip(&self.whole)
            .map(|((_, s), (shape, at))| (shape.as_slice(), at + s.start..at + s.end))
    }

    /// For the optimizer state `key` (`<param>.<state>`) of the whole shape `shape`: this rank's
    /// rows of it when it is sharded like its parameter (the same whole shape), `None` when it
    /// is not (a replicated state, such as a scalar, is kept whole). `names` are the trained
    /// parameters in layout order.
    pub fn state_rows(
        &self,
        names: &[(String, Tensor)],
        key: &str,
        shape: &[usize],
    ) -> Option<Range<usize>> {
        self.layout_of(names, key)
            .ok()
            .filter(|(_, (whole, _))| *whole == shape)
            .map(|((_, s), (_, at))| at + s.start..at + s.end)
    }

    /// Where this rank's optimizer state `key`, of its local shape `local`, sits in the whole:
    /// `(whole shape, first row)` when it is a shard of a parameter-shaped state, `None` when
    /// it is held whole.
    pub fn state_piece(
        &self,
        names: &[(String, Tensor)],
        key: &str,
        local: &[usize],
    ) -> Option<(Vec<usize>, usize)> {
        self.layout_of(names, key)
            .ok()
            .filter(|((part, s), _)| s.shape(part) == local)
            .map(|((_, s), (whole, at))| (whole.to_vec(), at + s.start))
    }

    /// The layout of the parameter a state key `<param>.<state>` belongs to (the longest
    /// parameter name that prefixes it, since names hold dots): the shape it is sharded as
    /// with this rank's rows of it, and its whole shape with the first row of that part.
    #[allow(clippy::type_complexity)]
    fn layout_of<'a>(
        &'a self,
        names: &[(String, Tensor)],
        key: &str,
    ) -> Result<((&'a [usize], &'a Dim0Shard), (&'a [usize], usize)), TrainError> {
        names
            .iter()
            .zip(self.layout.iter().zip(&self.whole))
            .filter(|((n, _), _)| {
                key.len() > n.len()
                    && key.starts_with(n.as_str())
                    && key.as_bytes()[n.len()] == b'.'
            })
            .max_by_key(|((n, _), _)| n.len())
            .map(|(_, ((shape, s), (whole, at)))| ((shape.as_slice(), s), (whole.as_slice(), *at)))
            .ok_or_else(|| {
                TrainError::Config(format!("optimizer state {key} belongs to no parameter"))
            })
    }

    /// This rank's checkpoint pieces of `shards` (its rows of the trained parameters, in
    /// layout order) as `<prefix>/<name>`; on the `first` rank of the shard group also the
    /// tensors held `whole` (buffers), which every rank holds alike.
    pub fn shard_pieces<'a>(
        &self,
        first: bool,
        prefix: &str,
        shards: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
        whole: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
        out: &mut Vec<PieceRef<'a>>,
    ) {
        for ((n, p), (shape, rows)) in shards.into_iter().zip(self.param_rows()) {
            // A rank past the last rows holds none; the others' pieces cover the tensor.
            if !rows.is_empty() || (first && shape.first().is_none_or(|&r| r == 0)) {
                out.push((
                    format!("{prefix}/{n}"),
                    p,
                    Some((shape.to_vec(), rows.start)),
                ));
            }
        }
        if first {
            out.extend(
                whole
                    .into_iter()
                    .map(|(n, p)| (format!("{prefix}/{n}"), p, None)),
            );
        }
    }

    /// This rank's checkpoint pieces of the optimizer state (`optim/<param>.<state>`): its
    /// rows of the parameter-shaped states; on the `first` rank the states held whole.
    /// `names` are the trained parameters in layout order.
    pub fn state_pieces<'a>(
        &self,
        first: bool,
        names: &[(String, Tensor)],
        state: &'a BTreeMap<String, Tensor>,
        out: &mut Vec<PieceRef<'a>>,
    ) {
        for (key, t) in state {
            match self.state_piece(names, key, t.shape()) {
                Some((shape, start)) if t.numel() > 0 || (first && shape.first() == Some(&0)) => {
                    out.push((format!("optim/{key}"), t, Some((shape, start))))
                }
                Some(_) => {}
                None if first => out.push((format!("optim/{key}"), t, None)),
                None => {}
            }
        }
    }

    /// Bytes of parameters, gradients and optimizer state this rank holds between steps.
    pub fn resident_bytes(shards: &[(String, Tensor)], state: &BTreeMap<String, Tensor>) -> u64 {
        let params: usize = shards
            .iter()
            .map(|(_, p)| p.numel() * p.dtype().size_in_bytes())
            .sum();
        let grads: usize = shards
            .iter()
            .filter_map(|(_, p)| p.grad())
            .map(|g| g.numel() * g.dtype().size_in_bytes())
            .sum();
        let opt: usize = state
            .values()
            .map(|t| t.numel() * t.dtype().size_in_bytes())
            .sum();
        (params + grads + opt) as u64
    }
}
