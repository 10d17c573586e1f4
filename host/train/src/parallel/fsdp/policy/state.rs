//! The optimizer state of a sharded policy made whole again (over the `dp_shard` group), for a
//! checkpoint written as whole tensors: what `anneal rl` under TP × FSDP saves, after which the
//! tensor-parallel group gathers the slices ([`crate::TpInference::whole_state`]).

use super::{shard_comm, FsdpPolicy};
use crate::{Dist, TrainError};
use anneal_engine::Tensor;
use std::collections::BTreeMap;

impl FsdpPolicy {
    /// The whole optimizer state from this rank's `state` of the rows `shards` (the trained
    /// parameters, in layout order): each parameter-shaped `<param>.<state>` gathered over the
    /// shard group like its parameter (exact: the values travel as f32), the rest (scalars,
    /// counters, held alike by every rank) kept. Collective over the shard group: every rank
    /// holds the same keys.
    pub fn gather_state(
        &self,
        dist: &Dist,
        shards: &[(String, Tensor)],
        state: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let comm = shard_comm(dist)?;
        let mut out = BTreeMap::new();
        for (key, t) in state {
            let whole = match self.fsdp.state_piece(shards, key, t.shape()) {
                Some((shape, _)) => {
                    let i = param_index(shards, key).ok_or_else(|| {
                        TrainError::Config(format!("optimizer state {key} belongs to no parameter"))
                    })?;
                    let rows = &self.fsdp.layouts()[i].1;
                    let values = rows.all_gather(comm, &t.to_vec_f32())?;
                    crate::parallel::staged::rebuild(values, &shape, t.dtype(), t.device())?
                }
                None => t.clone(),
            };
            out.insert(key.clone(), whole);
        }
        Ok(out)
    }
}

/// The index in `names` of the parameter state `key` (`<param>.<state>`) belongs to: the
/// longest name that prefixes it up to a dot (parameter names hold dots), as
/// [`super::Fsdp::state_piece`] finds it.
fn param_index(names: &[(String, Tensor)], key: &str) -> Option<usize> {
    names
        .iter()
        .enumerate()
        .filter(|(_, (n, _))| {
            key.len() > n.len() && key.starts_with(n.as_str()) && key.as_bytes()[n.len()] == b'.'
        })
        .max_by_key(|(_, (n, _))| n.len())
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_key_belongs_to_the_longest_parameter_name_before_a_dot() {
        let t = Tensor::from_vec(vec![0.0], &[1]).unwrap();
        let names: Vec<(String, Tensor)> = ["w", "w.bias", "wq"]
            .iter()
            .map(|n| (n.to_string(), t.clone()))
            .collect();
        assert_eq!(param_index(&names, "w.bias.exp_avg"), Some(1));
        assert_eq!(param_index(&names, "w.exp_avg"), Some(0));
        assert_eq!(param_index(&names, "wq.exp_avg_sq"), Some(2));
        assert_eq!(param_index(&names, "step"), None);
    }
}
