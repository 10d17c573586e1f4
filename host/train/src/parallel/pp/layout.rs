//! Which blocks each pipeline stage runs and which parameters each rank holds.
//!
//! The pipeline has `pp × pp_virtual_stages` stages of contiguous blocks; stage `s` runs on
//! pipeline rank `s mod pp` (so under interleaving a rank holds every `pp`-th stage), or under
//! `pp_schedule = "zbv"` in V order (rank `r` runs stages `r` and `2·pp − 1 − r`). The first
//! stage also runs `embed`, the last `head` and the loss. Blocks are split as
//! `parallelism.pp_split` says, or balanced by their parameter counts (a block's matrix products
//! cost twice its parameters in FLOPs per token, so equal blocks split equally).

use super::schedule::{self, Schedule};
use crate::TrainError;
use anneal_config::JobConfig;
use anneal_engine::Tensor;
use anneal_plugin_api::spec::ModelSpec;
use anneal_runtime::plugins::{ForwardOpts, Params, PluginModel, StageInput};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

/// The stages of a pipeline and the ranks they run on.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    /// Pipeline ranks.
    pub p: usize,
    /// Stages per rank.
    pub v: usize,
    /// The blocks of each stage, first stage first.
    pub stages: Vec<Range<usize>>,
    /// The schedule, which also places the stages on the ranks.
    pub schedule: Schedule,
}

impl Layout {
    /// The layout `cfg.parallelism` asks for over a model of `n_layers` blocks costing
    /// `cost[i]` each; a split that does not fit the model is a user error naming the keys.
    pub fn new(cfg: &JobConfig, n_layers: usize, cost: &[f64]) -> Result<Layout, TrainError> {
        let par = &cfg.parallelism;
        let p = usize::try_from(par.pp).unwrap_or(1).max(1);
        let v = usize::try_from(par.pp_virtual_stages).unwrap_or(1).max(1);
        let n_stages = p * v;
        if n_layers < n_stages {
            return Err(TrainError::Config(format!(
                "config: `parallelism.pp` ({p}) × `parallelism.pp_virtual_stages` ({v}) = {n_stages} pipeline stages, but the model has {n_layers} layer(s); every stage needs at least one block, so lower parallelism.pp or parallelism.pp_virtual_stages"
            )));
        }
        // Tags carry the stage in 5 bits (see `wire`).
        if n_stages > 32 {
            return Err(TrainError::Config(format!(
                "config: `parallelism.pp` ({p}) × `parallelism.pp_virtual_stages` ({v}) = {n_stages} pipeline stages; at most 32 are supported"
            )));
        }
        let sizes: Vec<usize> = if par.pp_split.is_empty() {
            balanced(cost, n_stages)
        } else {
            let sizes: Vec<usize> = par.pp_split.iter().map(|&n| n.max(0) as usize).collect();
            let sum: usize = sizes.iter().sum();
            if sizes.len() != n_stages || sum != n_layers {
                return Err(TrainError::Config(format!(
                    "config: `parallelism.pp_split` = {:?} lists {} stage(s) of {sum} block(s), but the pipeline has {n_stages} stages (parallelism.pp × parallelism.pp_virtual_stages) and the model {n_layers} layer(s); give one block count per stage, summing to {n_layers}",
                    par.pp_split,
                    sizes.len()
                )));
            }
            sizes
        };
        let mut stages = Vec::with_capacity(n_stages);
        let mut at = 0;
        for n in sizes {
            stages.push(at..at + n);
            at += n;
        }
        let schedule = Schedule::from_name(&par.pp_schedule);
        Ok(Layout {
            p,
            v,
            stages,
            schedule,
        })
    }

    /// The stage rank `rank`'s chunk `chunk` runs.
    pub fn stage_of(&self, rank: usize, chunk: usize) -> usize {
        schedule::stage_of(self.schedule, rank, chunk, self.p)
    }

    /// The rank that runs stage `s`.
    pub fn rank_of(&self, s: usize) -> usize {
        schedule::rank_of(self.schedule, s, self.p)
    }

    /// Stages in the pipeline.
    pub fn n_stages(&self) -> usize {
        self.stages.len()
    }

    /// The stage that runs block `layer`.
    pub fn stage_of_layer(&self, layer: usize) -> usize {
        self.stages
            .iter()
            .position(|r| r.contains(&layer))
            .unwrap_or(self.stages.len() - 1)
    }

    /// `[0..4, 4..8]`: the blocks of each stage, for logs.
    pub fn describe(&self) -> String {
        let stages: Vec<String> = self
            .stages
            .iter()
            .enumerate()
            .map(|(s, r)| {
                format!(
                    "stage {s} (rank {}): blocks {}..{}",
                    self.rank_of(s),
                    r.start,
                    r.end
                )
            })
            .collect();
        stages.join("; ")
    }
}

