//! Multi-turn episodes: the policy talks with an environment (tools, code execution,
//! retrieval) over several turns, and the host owns the token sequence.
//!
//! **Token-exact.** An episode is one growing sequence of token ids. The policy's tokens are
//! kept exactly as sampled (its turn ends with the template's end-of-turn token, which it
//! samples too); the environment's observation is rendered once by the chat template as the
//! text that follows the policy's turn, tokenized once and appended. Nothing before is ever
//! rendered or tokenized again, so the trainer sees the very tokens the policy sampled, and the
//! logprob mismatch stays exactly 0. The trainer's loss mask is 1 on the policy's tokens and 0
//! on the prompt's and the environment's ([`Sample::policy`]).
//!
//! **Turns.** Each policy turn is parsed for tool calls (`<tool_call>{json}</tool_call>`,
//! [`anneal_data::chat::tools`]) and handed to the environment's `step` as JSON; the step
//! answers with an observation, a reward and whether the episode is done. A turn that runs out
//! of `rl.max_new_tokens` is closed by the host (its end-of-turn token appended as context,
//! untrained) and answered like any other. An episode ends when
//! the environment says so, after `rl.max_turns` policy turns, when the next turn or
//! observation would pass `rl.max_episode_tokens` (or the model's context), or on a failure: an
//! environment that traps, times out or returns garbage, or a tool call that never closes.
//! A failure gives the episode `rl.error_reward`; the run goes on.
//!
//! **Credit.** The episode's reward is the sum of its steps' rewards (an environment that
//! rewards only at the end gives a terminal reward), plus the `rl.rewards` modules' score of
//! the policy's last turn when any are configured. Advantages are per episode, as for
//! single-turn groups: every policy token of an episode shares its advantage.

use crate::rollout::{splitmix, Group, Prompt, RewardFailure, RolloutCtx, Sample, Scored};
use anneal_data::chat::template::{ChatTemplate, Message, Tools};
use anneal_data::chat::tools::parse_tool_calls;
use anneal_data::TextTokenizer;
use anneal_runtime::infer::{generate_batch_tp, Sampling};
use anneal_runtime::plugins::Params;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

/// What an environment's `init` returns: the conversation's first messages and its tools.
#[derive(Clone, Debug, Default)]
pub struct EnvStart {
    /// The first messages (a user message with the task, typically).
    pub messages: Vec<Message>,
    /// Tool specs in OpenAI's function format, passed to the chat template as `tools`.
    pub tools: Vec<Value>,
}

/// What one environment step returns.
#[derive(Clone, Debug, Default)]
pub struct EnvStep {
    /// The environment's answer (a tool's output).
    pub observation: String,
    /// The observation's role in the conversation (`tool`, or `user`).
    pub role: String,
    /// This step's reward; an episode's reward is the sum.
    pub reward: f64,
    /// Whether the episode is over.
    pub done: bool,
    /// Whether the task was solved, when the environment says.
    pub correct: Option<bool>,
}

/// Why an episode ended early.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvFailure {
    /// `timeout`, `trap`, `fuel_exhausted`, `memory_limit`, `bad_output`, `tool_call`, ...
    pub kind: String,
    /// What happened, for `samples.jsonl` and the console.
    pub message: String,
}

impl EnvFailure {
    fn failure(&self) -> RewardFailure {
        match self.kind.as_str() {
            "timeout" => RewardFailure::Timeout,
            _ => RewardFailure::Error,
        }
    }
}

/// One episode of an environment, with its state (an instance of the module).
pub trait EnvEpisode: Send {
    /// The policy's turn (the JSON of [`anneal_data::chat::tools::ParsedTurn::to_step_json`]).
    fn step(&mut self, turn: &Value) -> Result<EnvStep, EnvFailure>;
}

/// Starts episodes; the CLI implements it with the WebAssembly sandbox.
pub trait Environment: Send + Sync {
    /// A new episode of `task` (the prompt line's metadata, with its `prompt`), and its start.
    fn start(&self, task: &Value) -> Result<(Box<dyn EnvEpisode>, EnvStart), EnvFailure>;
}

