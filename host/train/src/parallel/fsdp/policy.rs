//! FSDP for a policy trained outside the pretraining step (`anneal rl`): between steps each
//! rank of `dp_shard` holds its dim-0 rows of the parameters, of their gradients and of the
//! optimizer state ([`Fsdp`]); a step gathers the whole policy once, the rollouts decode with
//! it and the trainer's forward and backward run on it, then each gradient is reduce-scattered
//! to its rows (summed over the replicas under HSDP) and the whole tensors go.
//!
//! Once per step rather than per block: a rollout decodes token by token, each token running
//! every block, so per-block gathers would move the policy once per generated token; and the
//! rollout's policy must be the trainer's very bits (the gather is exact f32), which one
//! gathered copy gives by construction. Under expert parallelism the experts stay split over
//! the expert group for the trainer ([`experts`]).

mod experts;

pub use experts::ExpertsActive;

use super::Fsdp;
use crate::checkpoint::PieceRef;
use crate::{Dist, TrainError};
use anneal_dist::Collective;
use anneal_engine::Tensor;
use anneal_runtime::plugins::Params;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

mod state;

type Named = Vec<(String, Tensor)>;

/// A policy sharded over the `dp_shard` ranks (see the module docs).
pub struct FsdpPolicy {
    fsdp: Fsdp,
    /// This rank's place in the shard group and the group's size.
    place: (usize, usize),
    /// Under expert parallelism, the experts' layout and group.
    experts: Option<experts::PolicyExperts>,
}

impl FsdpPolicy {
    /// The layout of the whole trainable parameters `named` (sorted by name) over the
    /// `dp_shard` group of `dist`, when parameters are sharded.
    pub fn of_dist(dist: &Dist, named: &[(String, Tensor)]) -> Option<FsdpPolicy> {
        let comm = dist.shard()?;
        Some(FsdpPolicy {
            fsdp: Fsdp::new(named, comm.rank(), comm.size(), None),
            place: (comm.rank(), comm.size()),
            experts: None,
        })
    }

    /// One line for the console.
    pub fn summary(&self, shards: &[(String, Tensor)]) -> String {
        let mine: usize = shards.iter().map(|(_, p)| p.numel()).sum();
        let whole: usize = self
            .fsdp
            .param_rows()
            .map(|(shape, _)| shape.iter().product::<usize>())
            .sum();
        format!(
            "fsdp: the policy sharded over {} rank(s), this rank holds {mine} of its {whole} parameters (and their gradients and optimizer state) between steps; gathered whole once per step for the rollouts and the trainer",
            self.place.1
        )
    }

    /// This rank's rows of each whole trainable parameter (in layout order), as leaves.
    pub fn shard(&self, whole: &[(String, Tensor)]) -> Result<Named, TrainError> {
        self.fsdp.shard(whole)
    }

    /// This rank's rows of the trained parameters in `map` (the names of `names`, in layout
    /// order), not trainable; the other entries (buffers) kept whole: a frozen copy of the
    /// policy (the KL reference) sharded like it.
    pub fn shard_map(
        &self,
        names: &[(String, Tensor)],
        map: &Params,
    ) -> Result<Params, TrainError> {
        let picked = self.picked(names, map)?;
        let mut out: HashMap<String, Tensor> = self
            .shard(&picked)?
            .into_iter()
            .map(|(n, t)| (n, t.detach()))
            .collect();
        let trained: HashSet<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
        for (n, t) in map.iter().filter(|(n, _)| !trained.contains(n.as_str())) {
            out.insert(n.clone(), t.clone());
        }
        Ok(Arc::new(out))
    }

    /// The whole tensors of a map sharded by [`FsdpPolicy::shard_map`] (experts too). Collective
    /// over the shard group.
    pub fn gather_map(
        &self,
        dist: &Dist,
        names: &[(String, Tensor)],
        map: &Params,
    ) -> Result<Params, TrainError> {
        let picked = self.picked(names, map)?;
        let gathered = self.gather(dist, &picked, false)?;
        let mut out: HashMap<String, Tensor> =
            self.whole_experts(dist, gathered)?.into_iter().collect();
        for (n, t) in map.iter() {
            out.entry(n.clone()).or_insert_with(|| t.clone());
        }
        Ok(Arc::new(out))
    }

