//! Rollouts: prompts, the reward interface, and the worker loop that samples groups of
//! completions with the trainer's own model plugin and scores them.
//!
//! A worker takes several prompts at once and decodes all their completions together, one batch
//! row each (prefill + KV-cache decode via [`anneal_runtime::infer::generate_batch`], prompts bucketed by
//! token length); several workers run side by side on threads.

use crate::buffer::RolloutBuffer;
use anneal_data::TextTokenizer;
use anneal_runtime::infer::{generate_batch_tp, Sampling};
use anneal_runtime::plugins::{Params, PluginModel, TensorParallelism};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One prompt and the metadata its rewards see (e.g. the reference answer).
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
pub struct Prompt {
    /// The text given to the model.
    pub prompt: String,
    /// Passed to reward modules as JSON.
    #[serde(default)]
    pub metadata: Value,
}

/// Where prompts come from: a list (cycled) or a seeded generator.
#[derive(Clone, Debug)]
pub enum PromptSource {
    /// Prompts from a JSON lines file, cycled in order.
    List(Arc<Vec<Prompt>>),
    /// `digits_sort`: sort 3–5 random digits; prompt `"4213="`, answer `"1234"`.
    DigitsSort {
        /// Seed of the generator.
        seed: u64,
    },
    /// `arithmetic`: a 3-digit number times a 2-digit one; prompt `"347*86="`, answer
    /// `"29842"` (the metadata also holds the prompt as `question`, as environments read it).
    Arithmetic {
        /// Seed of the generator.
        seed: u64,
    },
}

/// The `i`-th multiplication task of `seed`: `(prompt, answer)`, e.g. `("347*86=", "29842")`.
pub fn arithmetic_task(seed: u64, i: u64) -> (String, String) {
    let s = splitmix(seed ^ splitmix(i ^ 0x6172_6974_686d));
    let a = 100 + s % 900;
    let b = 10 + splitmix(s) % 90;
    (format!("{a}*{b}="), (a * b).to_string())
}

pub(crate) fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `i`-th digit-sorting task of `seed`: `(prompt, answer)`.
pub fn digits_sort_task(seed: u64, i: u64) -> (String, String) {
    let mut s = splitmix(seed ^ splitmix(i));
    let n = 3 + (s % 3) as usize;
    let digits: Vec<u8> = (0..n)
        .map(|_| {
            s = splitmix(s);
            b'0' + (s % 10) as u8
        })
        .collect();
    let mut sorted = digits.clone();
    sorted.sort_unstable();
    (
        format!("{}=", String::from_utf8_lossy(&digits)),
        String::from_utf8_lossy(&sorted).into_owned(),
    )
}

impl PromptSource {
    /// The `i`-th prompt.
    pub fn get(&self, i: u64) -> Prompt {
        match self {
            PromptSource::List(list) => list[(i % list.len() as u64) as usize].clone(),
            PromptSource::DigitsSort { seed } => {
                let (prompt, answer) = digits_sort_task(*seed, i);
                Prompt {
                    prompt,
                    metadata: serde_json::json!({ "answer": answer }),
                }
            }
            PromptSource::Arithmetic { seed } => {
                let (prompt, answer) = arithmetic_task(*seed, i);
                Prompt {
                    metadata: serde_json::json!({ "question": prompt, "answer": answer }),
                    prompt,
                }
            }
        }
    }

    /// Held-out prompts: a disjoint seed stream for the generator, the list's last prompts
    /// otherwise (the caller should keep those out of training).
    pub fn held_out(&self, n: usize) -> Vec<Prompt> {
        match self {
            PromptSource::List(list) => list.iter().rev().take(n).cloned().collect(),
            PromptSource::DigitsSort { seed } => {
                let held = PromptSource::DigitsSort {
                    seed: splitmix(*seed ^ 0x0048_454c_444f_5554),
                };
                (0..n as u64).map(|i| held.get(i)).collect()
            }
            PromptSource::Arithmetic { seed } => {
                let held = PromptSource::Arithmetic {
                    seed: splitmix(*seed ^ 0x0048_454c_444f_5554),
                };
                (0..n as u64).map(|i| held.get(i)).collect()
            }
        }
    }
}

/// Why a reward call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RewardFailure {
    /// It ran past its deadline.
    Timeout,
    /// It trapped, ran out of fuel or memory, or returned something unusable.
    Error,
}

