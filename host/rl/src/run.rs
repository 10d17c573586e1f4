//! The loop behind `anneal rl`: rollout workers fill the versioned buffer while the trainer
//! takes batches, scores them with its own forward, applies the loss and publishes the new
//! weights by version; checkpoints are saved and resumed like those of `anneal train`.

use crate::buffer::RolloutBuffer;
use crate::checkpoint::{restore, snapshot, Progress};
use crate::loss::{entropies, gather_logprobs, rl_loss, LossBatch, LossSettings};
use crate::rollout::{
    evaluate, worker, Group, Prompt, PromptSource, RewardFailure, RolloutCtx, Scorer,
};
use anneal_config::JobConfig;
use anneal_data::TextTokenizer;
use anneal_engine::invariant::set_batch_invariant;
use anneal_engine::{autograd, Tensor};
use anneal_runtime::infer::{token_logprob, Sampling};
use anneal_runtime::plugins::{find, ForwardOpts, Params, PluginModel, PluginOptimizer};
use anneal_train::checkpoint::{load_dir, Snapshot};
use anneal_train::checkpointing::{
    checkpointer, keep_tokenizer, resume, save, save_at_exit, save_due,
};
use anneal_train::{
    clip_grads, global_grad_norm, io_err, Console, LrSchedule, MetricsLog, TrainError,
};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One row of an RL run's `metrics.jsonl`.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RlRow {
    /// Trainer steps completed (0: the row before training, with the starting accuracy).
    pub step: u64,
    /// Mean combined reward of the step's samples.
    pub reward_mean: f64,
    /// Their standard deviation.
    pub reward_std: f64,
    /// Share of samples a reward module called correct (`None` when none reports it).
    pub accuracy: Option<f64>,
    /// Mean completion length in tokens.
    pub response_len_mean: f64,
    /// Mean per-token entropy of the trainer's distribution over completion tokens (nats).
    pub entropy: f64,
    /// Mean k3 KL to the reference (`None` without `rl.kl_coef`).
    pub kl_ref: Option<f64>,
    /// Max |rollout − trainer| logprob over samples of the current version (0 expected).
    pub logprob_mismatch_max: f64,
    /// Mean policy-version lag of the step's samples.
    pub staleness_mean: f64,
    /// Failed reward calls in this step's samples (timeouts included).
    pub reward_errors: u64,
    /// Of which timeouts.
    pub reward_timeouts: u64,
    /// Rollout seconds of this step's groups (summed over workers).
    pub t_rollout: f64,
    /// Reward seconds of this step's groups.
    pub t_reward: f64,
    /// Trainer seconds (forward, backward, update, publish).
    pub t_train: f64,
    /// Seconds the trainer waited for rollouts.
    pub t_wait: f64,
    /// The loss value.
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate.
    pub lr: f64,
    /// Groups dropped for equal rewards (`dapo`).
    pub dropped_groups: u64,
    /// Rollouts discarded for staleness.
    pub dropped_stale: u64,
    /// Samples trained on per second of wall time since the previous row.
    pub samples_per_s: f64,
    /// Greedy accuracy on the held-out prompts, on evaluation steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    /// Seconds since the start.
    pub time: f64,
}

/// Knobs for tests.
#[derive(Clone, Debug, Default)]
pub struct RlOptions {
    /// Adds this to every weight the rollout side receives (the trainer keeps the exact ones):
    /// a deliberate mismatch that `logprob_mismatch_max` must see.
    pub perturb_rollout_weights: f32,
}

/// How an RL run ended.
#[derive(Clone, Debug, PartialEq)]
pub struct RlSummary {
    /// Steps completed.
    pub steps: u64,
    /// The step this process resumed from (0 for a fresh start).
    pub resumed_from: u64,
    /// Whether a stop request ended the run early.
    pub stopped: bool,
    /// Held-out accuracy before training and after the last evaluation.
    pub eval_first: Option<f64>,
    /// See `eval_first`.
    pub eval_last: Option<f64>,
    /// The rows this process wrote.
    pub rows: Vec<RlRow>,
}

