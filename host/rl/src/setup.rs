//! What an RL run is made of before its first step: the tokenizer, the prompts, the model and
//! optimizer plugins, the starting policy, and the digests its checkpoints record.

use crate::rollout::{encode_prompt, Prompt, PromptSource};
use anneal_config::JobConfig;
use anneal_data::TextTokenizer;
use anneal_engine::Tensor;
use anneal_runtime::plugins::model::init_param;
use anneal_runtime::plugins::{PluginModel, PluginOptimizer};
use anneal_train::checkpoint::{load_dir_with, Contents};
use anneal_train::harness::{params_from_checkpoint, Provenance};
use anneal_train::{TpInference, TrainError};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The pieces of an RL run, checked against each other.
pub(crate) struct Setup {
    /// The tokenizer and the file it came from.
    pub tokenizer: Arc<TextTokenizer>,
    pub tokenizer_path: PathBuf,
    /// Where prompts come from.
    pub prompts: PromptSource,
    /// The policy's plugin.
    pub model: Arc<PluginModel>,
    pub optimizer: PluginOptimizer,
    /// Digests of the tokenizer and the prompts.
    pub provenance: Provenance,
    /// Prompts of `rl.prompts_path` left out for not fitting the model's context
    /// (`rl.skip_long_prompts`).
    pub skipped_prompts: usize,
    /// The held-out prompts of `rl.eval_prompts_path`, when set.
    pub eval_prompts: Option<Vec<Prompt>>,
}

/// Loads the tokenizer (`rl.tokenizer`, or the one next to `rl.init_from`), the prompts, the
/// model and optimizer plugins, and checks that the tokenizer fits the model and that every
/// prompt leaves room for `rl.max_new_tokens` in the model's context (or skips those that do
/// not, with `rl.skip_long_prompts`). Everything `anneal rl` can refuse before any expensive
/// work; [`crate::preflight`] runs it for `anneal serve`'s validation too.
pub(crate) fn prepare(cfg: &JobConfig) -> Result<Setup, TrainError> {
    let tokenizer_path = tokenizer_path(cfg)?;
    let tokenizer = Arc::new(TextTokenizer::from_file(&tokenizer_path).map_err(|e| {
        let key = match cfg.rl.tokenizer.is_empty() {
            true => "rl.init_from",
            false => "rl.tokenizer",
        };
        TrainError::from(e).at(key)
    })?);
    let (prompts, prompts_sha256) = load_prompts(cfg)?;
    let (model, optimizer) = anneal_train::preflight::plugins(cfg)?;
    let model = Arc::new(model);
    let (prompts, skipped_prompts) =
        fit_prompts(cfg, &tokenizer, model.spec().max_seq_len, prompts)?;
    let eval_prompts = load_eval_prompts(cfg, &tokenizer, model.spec().max_seq_len)?;
    if tokenizer.vocab_size() > model.spec().vocab_size {
        return Err(cfg_err(
            "model.args.vocab_size",
            format!(
                "the model has {} embeddings but {} has {} tokens",
                model.spec().vocab_size,
                tokenizer_path.display(),
                tokenizer.vocab_size()
            ),
        ));
    }
    anneal_train::preflight::context(cfg, model.spec(), anneal_train::memory::Workload::Rl)?;
    let provenance = Provenance {
        tokenizer_sha256: tokenizer.sha256()?,
        data_sha256: prompts_sha256,
    };
    Ok(Setup {
        tokenizer,
        tokenizer_path,
        prompts: match prompts {
            Prompts::Task(source) => source,
            Prompts::File { list, .. } => {
                PromptSource::List(Arc::new(list.into_iter().map(|(_, p)| p).collect()))
            }
        },
        model,
        optimizer,
        provenance,
        skipped_prompts,
        eval_prompts,
    })
}

/// The prompts as read: the built-in task, or a file's prompts with their line numbers.
enum Prompts {
    Task(PromptSource),
    File {
        path: PathBuf,
        list: Vec<(usize, Prompt)>,
    },
}

