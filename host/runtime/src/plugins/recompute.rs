//! Selective activation checkpointing by memory budget (`activation_checkpoint.mode =
//! "budget"`): measure what each block keeps for backward and what recomputing it costs, then
//! recompute the cheapest blocks first (fewest FLOPs per byte freed) until what is kept fits
//! `memory_budget` × the total, in the spirit of TorchTitan's memory-budget mode (which picks
//! single activations with a min-cut; here the unit is a block, the unit the runner can
//! recompute).
//!
//! Measuring: one probe forward of each block on the real batch shape, grad on, from the
//! embedding's output; the allocator's bytes in use while the block's output (and so its
//! saved tensors) is alive, and the FLOP counter's difference. The probe reads no data and
//! draws no random numbers, so planning changes nothing a run computes.

use super::model::{ForwardOpts, Params, PluginModel};
use anneal_engine::{alloc, autograd, flops, Tensor};

/// What a memory-budget plan recomputes and what that costs.
#[derive(Clone, Debug, PartialEq)]
pub struct RecomputePlan {
    /// The budget: the fraction of the blocks' activation bytes to keep (0 = recompute all).
    pub budget: f64,
    /// Per block: recompute it in backward.
    pub recompute: Vec<bool>,
    /// Per block: bytes it keeps for backward when not recomputed.
    pub block_bytes: Vec<usize>,
    /// Per block: FLOPs of one forward of it (what a recompute adds).
    pub block_flops: Vec<u64>,
}

impl RecomputePlan {
    /// Bytes of block activations kept for backward under this plan.
    pub fn kept_bytes(&self) -> usize {
        self.pick(&self.block_bytes, false).sum()
    }

    /// Bytes of block activations without any recompute.
    pub fn total_bytes(&self) -> usize {
        self.block_bytes.iter().sum()
    }

    /// FLOPs the recomputed blocks add to every step.
    pub fn recompute_flops(&self) -> u64 {
        self.pick(&self.block_flops, true).sum()
    }

    fn pick<'a, T: Copy + 'a>(
        &'a self,
        v: &'a [T],
        recomputed: bool,
    ) -> impl Iterator<Item = T> + 'a {
        v.iter()
            .zip(&self.recompute)
            .filter(move |(_, &r)| r == recomputed)
            .map(|(x, _)| *x)
    }

    /// One line for the run's log.
    pub fn summary(&self) -> String {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let blocks: Vec<String> = self
            .recompute
            .iter()
            .enumerate()
            .filter(|(_, &r)| r)
            .map(|(i, _)| i.to_string())
            .collect();
        let fwd: u64 = self.block_flops.iter().sum();
        format!(
            "activation checkpointing: budget {:.2}: recompute blocks [{}] of {}; keeps {:.1} of {:.1} MiB of block activations; recompute adds {:.2} GFLOP per micro-batch ({:.0}% of the blocks' forward)",
            self.budget,
            blocks.join(", "),
            self.recompute.len(),
            mib(self.kept_bytes()),
            mib(self.total_bytes()),
            self.recompute_flops() as f64 / 1e9,
            100.0 * self.recompute_flops() as f64 / fwd.max(1) as f64
        )
    }
}

/// Picks the blocks to recompute so that the kept bytes fit `budget` (0..=1) × the total:
/// cheapest first by FLOPs per byte freed, ties by block index.
pub fn choose(budget: f64, block_bytes: Vec<usize>, block_flops: Vec<u64>) -> RecomputePlan {
    let n = block_bytes.len();
    let total: usize = block_bytes.iter().sum();
    let allowed = (budget.clamp(0.0, 1.0) * total as f64).floor() as usize;
    let mut order: Vec<usize> = (0..n).collect();
    let cost = |i: usize| block_flops[i] as f64 / block_bytes[i].max(1) as f64;
    order.sort_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(a.cmp(&b)));
    let mut recompute = vec![false; n];
    let mut kept = total;
    for i in order {
        if kept <= allowed {
            break;
        }
        recompute[i] = true;
        kept -= block_bytes[i];
    }
    RecomputePlan {
        budget,
        recompute,
        block_bytes,
        block_flops,
    }
}

/// Measures every block of `model` on a batch shaped like `tokens` and plans for `budget`.
/// Call it under the autocast mode training runs with (bf16 activations take half the bytes).
pub fn plan_memory_budget(
    model: &PluginModel,
    params: &Params,
    tokens: &Tensor,
    positions: &Tensor,
    budget: f64,
) -> anneal_engine::Result<RecomputePlan> {
    let _grad = autograd::set_grad_enabled(true);
    let opts = ForwardOpts {
        training: true,
        ..Default::default()
    };
    // The blocks' input: the embedding's output, cut from the graph (its own activations are
    // not the blocks') and requiring grad, so each block records what backward needs.
    let hidden: Vec<Tensor> = model
        .embed(params, tokens, positions, &opts)?
        .iter()
        .map(|t| t.detach().requires_grad_())
        .collect();
    let (mut bytes, mut flops_of) = (Vec::new(), Vec::new());
    for i in 0..model.spec().n_layers {
        let (b0, f0) = (alloc::memory_stats().current_bytes, flops::counted());
        let out = model.layer(params, positions, &opts, i, &hidden)?;
        let (b1, f1) = (alloc::memory_stats().current_bytes, flops::counted());
        bytes.push(b1.saturating_sub(b0));
        flops_of.push(f1 - f0);
        drop(out);
    }
    Ok(choose(budget, bytes, flops_of))
}

/// [`plan_memory_budget`] for training micro-batches of `batch × seq_len` tokens under the
/// autocast dtype training uses (`None` for f32).
pub fn plan_for_training(
    model: &PluginModel,
    params: &Params,
    batch: usize,
    seq_len: usize,
    autocast: Option<anneal_engine::DType>,
    budget: f64,
) -> anneal_engine::Result<RecomputePlan> {
    let _amp = anneal_engine::autocast::set_autocast(autocast);
    let tokens = Tensor::zeros(&[batch, seq_len], anneal_engine::DType::I64);
    let positions = Tensor::from_vec((0..seq_len as i64).collect(), &[seq_len])?;
    plan_memory_budget(model, params, &tokens, &positions, budget)
}

#[cfg(test)]
mod tests {
    use super::choose;

    #[test]
    fn cheapest_blocks_go_first_until_the_budget_fits() {
        // Block 2 frees the most bytes per FLOP, then blocks 0, 1, 3 (ties by index).
        let (bytes, flops) = (vec![100, 100, 200, 100], vec![10, 10, 10, 10]);
        let p = choose(0.6, bytes.clone(), flops.clone());
        assert_eq!(p.recompute, vec![false, false, true, false]);
        assert_eq!((p.kept_bytes(), p.total_bytes()), (300, 500));
        let p = choose(0.5, bytes.clone(), flops.clone());
        assert_eq!(p.recompute, vec![true, false, true, false]);
        assert_eq!(p.recompute_flops(), 20);
        let p = choose(0.3, bytes.clone(), flops.clone());
        assert_eq!(p.recompute, vec![true, true, true, false]);
        assert_eq!(p.kept_bytes(), 100);
        assert_eq!(
            choose(1.0, vec![5, 5], vec![1, 1]).recompute,
            vec![false, false]
        );
        assert_eq!(
            choose(0.0, vec![5, 5], vec![1, 1]).recompute,
            vec![true, true]
        );
        let s = choose(0.6, bytes, flops).summary();
        assert!(s.contains("recompute blocks [2] of 4"), "{s}");
    }
}