/// The combined reward of one completion.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Scored {
    /// The weighted sum of the modules' rewards (a failed call contributes its error reward).
    pub reward: f64,
    /// Whether the completion is correct, when a module reported a `correct` detail.
    pub correct: Option<bool>,
    /// Failed calls among the modules.
    pub failures: Vec<RewardFailure>,
    /// What each reward module made of it, in the configured order (empty when the scorer
    /// does not break its reward down); written to `samples.jsonl`.
    pub modules: Vec<ModuleScore>,
}

/// One reward module's part of a [`Scored`] completion, as `samples.jsonl` records it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModuleScore {
    /// The module's name (its file name, or the name given in `rl.rewards`).
    pub name: String,
    /// Its weight in the sum.
    pub weight: f64,
    /// Its score, or `None` when the call failed.
    pub score: Option<f64>,
    /// What entered the sum before the weight: the score, or `rl.error_reward`.
    pub reward: f64,
    /// Its `correct` detail, when it reported one.
    pub correct: Option<bool>,
    /// The kind of the failure (`trap`, `timeout`, ...), when the call failed.
    pub error: Option<String>,
    /// The failure's message.
    pub message: Option<String>,
}

/// Scores completions; the CLI implements it with the WebAssembly sandbox.
pub trait Scorer: Send + Sync {
    /// The reward of `completion` for `prompt`.
    fn score(&self, prompt: &Prompt, completion: &str) -> Scored;
}

/// The scorer of a run without reward modules (an environment's rewards are then the
/// episodes'): every completion scores 0.
pub struct NoRewards;

impl Scorer for NoRewards {
    fn score(&self, _: &Prompt, _: &str) -> Scored {
        Scored::default()
    }
}

/// One sampled completion (serialized when data-parallel ranks gather a step's groups).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// Prompt then completion token ids.
    pub tokens: Vec<i64>,
    /// Where the completion starts in `tokens`.
    pub prompt_len: usize,
    /// Rollout log-probability of each token after the prompt (0 for an environment's).
    pub logprobs: Vec<f32>,
    /// Which tokens after the prompt the policy sampled (the loss trains those only); empty
    /// when it sampled all of them (single-turn).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policy: Vec<bool>,
    /// The decoded completion (without the end-of-sequence token).
    pub text: String,
    /// Its reward.
    pub scored: Scored,
    /// A multi-turn episode's turns (empty for a single completion).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turns: Vec<crate::episode::Turn>,
}

impl Sample {
    /// Whether token `j` after the prompt is the policy's.
    pub fn is_policy(&self, j: usize) -> bool {
        self.policy.get(j).copied().unwrap_or(true)
    }

    /// How many tokens the policy sampled.
    pub fn policy_tokens(&self) -> usize {
        match self.policy.is_empty() {
            true => self.logprobs.len(),
            false => self.policy.iter().filter(|&&p| p).count(),
        }
    }
}

/// The completions of one prompt.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Group {
    /// The index of the prompt (in the run's [`PromptSource`]).
    pub index: u64,
    /// `group_size` samples.
    pub samples: Vec<Sample>,
    /// Seconds spent generating.
    pub t_rollout: f64,
    /// Seconds spent scoring.
    pub t_reward: f64,
}

/// What the workers need besides the buffer.
pub struct RolloutCtx {
    /// The model plugin (shared with the trainer).
    pub model: Arc<PluginModel>,
    /// Text ↔ ids.
    pub tokenizer: Arc<TextTokenizer>,
    /// Prompts.
    pub prompts: PromptSource,
    /// Rewards.
    pub scorer: Arc<dyn Scorer>,
    /// Put the end-of-text token before each prompt.
    pub prepend_eos: bool,
    /// Completions per prompt.
    pub group_size: usize,
    /// Longest completion.
    pub max_new_tokens: usize,
    /// Sampling settings (the seed is the run's; each sample derives its own).
    pub sampling: Sampling,
    /// This rank's next prompt, counted in its own share (see [`Share`]).
    pub next_prompt: AtomicU64,
    /// Which prompts this rank rolls out.
    pub share: Share,
    /// The first error a worker hit (the run stops on it).
    pub failed: Mutex<Option<String>>,
    /// Under tensor parallelism, the group the decode runs over (the weights handed to the
    /// rollouts are then this rank's slices, and every rank of the group decodes the same
    /// prompts in lockstep, on the thread where the group's communicator is installed).
    pub tp: Option<TensorParallelism>,
    /// Multi-turn episodes with an environment instead of single completions.
    pub env: Option<crate::episode::EnvCtx>,
}