/// The task an environment's `init` gets for `prompt`: the prompt line's metadata object, with
/// the prompt text as `prompt` when the metadata has none.
pub fn task_json(prompt: &Prompt) -> Value {
    let mut task = match &prompt.metadata {
        Value::Object(m) => m.clone(),
        Value::Null => serde_json::Map::new(),
        other => {
            let mut m = serde_json::Map::new();
            m.insert("metadata".into(), other.clone());
            m
        }
    };
    task.entry("prompt")
        .or_insert_with(|| Value::String(prompt.prompt.clone()));
    Value::Object(task)
}

/// One turn of an episode, as `samples.jsonl` records it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Turn {
    /// `prompt` (the rendered first messages), `policy`, or the observation's role.
    pub role: String,
    /// Its text.
    pub text: String,
    /// Its tokens in the sequence.
    pub tokens: usize,
    /// The step's reward (on the policy turn the environment answered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<f64>,
    /// Why the episode ended at this turn, when it ended early.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What rollouts need to play episodes.
pub struct EnvCtx {
    /// Starts episodes.
    pub environment: std::sync::Arc<dyn Environment>,
    /// The chat template's turn markers.
    pub markers: TurnMarkers,
    /// Turn and token limits.
    pub settings: EpisodeSettings,
    /// The reward of an episode that failed (`rl.error_reward`).
    pub error_reward: f64,
}

/// Limits of the episodes of a run.
#[derive(Clone, Debug)]
pub struct EpisodeSettings {
    /// Policy turns per episode at most.
    pub max_turns: usize,
    /// Tokens of an episode at most (prompt, turns and observations).
    pub max_episode_tokens: usize,
}

/// How the chat template marks turns, found once by rendering: the token that ends a policy
/// turn (its sampling stops there) and the text the template puts after it.
pub struct TurnMarkers {
    template: ChatTemplate,
    end_of_turn: u32,
    /// What the template writes after the end-of-turn token before the next message (`"\n"` in
    /// ChatML).
    after_end: String,
}

/// Text that no template writes, to find where a message's content sits in a render.
const SENTINEL: &str = "\u{E000}anneal-turn\u{E001}";

impl TurnMarkers {
    /// The markers of `template` with `tok`: the assistant message's closing text must start
    /// with one token (`<|im_end|>`, `<|eot_id|>`), which ends the policy's turns.
    pub fn new(template: ChatTemplate, tok: &TextTokenizer) -> Result<TurnMarkers, String> {
        let probe = [msg("user", "u"), msg("assistant", SENTINEL)];
        let text = template
            .render_conversation(&probe)
            .map_err(|e| e.to_string())?;
        let closing = text
            .rfind(SENTINEL)
            .map(|at| &text[at + SENTINEL.len()..])
            .ok_or("the chat template does not write an assistant message's content")?;
        let first = tok
            .encode(closing)
            .map_err(|e| e.to_string())?
            .first()
            .copied()
            .ok_or("the chat template writes nothing after an assistant message")?;
        let end_text = tok.decode(&[first]).map_err(|e| e.to_string())?;
        let after_end = closing
            .strip_prefix(end_text.as_str())
            .filter(|_| end_text.trim().len() > 1)
            .ok_or_else(|| {
                format!(
                    "the chat template ends an assistant message with {closing:?}, which does not start with one end-of-turn token"
                )
            })?;
        Ok(TurnMarkers {
            after_end: after_end.to_string(),
            template,
            end_of_turn: first,
        })
    }

    /// The token that ends a policy turn.
    pub fn end_of_turn(&self) -> u32 {
        self.end_of_turn
    }

    /// The prompt of an episode: its tools and first messages, then the assistant's turn
    /// opening.
    pub fn prompt(&self, messages: &[Message], tools: Option<&Tools>) -> Result<String, String> {
        self.render(messages, tools, true)
    }

    fn render(
        &self,
        messages: &[Message],
        tools: Option<&Tools>,
        open: bool,
    ) -> Result<String, String> {
        let never = AtomicBool::new(false);
        self.template
            .render_request(messages, tools, open, &never)
            .map_err(|e| e.to_string())
    }

