//! Placements: for each trained parameter, how it lies over each axis of the mesh.

use crate::TrainError;

/// An axis of the mesh as the trainer's collectives see it. FSDP's rows are split over the
/// `dp_shard` and `cp` ranks together (TorchTitan's `dp_shard_cp`), so they form one axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Axis {
    /// The `dp_replicate` ranks: whole replicas of the parameters (or of their FSDP shards).
    DpReplicate,
    /// The `dp_shard` × `cp` ranks: FSDP's group.
    DpShard,
    /// The `tp` ranks: tensor parallelism's group.
    Tp,
    /// The `pp` ranks: the pipeline's stages.
    Pp,
}

impl Axis {
    /// The axes in the order per-axis sums are taken (the order the gradient norm adds in).
    pub const ALL: [Axis; 4] = [Axis::DpReplicate, Axis::DpShard, Axis::Tp, Axis::Pp];

    /// The config keys that set the axis.
    pub fn keys(self) -> &'static str {
        match self {
            Axis::DpReplicate => "parallelism.dp_replicate",
            Axis::DpShard => "parallelism.dp_shard × parallelism.cp",
            Axis::Tp => "parallelism.tp",
            Axis::Pp => "parallelism.pp",
        }
    }
}

/// How one parameter (or its gradient) lies over the ranks of one axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Every rank holds the whole, the same values.
    Replicate,
    /// The ranks hold consecutive, disjoint pieces along `dim`, in rank order (FSDP's padded
    /// rows along 0; a tensor-parallel split along its cut dim).
    Shard(usize),
    /// Every rank holds a whole-shaped part; the value is their sum (a gradient before it is
    /// summed over the ranks that computed it).
    Partial,
    /// One rank holds the whole (the pipeline stage that computes with it); the others hold
    /// nothing.
    Stage,
}

impl Placement {
    /// Whether each element is held by one rank of the axis only, so that a per-rank sum of
    /// squares adds up over the axis.
    pub fn is_split(self) -> bool {
        matches!(self, Placement::Shard(_) | Placement::Stage)
    }
}

/// Where every trained parameter of the model lives: one placement per parameter and axis.
/// Parameters are kept in name order, the fixed order every reduction over them adds in.
#[derive(Clone, Debug)]
pub struct Placements {
    /// Every trained parameter of the whole model, sorted (under pipeline parallelism also the
    /// ones this rank does not hold).
    names: Vec<String>,
    /// The axes with more than one rank that place some parameter other than whole, each
    /// with one placement per name.
    axes: Vec<(Axis, Vec<Placement>)>,
    /// Per axis, which parameters' gradients are `Partial` over it after the backward (each
    /// rank computed a part of the sum), one flag per name.
    partial_grads: Vec<(Axis, Vec<bool>)>,
}

impl Placements {
    /// Every parameter of `names` whole on every rank (one process, or replicas alone).
    pub fn replicated(names: impl IntoIterator<Item = String>) -> Placements {
        let mut names: Vec<String> = names.into_iter().collect();
        names.sort();
        names.dedup();
        Placements {
            names,
            axes: Vec::new(),
            partial_grads: Vec::new(),
        }
    }

    /// Adds (or replaces) `axis`, placing each parameter by `place(name)`.
    pub fn with(mut self, axis: Axis, place: impl Fn(&str) -> Placement) -> Placements {
        let places = self.names.iter().map(|n| place(n)).collect();
        self.axes.retain(|(a, _)| *a != axis);
        self.axes.push((axis, places));
        self.axes.sort_by_key(|(a, _)| *a);
        self
    }

    /// Marks over `axis` the gradients that are `Partial` after the backward: those of the
    /// parameters `partial(name)` picks.
    pub fn with_partial_grads(mut self, axis: Axis, partial: impl Fn(&str) -> bool) -> Placements {
        let flags = self.names.iter().map(|n| partial(n)).collect();
        self.partial_grads.retain(|(a, _)| *a != axis);
        self.partial_grads.push((axis, flags));
        self
    }

    /// Whether parameter `name`'s gradient is `Partial` over `axis` after the backward.
    pub fn grad_is_partial(&self, name: &str, axis: Axis) -> bool {
        let at = self.index(name);
        self.partial_grads
            .iter()
            .find(|(a, _)| *a == axis)
            .zip(at)
            .is_some_and(|((_, flags), i)| flags[i])
    }

    /// Every trained parameter's name, sorted.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The position of parameter `name` in [`Placements::names`].
    pub fn index(&self, name: &str) -> Option<usize> {
        self.names.binary_search_by(|n| n.as_str().cmp(name)).ok()
    }

    /// How parameter `name` lies over `axis` (`Replicate` for an axis that splits nothing).
    pub fn of(&self, name: &str, axis: Axis) -> Placement {
        let at = self.index(name);
        self.axes
            .iter()
            .find(|(a, _)| *a == axis)
            .zip(at)
            .map_or(Placement::Replicate, |((_, places), i)| places[i])
    }

    /// The axes that place some parameter other than whole, in [`Axis::ALL`]'s order, with
    /// their placements (one per name).
    pub(crate) fn axes(&self) -> impl Iterator<Item = (Axis, &[Placement])> {
        self.axes.iter().map(|(a, p)| (*a, p.as_slice()))
    }

    /// A failure for a placement a reduction cannot take (a bug: the trainer sums partial
    /// gradients before it asks).
    pub(crate) fn unexpected(&self, i: usize, axis: Axis, what: &str) -> TrainError {
        TrainError::Config(format!(
            "parallel: parameter {} is {:?} over {} where the {what} needs it whole or split",
            self.names[i],
            self.of(&self.names[i], axis),
            axis.keys()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_are_kept_per_name_and_axis_in_a_fixed_order() {
        let names = ["b", "a", "c"].map(String::from);
        let p = Placements::replicated(names)
            .with(Axis::Pp, |_| Placement::Stage)
            .with(Axis::Tp, |n| match n {
                "a" => Placement::Shard(1),
                _ => Placement::Replicate,
            });
        assert_eq!(p.names(), ["a", "b", "c"]);
        assert_eq!(p.of("a", Axis::Tp), Placement::Shard(1));
        assert_eq!(p.of("b", Axis::Tp), Placement::Replicate);
        assert_eq!(p.of("c", Axis::Pp), Placement::Stage);
        assert_eq!(p.of("a", Axis::DpShard), Placement::Replicate);
        assert_eq!(p.of("zzz", Axis::Pp), Placement::Replicate);
        // Tp before Pp whatever the order they were added in.
        let order: Vec<Axis> = p.axes().map(|(a, _)| a).collect();
        assert_eq!(order, [Axis::Tp, Axis::Pp]);
    }
}
