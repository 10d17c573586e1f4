//! Tensor parallelism inside a forward (Megatron-LM's scheme): the ranks of a tensor-parallel
//! group each hold a slice of the projections, and four conjugate ops keep the replicated
//! activations consistent:
//!
//! ```text
//! tp_copy     before a column-split linear   forward: identity    backward: all-reduce
//! tp_reduce   after a row-split linear       forward: all-reduce  backward: identity
//! tp_gather   (sequence parallel) before     forward: all-gather  backward: reduce-scatter
//!             a column-split linear           along the sequence
//! tp_scatter  (sequence parallel) after a    forward: reduce-      backward: all-gather
//!             row-split linear                scatter along the sequence
//! ```
//! plus a vocabulary-parallel embedding (each rank looks up the ids it owns, the rows are
//! summed over the group) and a vocabulary-parallel cross-entropy over column-split logits that
//! never gathers them: row maxima and sums of exponentials are combined over the group and the
//! target's logit comes from the rank that owns it.
//!
//! The engine knows nothing of processes: the collectives are a [`TpGroup`] that whoever runs
//! the job installs (the trainer, through the model runner). Every rank of the group must run
//! the same ops in the same order, forward and backward, since each is a collective. Sums run in
//! rank order and leave the same bits on every rank, so the replicated activations stay
//! identical.

use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::{DType, Device, Tensor};
use std::sync::Arc;

/// The collectives of a tensor-parallel group, as the ops need them. Every rank of the group
/// calls them in the same order.
pub trait TpGroup: Send + Sync {
    /// Ranks in the group (the tensor-parallel degree).
    fn ranks(&self) -> usize;

    /// This rank's place in the group: it holds slice `rank` of every split parameter.
    fn rank(&self) -> usize;

    /// Sums `buf` over the group in rank order, leaving the same bits on every rank.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;

    /// Every rank's `local` (all the same length), concatenated in rank order.
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>>;

    /// Sums `send` (`ranks()` equal blocks) over the group and returns block `rank()` of it.
    fn reduce_scatter_sum(&self, send: &[f32]) -> Result<Vec<f32>>;

    /// `x` summed over the group in f32 (rank order), in `x`'s shape, dtype and device. The
    /// default stages it through host memory ([`staged_all_reduce`]); a group that moves
    /// device buffers (NCCL) overrides it with the same bits.
    fn all_reduce_sum_tensor(&self, x: &Tensor) -> Result<Tensor> {
        staged_all_reduce(self, x)
    }

    /// Every rank's `x` (all the same shape) joined along dim 0 in rank order, in `x`'s dtype
    /// on its device. The default stages it ([`staged_all_gather`]).
    fn all_gather_tensor(&self, x: &Tensor) -> Result<Tensor> {
        staged_all_gather(self, x)
    }

    /// `x` (dim 0 a multiple of `ranks()`) summed over the group in f32, keeping block
    /// `rank()` of dim 0, in `x`'s dtype on its device. The default stages it
    /// ([`staged_reduce_scatter`]).
    fn reduce_scatter_sum_tensor(&self, x: &Tensor) -> Result<Tensor> {
        staged_reduce_scatter(self, x)
    }
}

/// [`TpGroup::all_reduce_sum_tensor`] through host memory: `x` copied out as f32, summed by
/// [`TpGroup::all_reduce_sum`], rebuilt where and as it was.
pub fn staged_all_reduce<G: TpGroup + ?Sized>(g: &G, x: &Tensor) -> Result<Tensor> {
    let mut v = crate::staged::to_host(x);
    g.all_reduce_sum(&mut v)?;
    tensor_of(v, x.shape(), x.dtype(), x.device())
}

/// [`TpGroup::all_gather_tensor`] through host memory.
pub fn staged_all_gather<G: TpGroup + ?Sized>(g: &G, x: &Tensor) -> Result<Tensor> {
    let got = g.all_gather(&crate::staged::to_host(x))?;
    let mut shape = x.shape().to_vec();
    if let Some(d0) = shape.first_mut() {
        *d0 *= g.ranks();
    }
    tensor_of(got, &shape, x.dtype(), x.device())
}