/// Splits blocks of cost `cost` into `n` contiguous non-empty runs with the smallest largest
/// run; among those, each run takes as many blocks as it can from the front (the last stage
/// also runs the head, so it is left the lightest).
pub fn balanced(cost: &[f64], n: usize) -> Vec<usize> {
    let len = cost.len();
    let mut prefix = vec![0.0; len + 1];
    for (i, c) in cost.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][j]: the smallest largest run splitting the first j blocks into k runs.
    let mut best = vec![vec![f64::INFINITY; len + 1]; n + 1];
    best[0][0] = 0.0;
    for k in 1..=n {
        for j in k..=len {
            for i in (k - 1)..j {
                let c = best[k - 1][i].max(sum(i, j));
                if c < best[k][j] {
                    best[k][j] = c;
                }
            }
        }
    }
    // A little slack so float sums that tie are not split differently.
    let cap = best[n][len] * (1.0 + 1e-9);
    let mut sizes = Vec::with_capacity(n);
    let mut at = 0;
    for k in 0..n {
        let left_after = n - k - 1;
        let mut end = at + 1;
        while end < len - left_after && sum(at, end + 1) <= cap {
            end += 1;
        }
        sizes.push(end - at);
        at = end;
    }
    sizes
}

/// Each block's parameter count: what [`Layout::new`] balances.
pub fn block_costs(spec: &ModelSpec) -> Vec<f64> {
    let mut cost = vec![0.0; spec.n_layers];
    for p in &spec.params {
        if let Some(l) = p.layer.filter(|&l| l < spec.n_layers) {
            cost[l] += p.shape.iter().product::<usize>() as f64;
        }
    }
    cost
}

/// Which of the parameters outside the blocks `embed` reads and which `head` reads, found by
/// running each stage on one token without each of them (a stage that still runs does not
/// read it). A parameter both read (tied embeddings) is refused: it would live on two stages.
pub fn outer_owners(
    model: &PluginModel,
    outer: &[(String, Tensor)],
) -> Result<(HashSet<String>, HashSet<String>), TrainError> {
    let _no_grad = anneal_engine::autograd::no_grad();
    // The probe's token where the parameters are (ids on the host cannot index GPU weights).
    let device = outer
        .first()
        .map_or(anneal_engine::Device::Cpu, |(_, t)| t.device());
    let tokens = crate::parallel::staged::place(Tensor::from_vec(vec![0i64], &[1, 1])?, device)?;
    let positions = Tensor::from_vec(vec![0i64], &[1])?;
    let opts = ForwardOpts::default();
    let without = |skip: Option<&str>| -> Params {
        Arc::new(
            outer
                .iter()
                .filter(|(n, _)| Some(n.as_str()) != skip)
                .cloned()
                .collect::<HashMap<_, _>>(),
        )
    };
    let all = without(None);
    let hidden = model.embed(&all, &tokens, &positions, &opts)?;
    let head = |params: &Params| {
        model.forward_part(
            params,
            StageInput::Hidden(hidden.clone()),
            0..0,
            true,
            &positions,
            &opts,
        )
    };
    head(&all)?;
    let (mut embed_reads, mut head_reads) = (HashSet::new(), HashSet::new());
    for (name, _) in outer {
        let params = without(Some(name));
        if model.embed(&params, &tokens, &positions, &opts).is_err() {
            embed_reads.insert(name.clone());
        }
        if head(&params).is_err() {
            head_reads.insert(name.clone());
        }
        if embed_reads.contains(name) && head_reads.contains(name) {
            return Err(TrainError::Config(format!(
                "config: `parallelism.pp`: the model's `embed` and `head` both read the parameter {name} (tied embeddings), which pipeline parallelism does not support yet; untie it (e.g. model.args.tie_embeddings = false) or set parallelism.pp = 1"
            )));
        }
    }
    Ok((embed_reads, head_reads))
}

#[cfg(test)]
mod tests {
    use super::balanced;

    #[test]
    fn equal_blocks_split_equally_and_uneven_ones_by_cost() {
        assert_eq!(balanced(&[1.0; 8], 2), vec![4, 4]);
        assert_eq!(balanced(&[1.0; 8], 4), vec![2, 2, 2, 2]);
        // 6 blocks on 4 stages: the front takes the extra ones, the head's stage is lighter.
        assert_eq!(balanced(&[1.0; 6], 4), vec![2, 2, 1, 1]);
        // One heavy block gets a stage of its own.
        assert_eq!(balanced(&[1.0, 1.0, 4.0, 1.0, 1.0], 3), vec![2, 1, 2]);
        assert_eq!(balanced(&[1.0; 2], 2), vec![1, 1]);
    }
}