    /// `map`'s tensors of the trained parameters `names`, in layout order.
    fn picked(&self, names: &[(String, Tensor)], map: &Params) -> Result<Named, TrainError> {
        names
            .iter()
            .map(|(n, _)| {
                let t = map.get(n).ok_or_else(|| {
                    TrainError::Config(format!("fsdp: no tensor {n} in the policy's copy"))
                })?;
                Ok((n.clone(), t.clone()))
            })
            .collect()
    }

    /// This rank's rows of the whole optimizer state `state` (read from a checkpoint): each
    /// `<param>.<state>` of its parameter's whole shape cut to this rank's rows, the rest
    /// (scalars, counters) kept. `whole` gives the parameters' whole shapes, in layout order.
    pub fn shard_state(
        &self,
        whole: &[(String, Tensor)],
        state: BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let mut out = BTreeMap::new();
        for (key, t) in state {
            let t = match self.fsdp.state_rows(whole, &key, t.shape()) {
                Some(rows) => {
                    let values = t.to_vec_f32();
                    let row_len = t.shape().iter().skip(1).product::<usize>();
                    let mut shape = t.shape().to_vec();
                    shape[0] = rows.len();
                    let mine = values[rows.start * row_len..rows.end * row_len].to_vec();
                    crate::parallel::staged::rebuild(mine, &shape, t.dtype(), t.device())?
                }
                None => t,
            };
            out.insert(key, t);
        }
        Ok(out)
    }

    /// The whole parameters from this rank's rows `shards` (exact: the f32 values travel as
    /// they are), as trainable leaves when `training`; under expert parallelism an expert
    /// parameter is this rank's slice of the experts ([`FsdpPolicy::whole_experts`] makes it
    /// whole). Collective over the shard group.
    pub fn gather(
        &self,
        dist: &Dist,
        shards: &[(String, Tensor)],
        training: bool,
    ) -> Result<Named, TrainError> {
        let comm = shard_comm(dist)?;
        Ok(crate::parallel::pp::sharded::gather(
            &self.fsdp,
            comm,
            self.efsdp(dist),
            shards,
            &[],
            training,
        )?
        .named)
    }

    /// Reduce-scatters the gradients of the whole parameters `whole` (this rank's batch) to
    /// this rank's rows, sums them over the replicas under HSDP and sets them on `shards`. A
    /// parameter no rank got a gradient for keeps none, as in one process. Collective over the
    /// data-parallel ranks.
    pub fn reduce_grads(
        &self,
        dist: &Dist,
        whole: &[(String, Tensor)],
        shards: &[(String, Tensor)],
    ) -> Result<(), TrainError> {
        let comm = shard_comm(dist)?;
        let (rows, got) =
            crate::parallel::pp::sharded::scatter_grads(&self.fsdp, comm, self.efsdp(dist), whole)?;
        Fsdp::set_shard_grads(dist.grads(), dist.replicate(), shards, rows, &got)
    }

    /// This rank's checkpoint pieces of `shards` as `<prefix>/<name>` (and, on the shard
    /// group's first rank, of the tensors held `whole`), as FSDP training writes them: any
    /// layout reads them back.
    pub fn pieces<'a>(
        &self,
        prefix: &str,
        shards: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
        whole: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
        out: &mut Vec<PieceRef<'a>>,
    ) {
        let first = self.place.0 == 0;
        self.fsdp.shard_pieces(first, prefix, shards, whole, out);
    }

    /// This rank's checkpoint pieces of the optimizer state of `shards`.
    pub fn state_pieces<'a>(
        &self,
        shards: &[(String, Tensor)],
        state: &'a BTreeMap<String, Tensor>,
        out: &mut Vec<PieceRef<'a>>,
    ) {
        self.fsdp
            .state_pieces(self.place.0 == 0, shards, state, out);
    }
}

fn shard_comm(dist: &Dist) -> Result<&dyn Collective, TrainError> {
    dist.shard()
        .ok_or_else(|| TrainError::Config("fsdp: a sharded policy without a dp_shard group".into()))
}
