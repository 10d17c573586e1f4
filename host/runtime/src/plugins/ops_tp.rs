//! Tensor (and sequence) parallelism at the host-op boundary: when a forward runs with a
//! [`TensorParallelism`] installed, the parameters the plugin reads are this rank's slices of
//! the split ones (by their declared [`TpSplit`] placement), and the `linear` and `embedding`
//! host ops wrap the engine's tensor-parallel ops around the local products:
//!
//! ```text
//! column (and vocab, as a linear)  x → tp_copy (SP: tp_gather on the sequence) → x·w_localᵀ
//! row                              x·w_localᵀ → tp_reduce (SP: tp_scatter on the sequence)
//! vocab (as an embedding)          masked local lookup → tp_reduce (SP: tp_scatter)
//! ```
//! A plugin sees local shapes only (a column-split query projection yields its share of the
//! heads) and contains no parallelism code. `moe_ffn` runs its experts' slices the same way
//! ([`TpSession::moe`], the engine's `moe_ffn_tp`): the gathered or copied input, one sum of
//! the layer's output over the group.
//!
//! Several linears reading the same input (q, k, v; gate and up) share one `tp_copy` /
//! `tp_gather` of it, so the input's gradient is reduced once (and, under SP, gathered once).

use anneal_engine::ops::{
    tp_copy, tp_embedding, tp_gather, tp_reduce, tp_scatter, MoeTensorParallel,
};
pub use anneal_engine::ops::{TensorParallelGroup, TpGroup};
use anneal_engine::Tensor;
use anneal_plugin_api::spec::TensorParallel as TpSplit;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What a forward needs to run tensor-parallel: the group, which parameters are split how, and
/// whether activations between the projections are sharded along the sequence.
#[derive(Clone, Debug)]
pub struct TensorParallelism {
    /// The tensor-parallel group.
    pub group: TensorParallelGroup,
    /// The split parameters by name (the others are whole on every rank).
    pub splits: Arc<HashMap<String, TpSplit>>,
    /// Sequence parallelism: the hidden states between blocks (and the norms on them) hold
    /// this rank's `1 / tp` of the sequence (dim 1 of `[batch, seq, dim]`).
    pub sequence: bool,
}

/// The dim of `[batch, seq, ..]` activations that sequence parallelism splits.
const SEQ_DIM: usize = 1;

/// A session's tensor-parallel state: which fetched tensors are split weights, and the last
/// prepared input of a column-split linear (shared by the linears that read it).
pub(crate) struct TpSession {
    tp: TensorParallelism,
    weights: Mutex<HashMap<u64, TpSplit>>,
    prepared: Mutex<Option<(Tensor, Tensor)>>,
}

type R<T> = Result<T, String>;

fn e(err: anneal_engine::Error) -> String {
    err.to_string()
}

impl TpSession {
    pub(crate) fn new(tp: TensorParallelism) -> Self {
        TpSession {
            tp,
            weights: Mutex::new(HashMap::new()),
            prepared: Mutex::new(None),
        }
    }

    /// Remembers that the tensor the plugin fetched as `name` is split, if it is.
    pub(crate) fn note_param(&self, name: &str, t: &Tensor) {
        if let Some(&split) = self.tp.splits.get(name) {
            self.weights
                .lock()
                .expect("tp weights lock poisoned")
                .insert(t.id(), split);
        }
    }

    fn split_of(&self, w: &Tensor) -> Option<TpSplit> {
        self.weights
            .lock()
            .expect("tp weights lock poisoned")
            .get(&w.id())
            .copied()
    }

    /// `x` made whole for a column-split linear: `tp_copy` (or, under SP, the sequence
    /// gathered), once per distinct input.
    fn column_input(&self, x: &Tensor) -> R<Tensor> {
        let mut prepared = self.prepared.lock().expect("tp input lock poisoned");
        if let Some((src, out)) = prepared.as_ref() {
            if src.id() == x.id() {
                return Ok(out.clone());
            }
        }
        let out = if self.tp.sequence {
            tp_gather(x, SEQ_DIM, &self.tp.group).map_err(e)?
        } else {
            tp_copy(x, &self.tp.group)
        };
        *prepared = Some((x.clone(), out.clone()));
        Ok(out)
    }

    /// Partial sums (a row-split linear's, a vocab-split lookup's) combined over the group:
    /// summed, or under SP summed and cut to this rank's share of the sequence.
    fn combine(&self, partial: &Tensor) -> R<Tensor> {
        if self.tp.sequence {
            tp_scatter(partial, SEQ_DIM, &self.tp.group).map_err(e)
        } else {
            tp_reduce(partial, &self.tp.group).map_err(e)
        }
    }

    /// `x · wᵀ` for a split `w`; `None` when `w` is not split (the plain product applies).
    pub(crate) fn linear(&self, x: &Tensor, w: &Tensor) -> R<Option<Tensor>> {
        let product = |x: &Tensor| w.transpose(0, 1).and_then(|wt| x.matmul(&wt)).map_err(e);
        match self.split_of(w) {
            None => Ok(None),
            Some(TpSplit::Column | TpSplit::Vocab) => product(&self.column_input(x)?).map(Some),
            Some(TpSplit::Row) => self.combine(&product(x)?).map(Some),
        }
    }

    /// How `moe_ffn` runs over the group, given its router and expert weights (and shared
    /// experts'): the gate and up column-split, the down row-split, the router whole. `None`
    /// when no weight of the layer is split (it then runs whole on every rank).
    pub(crate) fn moe(
        &self,
        router: &Tensor,
        experts: [&Tensor; 3],
        shared: Option<[&Tensor; 3]>,
    ) -> R<Option<MoeTensorParallel>> {
        let want = [TpSplit::Column, TpSplit::Column, TpSplit::Row];
        let got = |ws: [&Tensor; 3]| ws.map(|w| self.split_of(w));
        let layer = got(experts);
        if layer == [None; 3] && self.split_of(router).is_none() && shared.is_none() {
            return Ok(None);
        }
        let fits = |g: [Option<TpSplit>; 3]| g.iter().zip(&want).all(|(g, w)| *g == Some(*w));
        if !fits(layer) || !shared.map(got).is_none_or(fits) || self.split_of(router).is_some() {
            return Err(format!(
                "moe_ffn under tensor parallelism: the experts' (and shared experts') gate and up must be column-split and down row-split, the router whole; got gate/up/down {layer:?}, router {:?}",
                self.split_of(router)
            ));
        }
        Ok(Some(MoeTensorParallel {
            group: self.tp.group.clone(),
            sequence_dim: self.tp.sequence.then_some(SEQ_DIM),
        }))
    }

    /// The rows of a vocab-split table `w` at `ids`; `None` when `w` is not split.
    pub(crate) fn embedding(&self, w: &Tensor, ids: &Tensor) -> R<Option<Tensor>> {
        match self.split_of(w) {
            Some(TpSplit::Vocab) | Some(TpSplit::Column) => {
                let partial = tp_embedding(w, ids, &self.tp.group).map_err(e)?;
                self.combine(&partial).map(Some)
            }
            Some(TpSplit::Row) => Err(
                "embedding: a table split by its columns (row placement) has no tensor-parallel lookup; declare it vocab".into(),
            ),
            None => Ok(None),
        }
    }
}