/// [`TpGroup::reduce_scatter_sum_tensor`] through host memory.
pub fn staged_reduce_scatter<G: TpGroup + ?Sized>(g: &G, x: &Tensor) -> Result<Tensor> {
    let mine = g.reduce_scatter_sum(&crate::staged::to_host(x))?;
    let mut shape = x.shape().to_vec();
    if let Some(d0) = shape.first_mut() {
        *d0 /= g.ranks().max(1);
    }
    tensor_of(mine, &shape, x.dtype(), x.device())
}

/// The tensor-parallel context of a forward: the group, shared by the ops that use it.
#[derive(Clone)]
pub struct TensorParallelGroup {
    /// The group's collectives.
    pub group: Arc<dyn TpGroup>,
}

impl std::fmt::Debug for TensorParallelGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TensorParallelGroup(rank {} of {})",
            self.group.rank(),
            self.group.ranks()
        )
    }
}

/// `values` as a tensor of `shape` in `dtype` on `device` (collectives move f32 through host
/// memory: [`crate::staged`]).
fn tensor_of(values: Vec<f32>, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    let t = Tensor::from_vec(values, shape)?;
    let t = if dtype == DType::F32 {
        t
    } else {
        t.to_dtype(dtype)?
    };
    crate::staged::place(t, device)
}

fn all_reduced(g: &dyn TpGroup, x: &Tensor) -> Result<Tensor> {
    g.all_reduce_sum_tensor(x)
}

/// `x` unchanged; its gradient is summed over the group (the input of a column-split linear:
/// every rank's slice of the output contributes to the input's gradient).
pub fn tp_copy(x: &Tensor, tp: &TensorParallelGroup) -> Tensor {
    let g = tp.group.clone();
    record("tp_copy", x.detach(), &[x], move || {
        move |grad: &Tensor| Ok(vec![Some(all_reduced(g.as_ref(), grad)?)])
    })
}

/// `x` summed over the group (the partial products of a row-split linear); the gradient passes
/// unchanged (every rank's partial sum contributes one-to-one).
pub fn tp_reduce(x: &Tensor, tp: &TensorParallelGroup) -> Result<Tensor> {
    let out = all_reduced(tp.group.as_ref(), x)?;
    Ok(record("tp_reduce", out, &[x], || {
        |grad: &Tensor| Ok(vec![Some(grad.clone())])
    }))
}

/// `x` with `dim` moved to the front, contiguous (`[shape[dim], rest]`), and back: how the
/// sequence-parallel ops cut and join along any dim (the group's tensor collectives work on
/// dim 0). A copy on `x`'s device; no values change.
fn front(x: &Tensor, dim: usize) -> Result<Tensor> {
    if dim == 0 {
        return x.contiguous();
    }
    let mut perm: Vec<usize> = (0..x.rank()).collect();
    perm.remove(dim);
    perm.insert(0, dim);
    x.permute(&perm)?.contiguous()
}

fn unfront(t: Tensor, dim: usize) -> Result<Tensor> {
    if dim == 0 {
        return Ok(t);
    }
    // Inverse of moving `dim` to the front.
    let mut perm: Vec<usize> = (1..t.rank()).collect();
    perm.insert(dim, 0);
    t.permute(&perm)?.contiguous()
}

pub(super) fn gather_along(g: &dyn TpGroup, x: &Tensor, dim: usize) -> Result<Tensor> {
    unfront(g.all_gather_tensor(&front(x, dim)?)?, dim)
}

fn scatter_along(g: &dyn TpGroup, x: &Tensor, dim: usize, op: &'static str) -> Result<Tensor> {
    let n = g.ranks();
    if !x.shape()[dim].is_multiple_of(n) {
        return Err(invalid(
            op,
            format!(
                "dim {dim} of {:?} does not split over {n} tensor-parallel ranks",
                x.shape()
            ),
        ));
    }
    unfront(g.reduce_scatter_sum_tensor(&front(x, dim)?)?, dim)
}

