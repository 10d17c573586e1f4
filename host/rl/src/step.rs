//! The phases of one RL step that [`crate::run`]'s loop names: the step's rollouts when the
//! policy is sharded (FSDP, EP), and the optimizer updates on the step's rollouts.

use crate::buffer::{Item, RolloutBuffer};
use crate::rollout::{rollout_round_with, Group, RolloutCtx};
use crate::trainer::{publishable, RlTrainer, StepOut};
use anneal_engine::Tensor;
use anneal_runtime::plugins::{Params, PluginOptimizer};
use anneal_train::{Dist, TrainError};
use std::sync::Arc;

impl RlTrainer<'_> {
    /// Under FSDP, this step's rollouts: the policy gathered whole once (under expert
    /// parallelism with every expert, see `FsdpPolicy::whole_experts`), published as `version`
    /// and decoded on this thread; the trainer's first forward keeps the gathered tensors, so
    /// the rollouts and the trainer see the same bits. Nothing whole stays in the buffer.
    /// Collective over the FSDP (and expert) groups; a no-op without FSDP.
    pub(crate) fn sharded_rollout_round(
        &mut self,
        dist: &Dist,
        ctx: &RolloutCtx,
        buffer: &RolloutBuffer<Group, Params>,
        version: u64,
        groups: usize,
        perturb: f32,
    ) -> Result<(), TrainError> {
        let Some(f) = self.fsdp else {
            return Ok(());
        };
        let whole = f.gather(dist, &self.named, true)?;
        let all: Vec<(String, Tensor)> = f
            .whole_experts(dist, whole.clone())?
            .into_iter()
            .chain(self.buffers.iter().cloned())
            .collect();
        let weights = if perturb != 0.0 {
            publishable(&all, perturb)?
        } else {
            // Views of the gathered tensors (they are this step's own, not updated).
            Arc::new(all.into_iter().map(|(n, t)| (n, t.detach())).collect())
        };
        rollout_round_with(ctx, buffer, version, weights, groups);
        self.whole = Some(whole);
        Ok(())
    }

    /// `updates` optimizer steps on the step's rollouts `items` (GRPO's μ), each a trainer
    /// step, the model's buffer hook and the update at learning rate `lr`; a non-finite loss,
    /// auxiliary loss or gradient norm fails the step with nothing applied. Returns the first
    /// (on-policy) pass's figures, where the mismatch must be 0.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn update(
        &mut self,
        items: &[Item<Group>],
        version: u64,
        updates: u64,
        lr: f64,
        max_grad_norm: f64,
        optimizer: &mut PluginOptimizer,
        dist: &Dist,
    ) -> Result<StepOut, TrainError> {
        let step = version + 1;
        let mut first: Option<StepOut> = None;
        for update in 0..updates.max(1) {
            let out = self.step(items, version, max_grad_norm, dist)?;
            let checked = [
                ("loss", out.loss),
                ("auxiliary loss", out.aux_loss.unwrap_or(0.0)),
                ("gradient norm", out.grad_norm),
            ];
            for (what, value) in checked {
                if !value.is_finite() {
                    self.zero_grad();
                    return Err(TrainError::NonFinite { step, what, value });
                }
            }
            let optimizer_step = version * updates + update + 1;
            self.model
                .before_optimizer_step(&self.params, &out.stat_sums, optimizer_step)?;
            optimizer.step(&self.named, optimizer_step, lr)?;
            self.zero_grad();
            first.get_or_insert(out);
        }
        Ok(first.expect("at least one update runs"))
    }
}