    /// The text that follows the policy's last turn (whose end-of-turn token it sampled) when
    /// `observation` answers it: the rest of the turn's closing, the observation's message and
    /// the next assistant turn's opening. `history` ends with that policy turn. Refused when
    /// the template does not render the conversation append-only.
    pub fn observation(
        &self,
        history: &[Message],
        tools: Option<&Tools>,
        observation: Message,
    ) -> Result<String, String> {
        let before = self.render(history, tools, false)?;
        let mut next = history.to_vec();
        next.push(observation);
        let after = self.render(&next, tools, true)?;
        let tail = after.strip_prefix(before.as_str()).ok_or(
            "the chat template renders a conversation differently once a message is added, so turns cannot be appended token-exactly",
        )?;
        Ok(format!("{}{tail}", self.after_end))
    }
}

fn msg(role: &str, content: &str) -> Message {
    Message::new(role, content)
}

/// An environment's tool specs as the template's `tools` (none when it has none).
fn template_tools(tools: &[Value]) -> Result<Option<Tools>, String> {
    if tools.is_empty() {
        return Ok(None);
    }
    let text = serde_json::to_string(tools).map_err(|e| e.to_string())?;
    Tools::from_json(&text).map(Some)
}

/// An episode being played.
struct Live {
    prompt: usize,
    tokens: Vec<i64>,
    prompt_len: usize,
    logprobs: Vec<f32>,
    policy: Vec<bool>,
    history: Vec<Message>,
    tools: Option<Tools>,
    turns: Vec<Turn>,
    episode: Option<Box<dyn EnvEpisode>>,
    reward: f64,
    correct: Option<bool>,
    failure: Option<EnvFailure>,
    last_text: String,
    policy_turns: usize,
}

impl Live {
    fn end(&mut self, failure: Option<EnvFailure>) {
        if let (Some(f), Some(turn)) = (&failure, self.turns.last_mut()) {
            turn.error = Some(format!("{}: {}", f.kind, f.message));
        }
        if failure.is_some() {
            self.failure = failure;
        }
        // Dropping the episode closes its instance.
        self.episode = None;
    }

    fn room(&self, settings: &EpisodeSettings, max_seq_len: usize) -> usize {
        settings
            .max_episode_tokens
            .min(max_seq_len)
            .saturating_sub(self.tokens.len())
    }
}

fn failed(kind: &str, message: impl Into<String>) -> EnvFailure {
    EnvFailure {
        kind: kind.into(),
        message: message.into(),
    }
}

/// Plays the episodes of prompts `indices`, `ctx.group_size` each, with `params`, and returns
/// their groups.
pub fn play_groups(
    ctx: &RolloutCtx,
    params: &Params,
    indices: &[u64],
) -> Result<Vec<Group>, anneal_engine::Error> {
    let prompts: Vec<Prompt> = indices.iter().map(|&i| ctx.prompts.get(i)).collect();
    play(ctx, params, indices, &prompts, ctx.group_size, false)
}