/// Sequence parallelism: every rank's `x` (its shard of the sequence along `dim`) joined in
/// rank order; the gradient is summed over the group and cut back to this rank's shard.
pub fn tp_gather(x: &Tensor, dim: usize, tp: &TensorParallelGroup) -> Result<Tensor> {
    const OP: &str = "tp_gather";
    if dim >= x.rank() {
        return Err(invalid(OP, format!("dim {dim} of {:?}", x.shape())));
    }
    let out = gather_along(tp.group.as_ref(), x, dim)?;
    let g = tp.group.clone();
    Ok(record(OP, out, &[x], move || {
        move |grad: &Tensor| Ok(vec![Some(scatter_along(g.as_ref(), grad, dim, OP)?)])
    }))
}

/// Sequence parallelism: `x` (partial sums of a row-split linear over the whole sequence)
/// summed over the group, this rank keeping its shard of `dim`; the gradient is gathered.
pub fn tp_scatter(x: &Tensor, dim: usize, tp: &TensorParallelGroup) -> Result<Tensor> {
    const OP: &str = "tp_scatter";
    if dim >= x.rank() {
        return Err(invalid(OP, format!("dim {dim} of {:?}", x.shape())));
    }
    let out = scatter_along(tp.group.as_ref(), x, dim, OP)?;
    let g = tp.group.clone();
    Ok(record(OP, out, &[x], move || {
        move |grad: &Tensor| Ok(vec![Some(gather_along(g.as_ref(), grad, dim)?)])
    }))
}

/// Every rank's `x` (its shard along `dim`) joined in rank order, for a computation that every
/// rank then repeats on the whole, with the same bits (a mixture-of-experts router's logits
/// under sequence parallelism). The gradient is then the same on every rank, so the backward
/// cuts this rank's shard of it and sums nothing (unlike [`tp_gather`], whose gradient is a
/// partial sum per rank).
pub fn tp_gather_replicated(x: &Tensor, dim: usize, tp: &TensorParallelGroup) -> Result<Tensor> {
    const OP: &str = "tp_gather_replicated";
    if dim >= x.rank() {
        return Err(invalid(OP, format!("dim {dim} of {:?}", x.shape())));
    }
    let out = gather_along(tp.group.as_ref(), x, dim)?;
    let (len, start) = (x.shape()[dim], x.shape()[dim] * tp.group.rank());
    Ok(record(OP, out, &[x], move || {
        move |grad: &Tensor| {
            Ok(vec![Some(
                grad.narrow(dim as isize, start, len)?.contiguous()?,
            )])
        }
    }))
}

fn ids_of(ids: &Tensor, op: &'static str) -> Result<Vec<i64>> {
    match ids.dtype() {
        DType::I64 => Ok(ids.to_vec::<i64>()),
        DType::I32 => Ok(ids.to_vec::<i32>().into_iter().map(i64::from).collect()),
        got => Err(Error::DType {
            op,
            got,
            expected: "i64 or i32 ids",
        }),
    }
}

/// This rank's part of a vocabulary-split embedding lookup: its `w_local [V / ranks, D]` holds
/// ids `[rank·V/ranks, (rank+1)·V/ranks)`; it looks up the ids it owns and gives zeros for the
/// others. Summed over the group ([`tp_reduce`], or [`tp_scatter`] under sequence parallelism)
/// the parts are the full lookup, exactly (one rank contributes each row). The gradient reaches
/// only the owned rows.
pub fn tp_embedding(w_local: &Tensor, ids: &Tensor, tp: &TensorParallelGroup) -> Result<Tensor> {
    const OP: &str = "tp_embedding";
    let rows = w_local.shape().first().copied().unwrap_or(0);
    let start = (tp.group.rank() * rows) as i64;
    let all = ids_of(ids, OP)?;
    let mut local = Vec::with_capacity(all.len());
    let mut mask = Vec::with_capacity(all.len());
    for &id in &all {
        let owned = id >= start && id < start + rows as i64;
        local.push(if owned { id - start } else { 0 });
        mask.push(if owned { 1.0f32 } else { 0.0 });
    }
    let mut mask_shape = ids.shape().to_vec();
    mask_shape.push(1);
    let local = crate::staged::place(Tensor::from_vec(local, ids.shape())?, w_local.device())?;
    let mask = tensor_of(mask, &mask_shape, w_local.dtype(), w_local.device())?;
    w_local.embedding(&local)?.mul(&mask)
}