/// Which prompts a data-parallel rank rolls out: of each step's `per_step` prompts, the
/// `per_step / ranks` consecutive ones from `rank · per_step / ranks`. Every rank's groups are
/// whole (advantages stay per group) and the prompts of a step are the same whatever the number
/// of ranks. One rank (`ranks = 1`) takes every prompt in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    /// This rank.
    pub rank: u64,
    /// Data-parallel ranks; divides `per_step`.
    pub ranks: u64,
    /// Prompts per step, over all ranks.
    pub per_step: u64,
}

impl Share {
    /// Prompts per step of this rank.
    fn local(&self) -> u64 {
        (self.per_step / self.ranks).max(1)
    }

    /// The global index of this rank's `c`-th prompt.
    pub fn global(&self, c: u64) -> u64 {
        let k = self.local();
        (c / k) * self.per_step + self.rank * k + c % k
    }

    /// This rank's count of prompts taken when the run's prompts up to `cursor` (a step
    /// boundary) are taken.
    pub fn local_of(&self, cursor: u64) -> u64 {
        let k = self.local();
        (cursor / self.per_step) * k + (cursor % self.per_step).min(k)
    }
}

/// The end of a completion: up to and excluding the first end-of-sequence token.
fn completion_text(tok: &TextTokenizer, ids: &[i64]) -> String {
    let eos = tok.eos_id() as i64;
    let ids: Vec<u32> = ids
        .iter()
        .take_while(|&&t| t != eos)
        .map(|&t| t as u32)
        .collect();
    tok.decode(&ids).unwrap_or_default()
}

/// The token ids of a prompt, after the end-of-text token when `prepend_eos`.
pub fn encode_prompt(
    tok: &TextTokenizer,
    text: &str,
    prepend_eos: bool,
) -> Result<Vec<i64>, anneal_engine::Error> {
    let ids = tok
        .encode(text)
        .map_err(|e| anneal_engine::Error::Invalid {
            op: "rollout",
            msg: format!("cannot tokenize a prompt: {e}"),
        })?;
    let eos = prepend_eos.then(|| tok.eos_id());
    Ok(eos.into_iter().chain(ids).map(i64::from).collect())
}

/// Generates and scores the groups of prompts `indices` with `params`, `group_size`
/// completions each. Prompts of the same token length are decoded together in one batch (a
/// row per completion); each completion draws from its own stream, keyed by its prompt index
/// and place in the group, so the result does not depend on how groups are batched.
pub fn rollout_groups(
    ctx: &RolloutCtx,
    params: &Params,
    indices: &[u64],
) -> Result<Vec<Group>, anneal_engine::Error> {
    if ctx.env.is_some() {
        return crate::episode::play_groups(ctx, params, indices);
    }
    let prompts: Vec<Prompt> = indices.iter().map(|&i| ctx.prompts.get(i)).collect();
    let encoded = prompts
        .iter()
        .map(|p| encode_prompt(&ctx.tokenizer, &p.prompt, ctx.prepend_eos))
        .collect::<Result<Vec<_>, _>>()?;
    let mut by_len: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (g, ids) in encoded.iter().enumerate() {
        by_len.entry(ids.len()).or_default().push(g);
    }
    let mut groups: Vec<Option<Group>> = vec![None; indices.len()];
    for members in by_len.values() {
        let started = Instant::now();
        let mut rows: Vec<&[i64]> = Vec::new();
        let mut samplings = Vec::new();
        for &g in members {
            for j in 0..ctx.group_size {
                rows.push(&encoded[g]);
                samplings.push(Sampling {
                    seed: splitmix(ctx.sampling.seed ^ splitmix(indices[g] * 1_000_003 + j as u64)),
                    eos: Some(ctx.tokenizer.eos_id() as i64),
                    ..ctx.sampling.clone()
                });
            }
        }
        let (generations, _) = generate_batch_tp(
            &ctx.model,
            params,
            &rows,
            ctx.max_new_tokens,
            &samplings,
            true,
            ctx.tp.as_ref(),
        )?;
        let mut generations = generations.into_iter();
        // The batch's time is shared evenly by its groups.
        let t_rollout = started.elapsed().as_secs_f64() / members.len() as f64;
        for &g in members {
            let started = Instant::now();
            let ids = &encoded[g];
            let samples = generations
                .by_ref()
                .take(ctx.group_size)
                .map(|gen| {
                    let text = completion_text(&ctx.tokenizer, &gen.tokens);
                    let scored = ctx.scorer.score(&prompts[g], &text);
                    Sample {
                        tokens: ids.iter().chain(&gen.tokens).copied().collect(),
                        prompt_len: ids.len(),
                        logprobs: gen.logprobs,
                        policy: Vec::new(),
                        text,
                        scored,
                        turns: Vec::new(),
                    }
                })
                .collect();
            groups[g] = Some(Group {
                index: indices[g],
                samples,
                t_rollout,
                t_reward: started.elapsed().as_secs_f64(),
            });
        }
    }
    Ok(groups
        .into_iter()
        .map(|g| g.expect("every prompt is in one length bucket"))
        .collect())
}