/// The longest prompt of the built-in tasks (`347*86=`), at most a token a byte.
const LONGEST_TASK_PROMPT: usize = 7;

/// Keeps the prompts whose tokens (after the end-of-text token when `rl.prepend_eos`) leave
/// room for `rl.max_new_tokens` in the model's `max_seq_len` positions; one that does not is
/// an error naming its file and line, or with `rl.skip_long_prompts` is left out and counted.
/// (Rollouts would otherwise fail on it when its step comes, and again on every resume.)
fn fit_prompts(
    cfg: &JobConfig,
    tokenizer: &TextTokenizer,
    max_seq_len: usize,
    prompts: Prompts,
) -> Result<(Prompts, usize), TrainError> {
    let r = &cfg.rl;
    let room = max_seq_len.saturating_sub(r.max_new_tokens);
    let (path, list) = match prompts {
        // An episode's prompt is its first messages as the template renders them; an episode
        // that outgrows the context ends there (`rl.max_episode_tokens`).
        Prompts::Task(source) if !r.environment.is_empty() => {
            return Ok((Prompts::Task(source), 0))
        }
        Prompts::Task(source) => {
            let longest = LONGEST_TASK_PROMPT + usize::from(r.prepend_eos);
            if longest > room {
                return Err(cfg_err(
                    "rl.max_new_tokens",
                    format!(
                        "{} new tokens after a prompt of up to {longest} tokens do not fit the model's {max_seq_len} positions (max_seq_len); lower rl.max_new_tokens to at most {}",
                        r.max_new_tokens,
                        max_seq_len.saturating_sub(longest)
                    ),
                ));
            }
            return Ok((Prompts::Task(source), 0));
        }
        Prompts::File { path, list } => (path, list),
    };
    let mut kept = Vec::with_capacity(list.len());
    let mut long: Vec<(usize, usize)> = Vec::new();
    for (line, prompt) in list {
        let tokens = encode_prompt(tokenizer, &prompt.prompt, r.prepend_eos)
            .map_err(|e| {
                cfg_err(
                    "rl.prompts_path",
                    format!("{} line {line}: {e}", path.display()),
                )
            })?
            .len();
        match tokens > room {
            true => long.push((line, tokens)),
            false => kept.push((line, prompt)),
        }
    }
    let Some(&(line, tokens)) = long.first() else {
        return Ok((Prompts::File { path, list: kept }, 0));
    };
    if !r.skip_long_prompts {
        let more = match long.len() {
            1 => String::new(),
            n => format!(
                " ({} more: line{} {}{})",
                n - 1,
                if n > 2 { "s" } else { "" },
                long[1..]
                    .iter()
                    .take(10)
                    .map(|(l, _)| l.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                if n > 11 { ", .." } else { "" }
            ),
        };
        return Err(cfg_err(
            "rl.prompts_path",
            format!(
                "{} line {line}: the prompt is {tokens} tokens, and with rl.max_new_tokens = {} after it that is more than the model's {max_seq_len} positions (max_seq_len){more}; shorten it, lower rl.max_new_tokens, or set rl.skip_long_prompts = true to train without such prompts",
                path.display(),
                r.max_new_tokens
            ),
        ));
    }
    if kept.is_empty() {
        return Err(cfg_err(
            "rl.prompts_path",
            format!(
                "every prompt of {} is too long for the model's {max_seq_len} positions with rl.max_new_tokens = {} after it (line {line}: {tokens} tokens)",
                path.display(),
                r.max_new_tokens
            ),
        ));
    }
    Ok((Prompts::File { path, list: kept }, long.len()))
}

fn cfg_err(key: &str, msg: impl std::fmt::Display) -> TrainError {
    TrainError::Config(format!("config: `{key}`: {msg}"))
}

/// The starting policy of a fresh run, sorted by name: a checkpoint step dir, a Hugging Face
/// dir (`rl.init_from`), or fresh weights from `training.seed`. Under tensor parallelism (`tp`)
/// each tensor is cut to this rank's slice as soon as it is read or drawn, so a rank holds at
/// most one whole tensor, never the whole policy.
pub(crate) fn initial_params(
    cfg: &JobConfig,
    model: &PluginModel,
    tp: Option<&TpInference>,
    note: &dyn Fn(&str),
) -> Result<Vec<(String, Tensor)>, TrainError> {
    let from = &cfg.rl.init_from;
    let dir = Path::new(from);
    let keep = |name: &str, whole: Tensor| match tp {
        Some(tp) => tp.slice_one(name, &whole),
        None => Ok(whole),
    };
    let mut named: Vec<(String, Tensor)> = if from.is_empty() {
        note("policy: fresh weights from training.seed");
        // Each parameter's stream is named after it, so drawing them one by one gives the
        // values of a whole draw.
        model
            .spec()
            .params
            .iter()
            .map(|p| {
                let whole = init_param(p, cfg.training.seed)?;
                Ok((p.name.clone(), keep(&p.name, whole)?))
            })
            .collect::<Result<_, TrainError>>()?
    } else if dir.join("manifest.json").exists() {
        note(&format!("policy: checkpoint {from}"));
        // Tensors are read when asked for, one at a time.
        let loaded = load_dir_with(dir, Contents::OnDemand)?;
        match tp {
            Some(tp) => tp.params_from_checkpoint(&loaded, model, "model"),
            None => params_from_checkpoint(&loaded, model, "model"),
        }
        .map_err(|e| cfg_err("rl.init_from", e))?
    } else if dir.join("config.json").exists() {
        note(&format!("policy: Hugging Face directory {from}"));
        anneal_runtime::hf::load_params_with(dir, model.spec(), &mut |name, whole| {
            keep(name, whole).map_err(|e| e.to_string())
        })
        .map_err(|e| cfg_err("rl.init_from", e))?
        .into_iter()
        .collect()
    } else {
        return Err(cfg_err(
            "rl.init_from",
            format!("{from} is neither a checkpoint step dir (manifest.json) nor a Hugging Face dir (config.json)"),
        ));
    };
    if let Some(tp) = tp {
        note(&format!(
            "policy: tensor-parallel rank {} of {} keeps its slices, cut as each tensor is read",
            tp.rank(),
            tp.ranks()
        ));
    }
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(named)
}

fn tokenizer_path(cfg: &JobConfig) -> Result<PathBuf, TrainError> {
    let r = &cfg.rl;
    if !r.tokenizer.is_empty() {
        return Ok(PathBuf::from(&r.tokenizer));
    }
    let dir = Path::new(&r.init_from);
    if !r.init_from.is_empty() && !dir.exists() {
        return Err(cfg_err(
            "rl.init_from",
            format!("{} does not exist", dir.display()),
        ));
    }
    // A checkpoint step dir sits in <run>/checkpoints/step-N, next to <run>/tokenizer.json.
    let candidates = [dir.join("tokenizer.json"), dir.join("../../tokenizer.json")];
    candidates.into_iter().find(|p| p.exists()).ok_or_else(|| {
        cfg_err(
            "rl.tokenizer",
            "not set, and no tokenizer.json next to rl.init_from",
        )
    })
}

/// The prompts (`rl.prompts_path`, with their line numbers, or the built-in task) and a digest
/// of them: of the file's bytes, or of the task's name and seed.
fn load_prompts(cfg: &JobConfig) -> Result<(Prompts, String), TrainError> {
    let r = &cfg.rl;
    if r.prompts_path.is_empty() {
        let seed = r.task_seed;
        let digest = sha256_hex(format!("{} task, seed {seed}", r.task).as_bytes());
        let source = match r.task.as_str() {
            "arithmetic" => PromptSource::Arithmetic { seed },
            _ => PromptSource::DigitsSort { seed },
        };
        return Ok((Prompts::Task(source), digest));
    }
    let path = Path::new(&r.prompts_path);
    let (list, bytes) = read_prompts("rl.prompts_path", path)?;
    Ok((
        Prompts::File {
            path: path.to_path_buf(),
            list,
        },
        sha256_hex(&bytes),
    ))
}

/// Prompts with the (1-based) line numbers of their file.
type NumberedPrompts = Vec<(usize, Prompt)>;

/// The prompts of a JSON lines file, with their line numbers, and the file's bytes; `key`
/// names the setting in errors.
fn read_prompts(key: &str, path: &Path) -> Result<(NumberedPrompts, Vec<u8>), TrainError> {
    let bytes =
        std::fs::read(path).map_err(|e| cfg_err(key, format!("{}: {e}", path.display())))?;
    let text = String::from_utf8_lossy(&bytes);
    let mut list = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let p: Prompt = serde_json::from_str(line).map_err(|e| {
            cfg_err(
                key,
                format!(
                    "{} line {}: expected {{\"prompt\":..,\"metadata\":{{..}}}} ({e})",
                    path.display(),
                    i + 1
                ),
            )
        })?;
        list.push((i + 1, p));
    }
    if list.is_empty() {
        return Err(cfg_err(key, format!("{} has no prompts", path.display())));
    }
    Ok((list, bytes))
}