/// Plays `per_prompt` episodes of each of `prompts` (numbered `indices`), sampled or greedy.
/// Every turn decodes the live episodes of equal length together; each episode's turn `t`
/// draws from its own stream, keyed by its prompt's index, its place in the group and `t`, so
/// the result does not depend on how episodes are batched.
pub fn play(
    ctx: &RolloutCtx,
    params: &Params,
    indices: &[u64],
    prompts: &[Prompt],
    per_prompt: usize,
    greedy: bool,
) -> Result<Vec<Group>, anneal_engine::Error> {
    let env = ctx
        .env
        .as_ref()
        .expect("episodes are played with an environment");
    let started = Instant::now();
    let invalid = |msg: String| anneal_engine::Error::Invalid { op: "episode", msg };
    let mut live: Vec<Live> = Vec::new();
    for (g, prompt) in prompts.iter().enumerate() {
        for _ in 0..per_prompt {
            live.push(start(ctx, &env.markers, g, prompt).map_err(invalid)?);
        }
    }
    let max_seq_len = ctx.model.spec().max_seq_len;
    for turn in 0..env.settings.max_turns {
        let mut by_len: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (e, l) in live.iter().enumerate() {
            if l.episode.is_some() {
                by_len.entry(l.tokens.len()).or_default().push(e);
            }
        }
        if by_len.is_empty() {
            break;
        }
        for (&len, members) in &by_len {
            let room = live[members[0]].room(&env.settings, max_seq_len);
            let budget = ctx.max_new_tokens.min(room);
            if budget == 0 {
                for &e in members {
                    let why = format!("the episode reached its {len} tokens (rl.max_episode_tokens or the model's context) before the policy's turn");
                    live[e].end(Some(failed("max_episode_tokens", why)));
                }
                continue;
            }
            let rows: Vec<&[i64]> = members.iter().map(|&e| live[e].tokens.as_slice()).collect();
            let samplings: Vec<Sampling> = members
                .iter()
                .map(|&e| {
                    let (g, j) = (live[e].prompt, e % per_prompt);
                    let key = indices[g] * 1_000_003 + j as u64;
                    Sampling {
                        temperature: if greedy {
                            0.0
                        } else {
                            ctx.sampling.temperature
                        },
                        seed: splitmix(
                            ctx.sampling.seed ^ splitmix(key) ^ splitmix(turn as u64 + 1),
                        ),
                        eos: Some(i64::from(env.markers.end_of_turn())),
                        ..ctx.sampling.clone()
                    }
                })
                .collect();
            let (gens, _) = generate_batch_tp(
                &ctx.model,
                params,
                &rows,
                budget,
                &samplings,
                true,
                ctx.tp.as_ref(),
            )?;
            for (&e, gen) in members.iter().zip(gens) {
                let last = turn + 1 == env.settings.max_turns;
                policy_turn(
                    ctx,
                    env,
                    &mut live[e],
                    (gen.tokens, gen.logprobs),
                    last,
                    max_seq_len,
                )?;
            }
        }
    }
    for l in &mut live {
        if l.episode.is_some() {
            let why = format!(
                "the policy took rl.max_turns = {} turns",
                env.settings.max_turns
            );
            l.end(Some(failed("max_turns", why)));
        }
    }
    let t_rollout = started.elapsed().as_secs_f64() / indices.len().max(1) as f64;
    let mut groups: Vec<Group> = indices
        .iter()
        .map(|&index| Group {
            index,
            samples: Vec::new(),
            t_rollout,
            t_reward: 0.0,
        })
        .collect();
    for l in live {
        let g = l.prompt;
        let sample = finish(ctx, &prompts[g], l);
        groups[g].samples.push(sample);
    }
    Ok(groups)
}

/// Starts one episode: the environment's first messages, rendered and tokenized once.
fn start(
    ctx: &RolloutCtx,
    markers: &TurnMarkers,
    g: usize,
    prompt: &Prompt,
) -> Result<Live, String> {
    let env = ctx.env.as_ref().expect("an environment");
    let mut live = Live {
        prompt: g,
        tokens: Vec::new(),
        prompt_len: 0,
        logprobs: Vec::new(),
        policy: Vec::new(),
        history: Vec::new(),
        tools: None,
        turns: Vec::new(),
        episode: None,
        reward: 0.0,
        correct: None,
        failure: None,
        last_text: String::new(),
        policy_turns: 0,
    };
    let (episode, first) = match env.environment.start(&task_json(prompt)) {
        Ok(started) => started,
        Err(f) => {
            // An episode that cannot start is one failed sample; its prompt is the task's text.
            live.tokens = crate::rollout::encode_prompt(&ctx.tokenizer, &prompt.prompt, false)
                .map_err(|e| e.to_string())?;
            if live.tokens.is_empty() {
                live.tokens.push(i64::from(ctx.tokenizer.eos_id()));
            }
            live.prompt_len = live.tokens.len();
            live.turns.push(Turn {
                role: "prompt".into(),
                text: prompt.prompt.clone(),
                tokens: live.prompt_len,
                ..Turn::default()
            });
            live.end(Some(f));
            return Ok(live);
        }
    };
    live.tools = template_tools(&first.tools)?;
    let text = markers.prompt(&first.messages, live.tools.as_ref())?;
    let ids = ctx.tokenizer.encode(&text).map_err(|e| e.to_string())?;
    live.tokens = ids.into_iter().map(i64::from).collect();
    if live.tokens.is_empty() {
        return Err("the environment's first messages render to no tokens".into());
    }
    live.prompt_len = live.tokens.len();
    live.turns.push(Turn {
        role: "prompt".into(),
        text,
        tokens: live.prompt_len,
        ..Turn::default()
    });
    live.history = first.messages;
    live.episode = Some(episode);
    Ok(live)
}