/// A worker: begin up to `max_groups` rollouts (waits for room and fresh weights), generate
/// and hand in those groups; until the buffer closes. An error — or a panic, say in a scorer —
/// closes the buffer and is kept in `ctx.failed`, so the trainer stops instead of waiting for
/// groups that will never come.
pub fn worker(ctx: Arc<RolloutCtx>, buffer: Arc<RolloutBuffer<Group, Params>>, max_groups: usize) {
    while rollout_round(&ctx, &buffer, max_groups) {}
}

/// One synchronous round with `weights`, which the buffer holds only while it runs: they are
/// published as `version`, this thread decodes up to `max_groups` groups with them, and the
/// buffer lets go of them (the next step publishes its own).
pub(crate) fn rollout_round_with(
    ctx: &RolloutCtx,
    buffer: &RolloutBuffer<Group, Params>,
    version: u64,
    weights: Params,
    max_groups: usize,
) {
    buffer.publish(version, weights);
    rollout_round(ctx, buffer, max_groups);
    buffer.publish(version, Params::default());
}

/// One round of a [`worker`]: begins up to `max_groups` rollouts (waiting for room and fresh
/// weights), generates and hands in those groups. `false` once the buffer has closed or the
/// round failed (the failure is kept in `ctx.failed` and the buffer closed). Under tensor
/// parallelism the run calls it itself, once per step on the training thread, so the ranks
/// of a group decode together.
pub fn rollout_round(
    ctx: &RolloutCtx,
    buffer: &RolloutBuffer<Group, Params>,
    max_groups: usize,
) -> bool {
    let Some((version, params, k)) = buffer.begin_many(max_groups) else {
        return false;
    };
    let first = ctx.next_prompt.fetch_add(k as u64, Ordering::SeqCst);
    let indices: Vec<u64> = (first..first + k as u64)
        .map(|c| ctx.share.global(c))
        .collect();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rollout_groups(ctx, &params, &indices)
    }));
    let failure = match outcome {
        Ok(Ok(groups)) => {
            groups.into_iter().for_each(|g| buffer.finish(version, g));
            return true;
        }
        Ok(Err(e)) => e.to_string(),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            format!("a rollout worker panicked: {what}")
        }
    };
    (0..k).for_each(|_| buffer.abandon());
    let mut f = ctx.failed.lock().unwrap_or_else(|e| e.into_inner());
    f.get_or_insert(failure);
    buffer.close();
    false
}

/// Held-out prompts decoded together in one batch: the batch-invariant kernels pad matrix
/// products to 64 rows anyway.
const EVAL_BATCH: usize = anneal_engine::invariant::TILE;