fn cfg_err(key: &str, msg: impl std::fmt::Display) -> TrainError {
    TrainError::Config(format!("config: `{key}`: {msg}"))
}

/// The starting parameters: a checkpoint step dir, a Hugging Face dir, or fresh ones.
fn initial_params(
    cfg: &JobConfig,
    model: &PluginModel,
    note: &dyn Fn(&str),
) -> Result<Vec<(String, Tensor)>, TrainError> {
    let from = &cfg.rl.init_from;
    let dir = Path::new(from);
    let mut named: Vec<(String, Tensor)> = if from.is_empty() {
        note("policy: fresh weights from training.seed");
        model.init_params(cfg.training.seed)?.into_iter().collect()
    } else if dir.join("manifest.json").exists() {
        note(&format!("policy: checkpoint {from}"));
        let loaded = load_dir(dir)?;
        let mut out = Vec::new();
        for p in &model.spec().params {
            let t = loaded
                .tensors
                .get(&format!("model/{}", p.name))
                .ok_or_else(|| {
                    cfg_err(
                        "rl.init_from",
                        format!("{from} has no parameter {}", p.name),
                    )
                })?;
            if t.shape() != p.shape.as_slice() {
                return Err(cfg_err(
                    "rl.init_from",
                    format!(
                        "{} is {:?} in {from}, the model wants {:?}",
                        p.name,
                        t.shape(),
                        p.shape
                    ),
                ));
            }
            out.push((p.name.clone(), t.detach()));
        }
        out
    } else if dir.join("config.json").exists() {
        note(&format!("policy: Hugging Face directory {from}"));
        anneal_runtime::hf::load_params(dir, model.spec())
            .map_err(|e| cfg_err("rl.init_from", e))?
            .into_iter()
            .collect()
    } else {
        return Err(cfg_err(
            "rl.init_from",
            format!("{from} is neither a checkpoint step dir (manifest.json) nor a Hugging Face dir (config.json)"),
        ));
    };
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(named)
}

fn tokenizer_path(cfg: &JobConfig) -> Result<PathBuf, TrainError> {
    let r = &cfg.rl;
    if !r.tokenizer.is_empty() {
        return Ok(PathBuf::from(&r.tokenizer));
    }
    let dir = Path::new(&r.init_from);
    // A checkpoint step dir sits in <run>/checkpoints/step-N, next to <run>/tokenizer.json.
    let candidates = [dir.join("tokenizer.json"), dir.join("../../tokenizer.json")];
    candidates.into_iter().find(|p| p.exists()).ok_or_else(|| {
        cfg_err(
            "rl.tokenizer",
            "not set, and no tokenizer.json next to rl.init_from",
        )
    })
}

fn load_prompts(cfg: &JobConfig) -> Result<PromptSource, TrainError> {
    let r = &cfg.rl;
    if r.prompts_path.is_empty() {
        return Ok(PromptSource::DigitsSort { seed: r.task_seed });
    }
    let path = Path::new(&r.prompts_path);
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    let mut list = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let p: Prompt = serde_json::from_str(line).map_err(|e| {
            cfg_err(
                "rl.prompts_path",
                format!(
                    "{} line {}: expected {{\"prompt\":..,\"metadata\":{{..}}}} ({e})",
                    path.display(),
                    i + 1
                ),
            )
        })?;
        list.push(p);
    }
    if list.is_empty() {
        return Err(cfg_err(
            "rl.prompts_path",
            format!("{} has no prompts", path.display()),
        ));
    }
    Ok(PromptSource::List(Arc::new(list)))
}

/// Detached copies of the parameters: what the rollout side gets for one version (the
/// trainer's own tensors change in place at the next step).
fn publishable(named: &[(String, Tensor)], perturb: f32) -> Result<Params, TrainError> {
    let _g = autograd::no_grad();
    let mut out = std::collections::HashMap::new();
    for (n, p) in named {
        let copy = if perturb != 0.0 {
            p.detach().add_scalar(perturb)?
        } else {
            p.detach().mul_scalar(1.0)?
        };
        out.insert(n.clone(), copy);
    }
    Ok(Arc::new(out))
}