/// Mean cross-entropy of vocabulary-split logits: this rank's `logits [N, V / ranks]` are
/// columns `[rank·V/ranks, ..)` of the full logits; `targets [N]` (i64 or i32, `ignore_index`
/// rows skipped) index the full vocabulary. Row maxima are combined over the group (gathered,
/// the largest taken), then the sums of `exp(x − max)` and the target logits (from their
/// owners; the others add zero) are summed, so only `3·N` values per rank travel, never the
/// logits. The backward needs no collective: `(softmax − one-hot) / n_valid` on the local
/// columns, with the softmax's denominator from the forward.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: Option<i64>,
    tp: &TensorParallelGroup,
) -> Result<Tensor> {
    const OP: &str = "vocab_parallel_cross_entropy";
    if logits.rank() != 2 || targets.shape() != [logits.shape()[0]] {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: logits.shape().to_vec(),
            rhs: targets.shape().to_vec(),
        });
    }
    let (n, v) = (logits.shape()[0], logits.shape()[1]);
    let g = tp.group.as_ref();
    let start = (g.rank() * v) as i64;
    let tg = ids_of(targets, OP)?;
    let x = logits.to_vec_f32();
    // Row maxima over the whole vocabulary.
    let local_max: Vec<f32> = (0..n)
        .map(|i| {
            x[i * v..(i + 1) * v]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect();
    let maxes = g.all_gather(&local_max)?;
    let max: Vec<f32> = (0..n)
        .map(|i| {
            (0..g.ranks())
                .map(|r| maxes[r * n + i])
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect();
    // Per row: Σ exp(x − max) over this rank's columns, then the target's logit if owned.
    let mut sums = vec![0f32; 2 * n];
    for i in 0..n {
        let row = &x[i * v..(i + 1) * v];
        sums[i] = row.iter().map(|&z| (z - max[i]).exp()).sum();
        let t = tg[i];
        if t >= start && t < start + v as i64 {
            sums[n + i] = row[(t - start) as usize];
        }
    }
    g.all_reduce_sum(&mut sums)?;
    let valid: Vec<bool> = tg.iter().map(|&t| Some(t) != ignore_index).collect();
    let n_valid = valid.iter().filter(|&&b| b).count();
    // Sequential f64 sum, as `cross_entropy` does: a fixed order.
    let total: f64 = (0..n)
        .filter(|&i| valid[i])
        .map(|i| f64::from(sums[i].ln() + max[i] - sums[n + i]))
        .sum();
    let device = logits.device();
    let out = crate::staged::place(
        Tensor::scalar((total / n_valid.max(1) as f64) as f32),
        device,
    )?;
    let dtype = logits.dtype();
    Ok(record(OP, out, &[logits], move || {
        move |grad: &Tensor| {
            let scale = grad.to_vec_f32()[0] / n_valid.max(1) as f32;
            let mut dx = vec![0f32; n * v];
            for i in (0..n).filter(|&i| valid[i]) {
                let (row, out) = (&x[i * v..(i + 1) * v], &mut dx[i * v..(i + 1) * v]);
                for (o, &z) in out.iter_mut().zip(row) {
                    *o = (z - max[i]).exp() / sums[i] * scale;
                }
                let t = tg[i];
                if t >= start && t < start + v as i64 {
                    out[(t - start) as usize] -= scale;
                }
            }
            Ok(vec![Some(tensor_of(dx, &[n, v], dtype, device)?)])
        }
    }))
}