/// Greedy accuracy on `prompts`: the share whose completion the scorer calls correct (or whose
/// reward is positive when no module reports `correct`).
pub fn evaluate(
    ctx: &RolloutCtx,
    params: &Params,
    prompts: &[Prompt],
) -> Result<f64, anneal_engine::Error> {
    if ctx.env.is_some() {
        let mut right = 0usize;
        for (c, chunk) in prompts.chunks(EVAL_BATCH).enumerate() {
            let first = (c * EVAL_BATCH) as u64;
            let indices: Vec<u64> = (first..first + chunk.len() as u64).collect();
            let groups = crate::episode::play(ctx, params, &indices, chunk, 1, true)?;
            right += groups
                .iter()
                .flat_map(|g| &g.samples)
                .filter(|s| s.scored.correct.unwrap_or(s.scored.reward > 0.0))
                .count();
        }
        return Ok(right as f64 / prompts.len().max(1) as f64);
    }
    let (tok, scorer) = (ctx.tokenizer.as_ref(), ctx.scorer.as_ref());
    let (prepend_eos, max_new_tokens) = (ctx.prepend_eos, ctx.max_new_tokens);
    let s = Sampling {
        temperature: 0.0,
        eos: Some(tok.eos_id() as i64),
        ..Sampling::default()
    };
    let encoded = prompts
        .iter()
        .map(|p| encode_prompt(tok, &p.prompt, prepend_eos))
        .collect::<Result<Vec<_>, _>>()?;
    // Greedy rows do not depend on their batch, so prompts of equal length share decode steps.
    let mut by_len: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, ids) in encoded.iter().enumerate() {
        by_len.entry(ids.len()).or_default().push(i);
    }
    let mut right = 0usize;
    for members in by_len.values() {
        for chunk in members.chunks(EVAL_BATCH) {
            let rows: Vec<&[i64]> = chunk.iter().map(|&i| encoded[i].as_slice()).collect();
            let (gens, _) = generate_batch_tp(
                &ctx.model,
                params,
                &rows,
                max_new_tokens,
                &vec![s.clone(); rows.len()],
                true,
                ctx.tp.as_ref(),
            )?;
            for (&i, g) in chunk.iter().zip(&gens) {
                let sc = scorer.score(&prompts[i], &completion_text(tok, &g.tokens));
                if sc.correct.unwrap_or(sc.reward > 0.0) {
                    right += 1;
                }
            }
        }
    }
    Ok(right as f64 / prompts.len().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_share_each_step_in_order() {
        let one = Share {
            rank: 0,
            ranks: 1,
            per_step: 4,
        };
        assert_eq!(
            (0..9).map(|c| one.global(c)).collect::<Vec<_>>(),
            (0..9).collect::<Vec<_>>()
        );
        let of = |rank| Share {
            rank,
            ranks: 2,
            per_step: 4,
        };
        let r0: Vec<u64> = (0..4).map(|c| of(0).global(c)).collect();
        let r1: Vec<u64> = (0..4).map(|c| of(1).global(c)).collect();
        assert_eq!((r0, r1), (vec![0, 1, 4, 5], vec![2, 3, 6, 7]));
        assert_eq!((of(1).local_of(8), one.local_of(8)), (4, 8));
    }

    #[test]
    fn arithmetic_tasks_multiply_three_digits_by_two() {
        for i in 0..50 {
            let (p, a) = arithmetic_task(7, i);
            let (x, y) = p.trim_end_matches('=').split_once('*').unwrap();
            let (x, y): (u64, u64) = (x.parse().unwrap(), y.parse().unwrap());
            assert!((100..1000).contains(&x) && (10..100).contains(&y), "{p}");
            assert_eq!(a, (x * y).to_string());
        }
        let src = PromptSource::Arithmetic { seed: 7 };
        assert_eq!(src.get(3).metadata["question"], src.get(3).prompt.as_str());
        assert_ne!(src.held_out(1)[0], src.get(0));
    }

    #[test]
    fn digits_tasks_are_sorted_and_reproducible() {
        for i in 0..50 {
            let (p, a) = digits_sort_task(7, i);
            assert_eq!((p.clone(), a.clone()), digits_sort_task(7, i));
            let digits = p.trim_end_matches('=');
            assert!((3..=5).contains(&digits.len()));
            let mut d: Vec<char> = digits.chars().collect();
            d.sort_unstable();
            assert_eq!(d.into_iter().collect::<String>(), a);
        }
        let src = PromptSource::DigitsSort { seed: 7 };
        let held = src.held_out(20);
        let train: Vec<_> = (0..20).map(|i| src.get(i).prompt).collect();
        assert!(held.iter().filter(|p| train.contains(&p.prompt)).count() < 10);
    }
}