/// Trains `cfg` with RL in `run_dir`, scoring with `scorer`, until `training.steps` or until
/// `stop` is set (which ends the run after the current step, with a checkpoint). A run dir with
/// checkpoints resumes from the newest usable one; in synchronous mode (`rl.max_staleness = 0`,
/// one rollout thread) the resumed run's metrics equal an uninterrupted run's bit for bit.
/// Writes `config.toml`, `tokenizer.json`, `metrics.jsonl` and `checkpoints/` there.
pub fn run_rl(
    cfg: &JobConfig,
    run_dir: &Path,
    scorer: Arc<dyn Scorer>,
    stop: &AtomicBool,
    opts: &RlOptions,
) -> Result<RlSummary, TrainError> {
    let started = Instant::now();
    let r = &cfg.rl;
    std::fs::create_dir_all(run_dir).map_err(io_err(run_dir))?;
    let config_path = run_dir.join("config.toml");
    std::fs::write(&config_path, cfg.to_toml()).map_err(io_err(&config_path))?;
    let total = cfg.training.steps;
    let console = Console::new(total, 0, cfg.metrics.progress_bar);
    console.note(&format!("run dir: {}", run_dir.display()));

    let tok_path = tokenizer_path(cfg)?;
    let tokenizer = Arc::new(TextTokenizer::from_file(&tok_path)?);
    keep_tokenizer(&tok_path, run_dir)?;
    let prompts = load_prompts(cfg)?;
    let model_plugin = find(&cfg.model.plugin)?;
    let args = serde_json::Value::Object(cfg.model.args.clone());
    let model = Arc::new(PluginModel::new(
        model_plugin.name(),
        model_plugin.create(Some(&cfg.model.flavor), &args)?,
    )?);
    if tokenizer.vocab_size() > model.spec().vocab_size {
        return Err(cfg_err(
            "model.args.vocab_size",
            format!(
                "the model has {} embeddings but {} has {} tokens",
                model.spec().vocab_size,
                tok_path.display(),
                tokenizer.vocab_size()
            ),
        ));
    }
    let opt_plugin = find(&cfg.optimizer.plugin)?;
    let opt_args = serde_json::Value::Object(cfg.optimizer.args.clone());
    let mut optimizer =
        PluginOptimizer::new(opt_plugin.name(), opt_plugin.create(None, &opt_args)?)?;
    let mut restored = None;
    let resumed = resume(cfg, run_dir, &console, |l| {
        restored = Some(restore(cfg, &model, &mut optimizer, l)?);
        Ok(())
    })?;
    let (named, reference, mut progress) = match restored {
        Some(r) => (r.named, r.reference, r.progress),
        None => {
            let named: Vec<(String, Tensor)> = initial_params(cfg, &model, &|m| console.note(m))?
                .into_iter()
                .map(|(n, p)| (n, p.requires_grad_()))
                .collect();
            let reference: Option<Params> = (r.kl_coef > 0.0)
                .then(|| publishable(&named, 0.0))
                .transpose()?;
            (named, reference, Progress::default())
        }
    };
    // Metric times continue across restarts of the same run.
    let clock = || resumed.elapsed_s + started.elapsed().as_secs_f64();
    let params: Params = Arc::new(named.iter().cloned().collect());
    let schedule = LrSchedule::new(cfg.optimizer.lr, total, &cfg.lr_scheduler);

    let held_out = (r.eval_freq > 0).then(|| prompts.held_out(r.eval_prompts));
    let ctx = Arc::new(RolloutCtx {
        model: model.clone(),
        tokenizer: tokenizer.clone(),
        prompts,
        scorer: scorer.clone(),
        prepend_eos: r.prepend_eos,
        group_size: r.group_size,
        max_new_tokens: r.max_new_tokens,
        sampling: Sampling {
            temperature: r.temperature,
            top_k: r.top_k,
            top_p: r.top_p,
            seed: cfg.training.seed,
            eos: None,
        },
        next_prompt: AtomicU64::new(progress.rl.next_prompt),
        failed: Mutex::new(None),
    });
    let capacity = r.prompts_per_step * (r.max_staleness as usize + 1);
    let weights = publishable(&named, opts.perturb_rollout_weights)?;
    let buffer = Arc::new(RolloutBuffer::<Group, Params>::new(
        weights.clone(),
        r.max_staleness,
        capacity,
    ));
    if resumed.step > 0 {
        // A resumed policy is version `step`: the first take is at that version.
        buffer.publish(resumed.step, weights);
    }
    console.note(&format!(
        "rl: {} steps of {} prompts x {} samples, loss {:?}, max_staleness {}, {} rollout thread(s)",
        total, r.prompts_per_step, r.group_size, r.loss, r.max_staleness, r.rollout_threads
    ));

    let mut checkpointer = checkpointer(cfg, run_dir);
    let mut log = MetricsLog::open(run_dir).map_err(io_err(run_dir))?;
    let mut sample_log = crate::samples::SampleLog::open(run_dir, r, ctx.prompts.clone())?;
    let mut summary = RlSummary {
        steps: resumed.step,
        resumed_from: resumed.step,
        stopped: false,
        eval_first: None,
        eval_last: None,
        rows: Vec::new(),
    };
    let eval = |params: &Params| -> Result<Option<f64>, TrainError> {
        match &held_out {
            Some(p) => Ok(Some(evaluate(
                &model,
                params,
                &tokenizer,
                scorer.as_ref(),
                p,
                r.prepend_eos,
                r.max_new_tokens,
            )?)),
            None => Ok(None),
        }
    };
    let first_eval = if resumed.step == 0 {
        eval(&params)?
    } else {
        None
    };
    if let Some(acc) = first_eval {
        let row = RlRow {
            eval_accuracy: Some(acc),
            time: clock(),
            ..Default::default()
        };
        console.note(&format!("step      0  eval_accuracy {acc:.3}"));
        log.write(&row).map_err(io_err(log.path()))?;
        summary.eval_first = Some(acc);
        summary.eval_last = Some(acc);
        summary.rows.push(row);
    }

    // Each worker batches its share of a step's prompts into one decode.
    let max_groups = r.prompts_per_step.div_ceil(r.rollout_threads);
    // With `rollout_compute_threads`, each worker computes on a private pool of that many
    // threads instead of sharing the trainer's, so rollouts and training overlap on separate
    // cores rather than taking turns on all of them.
    let pools = (0..r.rollout_threads)
        .map(|_| {
            (r.rollout_compute_threads > 0)
                .then(|| {
                    rayon::ThreadPoolBuilder::new()
                        .num_threads(r.rollout_compute_threads)
                        .build()
                })
                .transpose()
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| cfg_err("rl.rollout_compute_threads", e))?;
    let workers: Vec<_> = pools
        .into_iter()
        .map(|pool| {
            let (ctx, buffer) = (ctx.clone(), buffer.clone());
            std::thread::spawn(move || match pool {
                Some(pool) => pool.install(|| worker(ctx, buffer, max_groups)),
                None => worker(ctx, buffer, max_groups),
            })
        })
        .collect();
    let settings = LossSettings {
        kind: r.loss,
        clip_low: r.clip_low,
        clip_high: r.clip_high,
        kl_coef: r.kl_coef,
        is_cap: r.is_correction_cap,
        norm_len: r.max_new_tokens,
        entropy_coef: r.entropy_coef,
    };
    let mut trainer = RlTrainer {
        model: &model,
        params,
        named,
        reference,
        settings,
        group_size: r.group_size,
    };
    let mut last_row_time = Instant::now();
    let result = (|| -> Result<(), TrainError> {
        for version in resumed.step..total {
            if stop.load(Ordering::SeqCst) {
                console.note(&format!("stop requested: ending after step {version}"));
                summary.stopped = true;
                break;
            }
            let waited = Instant::now();
            let Some(taken) = buffer.take(r.prompts_per_step, version) else {
                let msg = ctx
                    .failed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone()
                    .unwrap_or_else(|| "the rollout workers stopped".into());
                return Err(TrainError::Config(msg));
            };
            let t_wait = waited.elapsed().as_secs_f64();
            let step = version + 1;
            let lr = schedule.lr(step);
            let train_started = Instant::now();
            // `updates_per_batch` optimizer steps on the same rollouts (GRPO's μ); the row
            // reports the first, on-policy pass (where the mismatch must be 0).
            let mut first: Option<StepOut> = None;
            for update in 0..r.updates_per_batch as u64 {
                let out = trainer.step(&taken.items, version, cfg.training.max_grad_norm)?;
                for (what, value) in [("loss", out.loss), ("gradient norm", out.grad_norm)] {
                    if !value.is_finite() {
                        trainer.zero_grad();
                        return Err(TrainError::NonFinite { step, what, value });
                    }
                }
                let optimizer_step = version * r.updates_per_batch as u64 + update + 1;
                optimizer.step(&trainer.named, optimizer_step, lr)?;
                trainer.zero_grad();
                first.get_or_insert(out);
            }
            let out = first.expect("updates_per_batch is at least 1");
            buffer.publish(
                step,
                publishable(&trainer.named, opts.perturb_rollout_weights)?,
            );
            let t_train = train_started.elapsed().as_secs_f64();

            let groups: Vec<&Group> = taken.items.iter().map(|it| &it.value).collect();
            progress.record(step, lr, &groups);
            let samples: Vec<_> = groups.iter().flat_map(|g| g.samples.iter()).collect();
            let n = samples.len() as f64;
            let rewards: Vec<f64> = samples.iter().map(|s| s.scored.reward).collect();
            let mean = rewards.iter().sum::<f64>() / n;
            let std = (rewards.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
            let judged: Vec<bool> = samples.iter().filter_map(|s| s.scored.correct).collect();
            let failures = samples.iter().flat_map(|s| s.scored.failures.iter());
            let (mut errors, mut timeouts) = (0, 0);
            for f in failures {
                errors += 1;
                if *f == RewardFailure::Timeout {
                    timeouts += 1;
                }
            }
            let mut row = RlRow {
                step,
                reward_mean: mean,
                reward_std: std,
                accuracy: (!judged.is_empty())
                    .then(|| judged.iter().filter(|&&c| c).count() as f64 / judged.len() as f64),
                response_len_mean: samples.iter().map(|s| s.logprobs.len() as f64).sum::<f64>() / n,
                entropy: out.entropy,
                kl_ref: trainer.reference.as_ref().map(|_| out.kl),
                logprob_mismatch_max: out.mismatch_max,
                staleness_mean: taken
                    .items
                    .iter()
                    .map(|it| (version - it.version) as f64)
                    .sum::<f64>()
                    / taken.items.len() as f64,
                reward_errors: errors,
                reward_timeouts: timeouts,
                t_rollout: taken.items.iter().map(|it| it.value.t_rollout).sum(),
                t_reward: taken.items.iter().map(|it| it.value.t_reward).sum(),
                t_train,
                t_wait,
                loss: out.loss,
                grad_norm: out.grad_norm,
                lr,
                dropped_groups: out.dropped_groups as u64,
                dropped_stale: taken.dropped as u64,
                samples_per_s: n / last_row_time.elapsed().as_secs_f64().max(1e-9),
                eval_accuracy: None,
                time: 0.0,
            };
            last_row_time = Instant::now();
            if r.eval_freq > 0 && (step % r.eval_freq == 0 || step == total) {
                row.eval_accuracy = eval(&trainer.params)?;
                summary.eval_last = row.eval_accuracy;
            }
            row.time = clock();
            log.write(&row).map_err(io_err(log.path()))?;
            sample_log.write(step, &taken.items)?;
            if step % cfg.metrics.log_freq == 0 || step == total || row.eval_accuracy.is_some() {
                console.note(&format_row(&row));
            }
            summary.steps = step;
            summary.rows.push(row);
            if save_due(cfg, step, total) {
                let elapsed = clock();
                save(&mut checkpointer, step, &console, |spare| {
                    trainer.snapshot(cfg, &progress, &optimizer, elapsed, spare)
                })?;
            }
        }
        Ok(())
    })();
    buffer.close();
    for w in workers {
        let _ = w.join();
    }
    result?;
    let elapsed = clock();
    save_at_exit(
        &mut checkpointer,
        summary.stopped,
        progress.step,
        resumed.step,
        &console,
        |spare| trainer.snapshot(cfg, &progress, &optimizer, elapsed, spare),
    )?;
    console.note(&format!(
        "{} after step {} ({:.1}s)",
        if summary.stopped { "stopped" } else { "done" },
        summary.steps,
        started.elapsed().as_secs_f64()
    ));
    Ok(summary)
}

fn format_row(r: &RlRow) -> String {
    let mut s = format!(
        "step {:>6}  reward {:.3}±{:.3}  len {:.1}  entropy {:.3}  mismatch {:e}  stale {:.2}  loss {:.4}",
        r.step, r.reward_mean, r.reward_std, r.response_len_mean, r.entropy, r.logprob_mismatch_max, r.staleness_mean, r.loss
    );
    if let Some(a) = r.accuracy {
        s.push_str(&format!("  acc {a:.3}"));
    }
    if let Some(a) = r.eval_accuracy {
        s.push_str(&format!("  eval_accuracy {a:.3}"));
    }
    if r.reward_errors > 0 {
        s.push_str(&format!(
            "  reward_errors {} (timeouts {})",
            r.reward_errors, r.reward_timeouts
        ));
    }
    s
}

/// What one trainer step measured.
struct StepOut {
    loss: f64,
    grad_norm: f64,
    entropy: f64,
    kl: f64,
    mismatch_max: f64,
    dropped_groups: usize,
}

/// The trainer side: the policy's parameters (leaves with grad) and the frozen reference.
struct RlTrainer<'a> {
    model: &'a PluginModel,
    params: Params,
    named: Vec<(String, Tensor)>,
    reference: Option<Params>,
    settings: LossSettings,
    group_size: usize,
}

/// The padded batch layout shared by the trainer forward and the loss: row `i` holds sample
/// `i`'s tokens but the last as inputs; position `t` predicts token `t + 1`.
struct Layout {
    n: usize,
    t: usize,
    inputs: Vec<i64>,
    targets: Vec<i64>,
    mask: Vec<f32>,
    rollout: Vec<f32>,
    current: Vec<bool>,
}

fn layout(items: &[crate::buffer::Item<Group>], version: u64) -> Layout {
    let samples: Vec<(u64, &crate::rollout::Sample)> = items
        .iter()
        .flat_map(|it| it.value.samples.iter().map(move |s| (it.version, s)))
        .collect();
    let n = samples.len();
    let t = samples
        .iter()
        .map(|(_, s)| s.tokens.len() - 1)
        .max()
        .unwrap_or(1)
        .max(1);
    let mut l = Layout {
        n,
        t,
        inputs: vec![0; n * t],
        targets: vec![0; n * t],
        mask: vec![0.0; n * t],
        rollout: vec![0.0; n * t],
        current: Vec::with_capacity(n),
    };
    for (i, (v, s)) in samples.iter().enumerate() {
        let len = s.tokens.len() - 1;
        l.inputs[i * t..i * t + len].copy_from_slice(&s.tokens[..len]);
        l.targets[i * t..i * t + len].copy_from_slice(&s.tokens[1..]);
        for (j, &lp) in s.logprobs.iter().enumerate() {
            let k = i * t + s.prompt_len - 1 + j;
            l.mask[k] = 1.0;
            l.rollout[k] = lp;
        }
        l.current.push(*v == version);
    }
    l
}

impl RlTrainer<'_> {
    /// A checkpoint of the policy, `optimizer`'s state and the KL reference after `progress`.
    fn snapshot(
        &self,
        cfg: &JobConfig,
        progress: &Progress,
        optimizer: &PluginOptimizer,
        elapsed_s: f64,
        spare: Vec<Vec<u8>>,
    ) -> Snapshot {
        let reference = self.reference.as_ref();
        snapshot(
            cfg,
            progress,
            elapsed_s,
            &self.named,
            optimizer,
            reference,
            spare,
        )
    }

    fn zero_grad(&self) {
        for (_, p) in &self.named {
            p.zero_grad();
        }
    }

    /// Forward (batch-invariant, like the rollouts), metrics from the logits, loss, backward
    /// and clipping. The caller applies the optimizer.
    fn step(
        &mut self,
        items: &[crate::buffer::Item<Group>],
        version: u64,
        max_grad_norm: f64,
    ) -> Result<StepOut, TrainError> {
        let _inv = set_batch_invariant(true);
        let l = layout(items, version);
        let rewards: Vec<f64> = items
            .iter()
            .flat_map(|it| it.value.samples.iter().map(|s| s.scored.reward))
            .collect();
        let ids = Tensor::from_slice(&l.inputs, &[l.n, l.t])?;
        let positions = Tensor::from_vec((0..l.t as i64).collect(), &[l.t])?;
        let fwd = ForwardOpts {
            training: true,
            ..Default::default()
        };
        let logits = self.model.forward(&self.params, &ids, &positions, &fwd)?;
        let v = logits.shape()[2];
        // Trainer logprobs through the same function as the rollout's, and the entropy.
        let rows = logits.to_vec_f32();
        let (mut mismatch, mut ent_sum, mut tokens) = (0f64, 0f64, 0usize);
        for k in 0..l.n * l.t {
            if l.mask[k] == 0.0 {
                continue;
            }
            let row = &rows[k * v..(k + 1) * v];
            if l.current[k / l.t] {
                let lp = token_logprob(row, l.targets[k] as usize);
                mismatch = mismatch.max((lp - l.rollout[k]).abs() as f64);
            }
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
            let h: f64 = row
                .iter()
                .map(|&x| {
                    let lp = x as f64 - m - z.ln();
                    -lp.exp() * lp
                })
                .sum();
            ent_sum += h;
            tokens += 1;
        }
        drop(rows);
        let ref_logp = match &self.reference {
            Some(refp) => {
                let _g = autograd::no_grad();
                let rl = self
                    .model
                    .forward(refp, &ids, &positions, &ForwardOpts::default())?;
                let rr = rl.to_vec_f32();
                Some(
                    (0..l.n * l.t)
                        .map(|k| {
                            if l.mask[k] == 0.0 {
                                0.0
                            } else {
                                token_logprob(&rr[k * v..(k + 1) * v], l.targets[k] as usize)
                            }
                        })
                        .collect::<Vec<f32>>(),
                )
            }
            None => None,
        };
        let log_probs = logits.log_softmax(-1)?;
        let logp = gather_logprobs(&log_probs, &l.targets)?;
        let entropy_nl = (self.settings.entropy_coef > 0.0)
            .then(|| entropies(&log_probs))
            .transpose()?;
        let out = rl_loss(
            &LossBatch {
                logp_nl: &logp,
                rollout_logp: &l.rollout,
                ref_logp: ref_logp.as_deref(),
                entropy_nl: entropy_nl.as_ref(),
                mask: &l.mask,
                rewards: &rewards,
                group_size: self.group_size,
            },
            &self.settings,
        )?;
        let loss = out.loss.item()? as f64;
        out.loss.backward()?;
        let grad_norm = global_grad_norm(&self.named);
        clip_grads(&self.named, max_grad_norm, grad_norm)?;
        Ok(StepOut {
            loss,
            grad_norm,
            entropy: ent_sum / tokens.max(1) as f64,
            kl: out.kl_mean,
            mismatch_max: mismatch,
            dropped_groups: out.dropped_groups,
        })
    }
}
