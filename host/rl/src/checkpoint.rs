//! What an RL checkpoint holds and how a run continues from one. The tensors are named like the
//! trainer's — the policy as `model/<name>`, the optimizer state as `optim/<param>.<state>` — so
//! `anneal checkpoint export`, `anneal generate` and a later `rl.init_from` read them as they
//! read any checkpoint; the frozen KL reference is `ref/<name>`; the counters are the
//! [`RlState`] of `train_state.json`.

use anneal_config::JobConfig;
use anneal_data::LoaderState;
use anneal_engine::Tensor;
use anneal_runtime::plugins::{Params, PluginModel, PluginOptimizer};
use anneal_train::checkpoint::{Loaded, RlState, Snapshot, TrainState};
use anneal_train::harness::{params_from_checkpoint, restore_optimizer, split_buffers, Provenance};
use anneal_train::{TpInference, TrainError};
use std::collections::HashMap;
use std::sync::Arc;

/// Where an RL run stands after a step, besides its tensors.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Progress {
    /// Trainer steps completed.
    pub step: u64,
    /// Learning rate of the last step.
    pub lr: f64,
    /// Completion tokens trained on.
    pub tokens: u64,
    /// Where the rollouts continue, and samples trained on.
    pub rl: RlState,
}

impl Progress {
    /// Counts a step's groups in: the prompt cursor moves past the highest prompt index trained
    /// on (prompts in flight below it are skipped on resume, none is trained on twice).
    pub fn record(&mut self, step: u64, lr: f64, groups: &[&crate::rollout::Group]) {
        self.step = step;
        self.lr = lr;
        for g in groups {
            self.rl.next_prompt = self.rl.next_prompt.max(g.index + 1);
            self.rl.samples += g.samples.len() as u64;
            self.tokens += g
                .samples
                .iter()
                .map(|s| s.policy_tokens() as u64)
                .sum::<u64>();
        }
    }
}

/// A host-memory copy of everything an exact resume needs: the policy `named`, the optimizer
/// state `optim_state`, the KL `reference` (when the run keeps one) and `progress`. `spare` buffers from the
/// previous snapshot are reused.
#[allow(clippy::too_many_arguments)]
pub(crate) fn snapshot(
    cfg: &JobConfig,
    progress: &Progress,
    provenance: &Provenance,
    elapsed_s: f64,
    named: &[(String, Tensor)],
    optim_state: &std::collections::BTreeMap<String, Tensor>,
    reference: Option<&Params>,
    spare: Vec<Vec<u8>>,
) -> Snapshot {
    let state = train_state(cfg, progress, provenance, elapsed_s);
    let params = named.iter().map(|(n, p)| (format!("model/{n}"), p));
    let optim = optim_state.iter().map(|(n, t)| (format!("optim/{n}"), t));
    // In the policy's (sorted) order, so the same run writes the same file.
    let frozen = reference.into_iter().flat_map(|r| {
        named
            .iter()
            .filter_map(|(n, _)| r.get(n).map(|t| (format!("ref/{n}"), t)))
    });
    Snapshot::capture(state, params.chain(optim).chain(frozen), spare)
}

/// The counters of an RL checkpoint after `progress` (`train_state.json`).
pub(crate) fn train_state(
    cfg: &JobConfig,
    progress: &Progress,
    provenance: &Provenance,
    elapsed_s: f64,
) -> TrainState {
    let mut state = TrainState {
        step: progress.step,
        seed: cfg.training.seed,
        loader: LoaderState {
            epoch: 0,
            cursor: 0,
            mixture: None,
            stream: None,
        },
        lr: progress.lr,
        tokens: progress.tokens,
        elapsed_s,
        model: format!("{}/{}", cfg.model.plugin, cfg.model.flavor),
        optimizer: cfg.optimizer.plugin.clone(),
        config: cfg.to_toml(),
        tokenizer_sha256: None,
        data_sha256: None,
        rl: Some(progress.rl.clone()),
    };
    provenance.stamp(&mut state);
    state
}

/// What a run continues with after [`restore`].
pub(crate) struct Restored {
    /// The policy, sorted by name, as leaves that take gradients.
    pub named: Vec<(String, Tensor)>,
    /// The model's buffers (not trained), sorted by name.
    pub buffers: Vec<(String, Tensor)>,
    /// The frozen KL reference, when `rl.kl_coef > 0`.
    pub reference: Option<Params>,
    /// The counters.
    pub progress: Progress,
}

/// Continues from an RL checkpoint that [`anneal_train::harness::resume`] accepted: the policy
/// (checked against `model`'s parameters), the optimizer state (into `optimizer`), the KL
/// reference when `rl.kl_coef > 0`, and the counters. A checkpoint without the reference the
/// config needs is a mismatch.
pub(crate) fn restore(
    cfg: &JobConfig,
    model: &PluginModel,
    optimizer: &mut PluginOptimizer,
    tp: Option<&TpInference>,
    ckpt: Loaded,
) -> Result<Restored, TrainError> {
    let rl = ckpt.state.rl.clone().unwrap_or_default();
    // Under tensor parallelism this rank's slices, read one tensor at a time.
    let params = |prefix: &str| match tp {
        Some(tp) => tp.params_from_checkpoint(&ckpt, model, prefix),
        None => params_from_checkpoint(&ckpt, model, prefix),
    };
    let (named, buffers) = split_buffers(model, params("model")?);
    let reference = if cfg.rl.kl_coef > 0.0 {
        if !ckpt.names().any(|k| k.starts_with("ref/")) {
            return Err(TrainError::Checkpoint(
                anneal_train::checkpoint::CheckpointError::Mismatch(format!(
                    "{}: no KL reference (ref/*): it was saved with rl.kl_coef = 0, the config \
                     has rl.kl_coef > 0",
                    ckpt.dir.display()
                )),
            ));
        }
        let frozen: HashMap<String, Tensor> = params("ref")?.into_iter().collect();
        Some(Arc::new(frozen))
    } else {
        None
    };
    match tp {
        Some(tp) => tp.restore_optimizer(&ckpt, &named, optimizer)?,
        None => restore_optimizer(&ckpt, &named, optimizer)?,
    }
    Ok(Restored {
        named,
        buffers,
        reference,
        progress: Progress {
            step: ckpt.state.step,
            lr: ckpt.state.lr,
            tokens: ckpt.state.tokens,
            rl,
        },
    })
}