/// The held-out prompts of `rl.eval_prompts_path` (the first `rl.eval_prompts`), each of
/// which must fit the model's context as a training prompt must; `None` when it is not set.
fn load_eval_prompts(
    cfg: &JobConfig,
    tokenizer: &TextTokenizer,
    max_seq_len: usize,
) -> Result<Option<Vec<Prompt>>, TrainError> {
    let r = &cfg.rl;
    if r.eval_prompts_path.is_empty() {
        return Ok(None);
    }
    let key = "rl.eval_prompts_path";
    let path = Path::new(&r.eval_prompts_path);
    let (mut list, _) = read_prompts(key, path)?;
    list.truncate(r.eval_prompts);
    if r.environment.is_empty() {
        let room = max_seq_len.saturating_sub(r.max_new_tokens);
        for (line, prompt) in &list {
            let tokens = encode_prompt(tokenizer, &prompt.prompt, r.prepend_eos)
                .map_err(|e| cfg_err(key, format!("{} line {line}: {e}", path.display())))?
                .len();
            if tokens > room {
                return Err(cfg_err(
                    key,
                    format!(
                        "{} line {line}: the prompt is {tokens} tokens, and with rl.max_new_tokens = {} after it that is more than the model's {max_seq_len} positions (max_seq_len)",
                        path.display(),
                        r.max_new_tokens
                    ),
                ));
            }
        }
    }
    Ok(Some(list.into_iter().map(|(_, p)| p).collect()))
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The episodes' context for `environment`: the chat template of the tokenizer's folder (or
/// ChatML when it has none and the tokenizer knows `<|im_end|>`) and its turn markers, with
/// `rl`'s limits.
pub(crate) fn env_ctx(
    cfg: &JobConfig,
    environment: Arc<dyn crate::episode::Environment>,
    tokenizer: &TextTokenizer,
    tokenizer_path: &Path,
) -> Result<crate::episode::EnvCtx, TrainError> {
    use anneal_data::chat::template::{ChatTemplate, CHATML};
    let r = &cfg.rl;
    let dir = tokenizer_path.parent().unwrap_or(Path::new("."));
    let mut template =
        ChatTemplate::load(dir).map_err(|e| cfg_err("rl.environment", e.to_string()))?;
    if template.is_fallback() && tokenizer.token_id("<|im_end|>").is_some() {
        template = ChatTemplate::new(Some(CHATML.into()), None, Some("<|im_end|>".into()))
            .map_err(|e| cfg_err("rl.environment", e.to_string()))?;
    }
    let markers = crate::episode::TurnMarkers::new(template, tokenizer).map_err(|e| {
        cfg_err(
            "rl.environment",
            format!(
                "multi-turn episodes need the chat template of {}: {e}",
                dir.display()
            ),
        )
    })?;
    Ok(crate::episode::EnvCtx {
        environment,
        markers,
        settings: crate::episode::EpisodeSettings {
            max_turns: r.max_turns,
            max_episode_tokens: match r.max_episode_tokens {
                0 => usize::MAX,
                n => n,
            },
        },
        error_reward: r.error_reward,
    })
}