/// Appends a policy turn, hands it to the environment and appends its observation.
fn policy_turn(
    ctx: &RolloutCtx,
    env: &EnvCtx,
    l: &mut Live,
    (tokens, logprobs): (Vec<i64>, Vec<f32>),
    last: bool,
    max_seq_len: usize,
) -> Result<(), anneal_engine::Error> {
    let end = i64::from(env.markers.end_of_turn());
    let closed = tokens.last() == Some(&end);
    let body: Vec<u32> = tokens
        .iter()
        .take(tokens.len() - usize::from(closed))
        .map(|&t| t as u32)
        .collect();
    let text = ctx.tokenizer.decode(&body).unwrap_or_default();
    l.policy.extend(std::iter::repeat_n(true, tokens.len()));
    l.logprobs.extend(logprobs);
    l.turns.push(Turn {
        role: "policy".into(),
        text: text.clone(),
        tokens: tokens.len(),
        ..Turn::default()
    });
    l.tokens.extend(tokens);
    l.policy_turns += 1;
    l.last_text = text.clone();
    let parsed = parse_tool_calls(&text);
    if parsed.unclosed {
        let why = parsed.error.clone().unwrap_or_default();
        l.end(Some(failed("tool_call", why)));
        return Ok(());
    }
    let step = match l
        .episode
        .as_mut()
        .map(|e| e.step(&parsed.to_step_json(&text)))
    {
        Some(Ok(step)) => step,
        Some(Err(f)) => {
            l.end(Some(f));
            return Ok(());
        }
        None => return Ok(()),
    };
    l.reward += step.reward;
    l.correct = step.correct.or(l.correct);
    if let Some(turn) = l.turns.last_mut() {
        turn.reward = Some(step.reward);
    }
    l.history.push(msg("assistant", &text));
    if step.done {
        l.end(None);
        return Ok(());
    }
    if last {
        // No turn would read the observation.
        let why = format!(
            "the policy took rl.max_turns = {} turns",
            env.settings.max_turns
        );
        l.end(Some(failed("max_turns", why)));
        return Ok(());
    }
    let role = if step.role.is_empty() {
        "tool"
    } else {
        step.role.as_str()
    };
    let observation = msg(role, &step.observation);
    let text = match env
        .markers
        .observation(&l.history, l.tools.as_ref(), observation.clone())
    {
        Ok(text) => text,
        Err(why) => {
            l.end(Some(failed("template", why)));
            return Ok(());
        }
    };
    let encoded = ctx
        .tokenizer
        .encode(&text)
        .map_err(|e| anneal_engine::Error::Invalid {
            op: "episode",
            msg: format!("cannot tokenize an observation: {e}"),
        })?;
    // A turn cut off by its token budget is closed by the host: the end-of-turn token it did not
    // sample comes first, as context the policy is not trained on.
    let ids: Vec<u32> = (!closed)
        .then_some(env.markers.end_of_turn())
        .into_iter()
        .chain(encoded)
        .collect();
    if ids.len() > l.room(&env.settings, max_seq_len) {
        let why = format!(
            "an observation of {} tokens does not fit the episode's {} remaining tokens (rl.max_episode_tokens or the model's context)",
            ids.len(),
            l.room(&env.settings, max_seq_len)
        );
        l.end(Some(failed("max_episode_tokens", why)));
        return Ok(());
    }
    l.turns.push(Turn {
        role: role.into(),
        text: step.observation,
        tokens: ids.len(),
        ..Turn::default()
    });
    l.history.push(observation);
    l.policy.extend(std::iter::repeat_n(false, ids.len()));
    l.logprobs.extend(std::iter::repeat_n(0.0, ids.len()));
    l.tokens.extend(ids.into_iter().map(i64::from));
    Ok(())
}

