//! What an RL run is made of before its first step: the tokenizer, the prompts, the model and
//! optimizer plugins, the starting policy, and the digests its checkpoints record.

use crate::rollout::{Prompt, PromptSource};
use anneal_config::JobConfig;
use anneal_data::TextTokenizer;
use anneal_engine::Tensor;
use anneal_runtime::plugins::model::init_param;
use anneal_runtime::plugins::{PluginModel, PluginOptimizer};
use anneal_train::checkpoint::{load_dir_with, Contents};
use anneal_train::harness::{load_model, load_optimizer, params_from_checkpoint, Provenance};
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
}

/// Loads the tokenizer (`rl.tokenizer`, or the one next to `rl.init_from`), the prompts, the
/// model and optimizer plugins, and checks that the tokenizer fits the model.
pub(crate) fn prepare(cfg: &JobConfig) -> Result<Setup, TrainError> {
    let tokenizer_path = tokenizer_path(cfg)?;
    let tokenizer = Arc::new(TextTokenizer::from_file(&tokenizer_path)?);
    let (prompts, prompts_sha256) = load_prompts(cfg)?;
    let model = Arc::new(load_model(cfg)?);
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
    let optimizer = load_optimizer(cfg)?;
    anneal_train::memory::check(cfg, model.spec(), anneal_train::memory::Workload::Rl)?;
    let provenance = Provenance {
        tokenizer_sha256: tokenizer.sha256()?,
        data_sha256: prompts_sha256,
    };
    Ok(Setup {
        tokenizer,
        tokenizer_path,
        prompts,
        model,
        optimizer,
        provenance,
    })
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

/// The prompts (`rl.prompts_path`, or the built-in task) and a digest of them: of the file's
/// bytes, or of the task's name and seed.
fn load_prompts(cfg: &JobConfig) -> Result<(PromptSource, String), TrainError> {
    let r = &cfg.rl;
    if r.prompts_path.is_empty() {
        let digest = sha256_hex(format!("digits_sort task, seed {}", r.task_seed).as_bytes());
        return Ok((PromptSource::DigitsSort { seed: r.task_seed }, digest));
    }
    let path = Path::new(&r.prompts_path);
    let bytes = std::fs::read(path)
        .map_err(|e| cfg_err("rl.prompts_path", format!("{}: {e}", path.display())))?;
    let text = String::from_utf8_lossy(&bytes);
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
    Ok((PromptSource::List(Arc::new(list)), sha256_hex(&bytes)))
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
