//! Tensor parallelism outside the pretraining step: a policy or a served model held as this
//! rank's slices ([`crate::parallel::tp::TpLayout`], the same placements and checks as training), the
//! group its decode and the RL trainer's forward run over, and the pieces a run needs around
//! them (the global gradient norm, whole tensors for a checkpoint).
//!
//! The communicator is installed on the calling thread while a guard ([`TpActive`]) lives, as
//! in a training step: every rank of the group must then run the same forwards (and backwards)
//! in the same order.

use crate::parallel::tp::{activate, ActiveTp, TpLayout};
use crate::{Dist, TrainError};
use anneal_dist::Collective;
use anneal_engine::Tensor;
use anneal_plugin_api::spec::ModelSpec;
use anneal_runtime::plugins::TensorParallelism;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

type Named = Vec<(String, Tensor)>;

/// A model split over a tensor-parallel group for inference (and the RL trainer).
pub struct TpInference {
    layout: TpLayout,
    comm: Rc<dyn Collective>,
}

/// Keeps the group's communicator installed on this thread until dropped.
pub struct TpActive {
    _guard: ActiveTp,
}

impl TpInference {
    /// `spec` (named `model` in errors) split over the ranks of `comm`, or the user error
    /// naming what does not split (the checks of `parallelism.tp` in training: the Llama 3
    /// family, Qwen3 or Qwen3-MoE, heads and split dims divisible by the degree).
    pub fn new(
        model: &str,
        spec: &ModelSpec,
        comm: Rc<dyn Collective>,
    ) -> Result<TpInference, TrainError> {
        let layout = TpLayout::of_model(model, spec, comm.rank(), comm.size())?;
        Ok(TpInference { layout, comm })
    }

    /// The tensor-parallel group of `dist` for `spec`, when `parallelism.tp > 1`.
    pub fn of_dist(
        dist: &Dist,
        model: &str,
        spec: &ModelSpec,
    ) -> Result<Option<TpInference>, TrainError> {
        dist.tp()
            .map(|comm| TpInference::new(model, spec, comm.clone()))
            .transpose()
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the group.
    pub fn ranks(&self) -> usize {
        self.comm.size()
    }

    /// One line for the console.
    pub fn summary(&self) -> String {
        self.layout.summary()
    }

    /// This rank's slice of parameter `name`, given whole (a copy when it is split, else
    /// `whole` itself): what a rank keeps of each tensor as it loads them one by one.
    pub fn slice_one(&self, name: &str, whole: &Tensor) -> Result<Tensor, TrainError> {
        self.layout.slice(name, whole)
    }

    /// This rank's slices of the model's parameters under `prefix` (`model`, or an RL run's
    /// `ref`) in a checkpoint of any layout, read one tensor at a time: loaded with
    /// [`crate::checkpoint::Contents::OnDemand`], the rank never holds the whole model.
    pub fn params_from_checkpoint(
        &self,
        ckpt: &crate::checkpoint::Loaded,
        model: &anneal_runtime::plugins::PluginModel,
        prefix: &str,
    ) -> Result<Named, TrainError> {
        let keep: &dyn Fn(&str) -> bool = &|_| true;
        crate::parallel::checkpoint::read_params(self.cut(), ckpt, model, (prefix, keep), &[])
    }

    /// Loads this rank's slices of a checkpoint's optimizer state into `optimizer`, for
    /// `named` (this rank's slices of the parameters), one tensor at a time.
    pub fn restore_optimizer(
        &self,
        ckpt: &crate::checkpoint::Loaded,
        named: &Named,
        optimizer: &mut anneal_runtime::plugins::PluginOptimizer,
    ) -> Result<(), TrainError> {
        crate::parallel::checkpoint::read_optimizer(
            self.cut(),
            ckpt,
            (named.as_slice(), false),
            optimizer,
        )
    }

    /// Whether parameter `name`'s gradient is partial on each rank of the group (a per-head
    /// norm's: each rank applies it to its heads).
    pub fn partial_grad(&self, name: &str) -> bool {
        self.layout.partial_grad(name)
    }

    /// How the group cuts the parameters, as checkpoints see it.
    fn cut(&self) -> crate::parallel::checkpoint::Cut<'_> {
        crate::parallel::checkpoint::Cut {
            tp: Some(&self.layout),
            fsdp: None,
        }
    }

    /// What a forward over the slices needs (no sequence parallelism).
    pub fn context(&self) -> TensorParallelism {
        self.layout.context()
    }

    /// Installs the group's communicator on this thread until the guard drops.
    pub fn activate(&self) -> TpActive {
        TpActive {
            _guard: activate(&self.comm),
        }
    }

    /// How parameter `name` lies over the group: split along its cut dim, or whole.
    pub fn placement(&self, name: &str) -> crate::parallel::Placement {
        self.layout.placement(name)
    }

    /// Whole tensors from this rank's slices `named` (split parameters gathered over the group
    /// in rank order, the others as they are): what a checkpoint holds, whatever the layout.
    /// Collective: every rank of the group calls it with the same names.
    pub fn whole(&self, named: &Named) -> Result<Named, TrainError> {
        named
            .iter()
            .map(|(n, t)| Ok((n.clone(), self.whole_of(n, t)?)))
            .collect()
    }

    /// Whole optimizer state from this rank's: each `<param>.<state>` tensor of its split
    /// parameter's local shape gathered like the parameter, the rest (scalars, counters) kept.
    /// `named` gives the local shapes. Collective, like [`TpInference::whole`].
    pub fn whole_state(
        &self,
        named: &Named,
        state: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let shapes: HashMap<&str, &[usize]> =
            named.iter().map(|(n, t)| (n.as_str(), t.shape())).collect();
        let mut out = BTreeMap::new();
        for (key, t) in state {
            let t = match param_of(key).filter(|p| shapes.get(p) == Some(&t.shape())) {
                Some(p) => self.whole_of(p, t)?,
                None => t.clone(),
            };
            out.insert(key.clone(), t);
        }
        Ok(out)
    }

    /// The whole tensor of parameter `name` from this rank's slice `local`.
    fn whole_of(&self, name: &str, local: &Tensor) -> Result<Tensor, TrainError> {
        match self.layout.split_dim(name) {
            Some(dim) if local.rank() > dim => {
                crate::parallel::tp::gather_along(self.comm.as_ref(), local, dim)
            }
            _ => Ok(local.clone()),
        }
    }
}

/// The parameter an optimizer state key `<param>.<state>` belongs to.
fn param_of(key: &str) -> Option<&str> {
    key.rsplit_once('.').map(|(p, _)| p)
}

impl Dist {
    /// This rank's place in its tensor-parallel group (0 without tensor parallelism).
    pub fn tp_rank(&self) -> usize {
        self.tp().map_or(0, |c| c.rank())
    }
}