/// The sample of a finished episode: its reward (the steps' sum plus the reward modules' score
/// of its last turn; `rl.error_reward` after a failure) and its turns.
fn finish(ctx: &RolloutCtx, prompt: &Prompt, l: Live) -> Sample {
    let env = ctx.env.as_ref().expect("an environment");
    let mut scored = match &l.failure {
        // Running out of turns or tokens is the policy's doing, not a broken environment: the
        // episode keeps what it earned.
        Some(f) if !matches!(f.kind.as_str(), "max_turns" | "max_episode_tokens") => Scored {
            reward: env.error_reward,
            failures: vec![f.failure()],
            ..Scored::default()
        },
        _ => {
            let mut s = ctx.scorer.score(prompt, &l.last_text);
            s.reward += l.reward;
            s.correct = l.correct.or(s.correct);
            s
        }
    };
    if l.policy_turns == 0 {
        scored.correct = Some(false);
    }
    Sample {
        tokens: l.tokens,
        prompt_len: l.prompt_len,
        logprobs: l.logprobs,
        policy: l.policy,
        text: l.last_text,
        scored,
        turns: l.turns,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_data::chat::template::{CHATML, CHATML_SPECIALS};

    fn chatml() -> (ChatTemplate, TextTokenizer) {
        let docs = vec!["<|im_start|>user\nhi<|im_end|>\n".to_string(); 4];
        let tok = TextTokenizer::train_bpe_with_specials(&docs, 300, &CHATML_SPECIALS).unwrap();
        let template = ChatTemplate::new(Some(CHATML.into()), None, Some("<|im_end|>".into()));
        (template.unwrap(), tok)
    }

    #[test]
    fn chatml_turns_end_with_im_end_and_observations_append() {
        let (template, tok) = chatml();
        let m = TurnMarkers::new(template, &tok).unwrap();
        assert_eq!(Some(m.end_of_turn()), tok.token_id("<|im_end|>"));
        assert_eq!(m.after_end, "\n");
        let history = [
            msg("user", "2+2="),
            msg("assistant", "<tool_call>{}</tool_call>"),
        ];
        // Qwen's way: a tool's answer is a user turn holding a `<tool_response>`.
        assert_eq!(
            m.observation(&history, None, msg("tool", "4")).unwrap(),
            "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            m.prompt(&history[..1], None).unwrap(),
            "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
        );
        // Tools go into the system turn the prompt starts with, and stay out of the deltas.
        let tools = template_tools(&[
            serde_json::json!({"type": "function", "function": {"name": "calculator"}}),
        ])
        .unwrap();
        let prompt = m.prompt(&history[..1], tools.as_ref()).unwrap();
        assert!(
            prompt.starts_with("<|im_start|>system\n# Tools") && prompt.contains("\"calculator\""),
            "{prompt}"
        );
        assert_eq!(
            m.observation(&history, tools.as_ref(), msg("tool", "4"))
                .unwrap(),
            m.observation(&history, None, msg("tool", "4")).unwrap()
        );
    }

    #[test]
    fn a_template_that_rewrites_history_is_refused() {
        let (_, tok) = chatml();
        // Drops earlier assistant turns once another message follows (as reasoning templates
        // drop earlier thoughts): the next render does not extend the previous one.
        let source = "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}\
<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::new(Some(source.into()), None, None).unwrap();
        let m = TurnMarkers::new(t, &tok).unwrap();
        let history = [msg("user", "q"), msg("assistant", "a")];
        let err = m.observation(&history, None, msg("tool", "o")).unwrap_err();
        assert!(err.contains("append"), "{err}");
    }

    #[test]
    fn a_template_without_an_end_token_is_refused() {
        let (_, tok) = chatml();
        let t = ChatTemplate::new(
            Some("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}".into()),
            None,
            None,
        )
        .unwrap();
        let err = TurnMarkers::new(t, &tok).err().unwrap();
        assert!(err.contains("end-of-turn token"), "{err}");
    }

    #[test]
    fn tasks_carry_their_prompt() {
        let p = Prompt {
            prompt: "1+1=".into(),
            metadata: serde_json::json!({"answer": "2"}),
        };
        assert_eq!(
            task_json(&p),
            serde_json::json!({"answer": "2", "prompt": "1+1="})
        );
    }
}
