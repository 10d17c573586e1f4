//! The checks a run makes before any expensive work (tokenizing the corpus, drawing weights),
//! in one place, so that `anneal serve`'s validation
//! (`POST /api/configs/validate`, run creation) asks exactly what the run will: a config the
//! server calls valid does not fail at start for any of these, and one it refuses names the key.
//!
//! - the mesh of `[parallelism]` against the job's processes and the batch ([`crate::Dist`]'s
//!   checks, without communicators);
//! - the device (`job.device`: a CUDA device is probed, its libraries and the device itself);
//! - the model and optimizer plugins with their flavor and arguments, the model's context
//!   (`training.seq_len` ≤ its `max_seq_len`) and vocabulary, and the memory estimate;
//! - the data: `data.path` names readable corpus files (the first document of each JSON Lines
//!   file is checked; the corpus is not read or tokenized here), and a tokenizer file loads.
//!
//! Errors carry the key they are about ([`TrainError::key_path`]).

use crate::harness::{load_model, load_optimizer};
use crate::memory::Workload;
use crate::TrainError;
use anneal_config::JobConfig;
use anneal_engine::Device;
use anneal_plugin_api::spec::ModelSpec;
use anneal_runtime::plugins::{PluginError, PluginModel, PluginOptimizer};
use std::path::PathBuf;

/// What the checks of a training run built on the way, which the run goes on with.
pub struct Preflight {
    /// The job's device (`job.device`), usable here.
    pub device: Device,
    /// The model plugin with the config's flavor and arguments.
    pub model: PluginModel,
    /// The optimizer plugin with its arguments.
    pub optimizer: PluginOptimizer,
    /// The corpus files under `data.path`, sorted.
    pub files: Vec<PathBuf>,
}

/// The checks of `anneal train` for a job of `processes` processes (see the module docs).
pub fn train(cfg: &JobConfig, processes: usize) -> Result<Preflight, TrainError> {
    let degrees = layout(cfg, processes)?;
    lora(cfg, &degrees)?;
    preference_layout(cfg, &degrees, processes)?;
    let device = crate::device::check(cfg, processes)?;
    let (model, optimizer) = plugins(cfg)?;
    // Adapters on weights the model has (the targets name some).
    crate::lora::Adapters::plan(&cfg.lora, model.spec())?;
    context(cfg, model.spec(), Workload::Train)?;
    let files = data(cfg)?;
    if cfg.data.tokenizer != "train" {
        // A tokenizer file that does not load, or has more tokens than the model embeddings.
        let path = PathBuf::from(&cfg.data.tokenizer);
        let tokenizer = anneal_data::TextTokenizer::from_file(&path)
            .map_err(|e| TrainError::from(e).at("data.tokenizer"))?;
        vocab(model.spec(), tokenizer.vocab_size(), &cfg.data.tokenizer)?;
    } else {
        // A trained tokenizer has at most data.vocab_size tokens.
        vocab(model.spec(), cfg.data.vocab_size, "data.vocab_size")?;
    }
    Ok(Preflight {
        device,
        model,
        optimizer,
        files,
    })
}

/// `[lora]` trains in one process or under DDP (replicated adapters, their gradients
/// all-reduced); the sharded and split layouts are not wired to adapters yet.
pub fn lora(cfg: &JobConfig, d: &Degrees) -> Result<(), TrainError> {
    if cfg.lora.rank == 0 {
        return Ok(());
    }
    let key = format!("`lora.rank` = {}", cfg.lora.rank);
    data_parallel_only(d, &key, "LoRA trains")
}

/// Refuses every layout but data parallelism (`dp_replicate`) for a feature (`key`, the config
/// key that turned it on; `what`, what it does) not wired to the others yet.
fn data_parallel_only(d: &Degrees, key: &str, what: &str) -> Result<(), TrainError> {
    for (dim, n) in [
        ("dp_shard", d.dp_shard),
        ("tp", d.tp),
        ("pp", d.pp),
        ("cp", d.cp),
        ("ep", d.ep),
    ] {
        if n > 1 {
            return Err(TrainError::Config(format!(
                "config: {key} with `parallelism.{dim}` = {n}: {what} in one process or \
                 data-parallel (parallelism.dp_replicate); not yet with {dim} > 1"
            )));
        }
    }
    Ok(())
}

/// Preference pairs train in one process or data-parallel (`dp_replicate`), each rank on whole
/// pairs: whole micro-batches, or an even number of each one's rows.
fn preference_layout(cfg: &JobConfig, d: &Degrees, processes: usize) -> Result<(), TrainError> {
    if !cfg.preference.on() {
        return Ok(());
    }
    data_parallel_only(d, "`preference.loss`", "preference tuning runs")?;
    let split = crate::parallel::dist::batch_split(cfg, &checked_mesh(cfg, processes)?)?;
    if let crate::parallel::dist::BatchSplit::Rows { rows } = split {
        if !rows.is_multiple_of(2) {
            return Err(TrainError::Config(format!(
                "config: `training.micro_batch_size` = {}: each of the {} data-parallel ranks \
                 would take {rows} rows of every micro-batch, which splits a preference pair \
                 (two rows); give each rank an even number of rows, or whole micro-batches",
                cfg.training.micro_batch_size, d.dp_replicate
            )));
        }
    }
    Ok(())
}

/// The mesh `[parallelism]` asks for over `processes` processes, as rank 0 sees it, and how
/// the global batch splits over its data-parallel ranks.
pub fn layout(cfg: &JobConfig, processes: usize) -> Result<Degrees, TrainError> {
    let mesh = checked_mesh(cfg, processes)?;
    crate::parallel::dist::batch_split(cfg, &mesh)?;
    Ok(Degrees::of(&mesh))
}

/// The degrees of the mesh `[parallelism]` asks for over `processes` processes, checked
/// against the rest of the config (what [`crate::Dist`] refuses before any communicator).
pub fn mesh(cfg: &JobConfig, processes: usize) -> Result<Degrees, TrainError> {
    Ok(Degrees::of(&checked_mesh(cfg, processes)?))
}

fn checked_mesh(cfg: &JobConfig, processes: usize) -> Result<anneal_dist::Mesh, TrainError> {
    let mesh = anneal_dist::Mesh::new(cfg.parallelism.degrees(), processes, 0)?;
    crate::parallel::dist::check_mesh(cfg, &mesh)?;
    Ok(mesh)
}

/// A resolved mesh's degrees (a `-1` replaced by what it takes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Degrees {
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel replicas.
    pub dp_replicate: usize,
    /// Data-parallel shards.
    pub dp_shard: usize,
    /// Context-parallel ranks.
    pub cp: usize,
    /// Expert-parallel ranks (borrowed from `dp_shard`).
    pub ep: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
}

impl Degrees {
    /// The degrees of `mesh`.
    pub fn of(mesh: &anneal_dist::Mesh) -> Degrees {
        use anneal_dist::MeshDim as D;
        Degrees {
            pp: mesh.degree(D::Pp),
            dp_replicate: mesh.degree(D::DpReplicate),
            dp_shard: mesh.degree(D::DpShard),
            cp: mesh.degree(D::Cp),
            ep: mesh.degree(D::Ep),
            tp: mesh.degree(D::Tp),
        }
    }

    /// The data-parallel ranks: replicas × shards.
    pub fn dp(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// The job's processes.
    pub fn processes(&self) -> usize {
        self.pp * self.dp() * self.cp * self.tp
    }
}

/// The model and optimizer plugins, a failure named by the key that chose it: the plugin
/// (`model.plugin`), the flavor (`model.flavor`) or the argument (`model.args.<name>` when the
/// plugin's message starts with one the config sets, else `model.args`).
pub fn plugins(cfg: &JobConfig) -> Result<(PluginModel, PluginOptimizer), TrainError> {
    let model = load_model(cfg).map_err(|e| keyed(e, "model", &cfg.model.args))?;
    let optimizer = load_optimizer(cfg).map_err(|e| keyed(e, "optimizer", &cfg.optimizer.args))?;
    Ok((model, optimizer))
}

/// `training.seq_len` within the model's context, and the memory estimate of `workload`.
pub fn context(cfg: &JobConfig, spec: &ModelSpec, workload: Workload) -> Result<(), TrainError> {
    let t = &cfg.training;
    if workload == Workload::Train && t.seq_len > spec.max_seq_len {
        return Err(TrainError::Config(format!(
            "config: `training.seq_len`: {} is longer than the model's max_seq_len {}; lower training.seq_len or raise model.args.max_seq_len",
            t.seq_len, spec.max_seq_len
        )));
    }
    crate::memory::check(cfg, spec, workload)
}

/// The corpus files under `data.path`, each readable (see [`anneal_data::check_files`]).
pub fn data(cfg: &JobConfig) -> Result<Vec<PathBuf>, TrainError> {
    if !cfg.data.sources.is_empty() {
        return mixture(cfg);
    }
    let path = PathBuf::from(&cfg.data.path);
    if tokens_format(cfg) {
        return token_files(cfg);
    }
    let files =
        anneal_data::discover_files(&path).map_err(|e| TrainError::from(e).at("data.path"))?;
    container(cfg, &path, &files)?;
    let kind = data_kind(cfg, &files);
    preference_data(cfg, kind)?;
    let chat = matches!(kind, DataKind::Chat | DataKind::Preference);
    if chat && cfg.data.streaming {
        return Err(TrainError::Config(
            "config: `data.streaming` = true: streaming reads text documents; chat \
             conversations are read at start (drop data.streaming)"
                .into(),
        ));
    }
    if !chat {
        anneal_data::check_files(&files, &cfg.data.text_field)
            .map_err(|e| TrainError::from(e).at("data.path"))?;
    }
    if cfg.data.pack {
        packing(cfg, chat)?;
    }
    Ok(files)
}

/// The files of `data.format = "parquet"` are Parquet files; `data.format = "hf_dataset"`
/// names a folder saved by Hugging Face `datasets`.
fn container(cfg: &JobConfig, path: &std::path::Path, files: &[PathBuf]) -> Result<(), TrainError> {
    use anneal_config::DataFormat;
    let refuse = |what: String| {
        Err(TrainError::Config(format!(
            "config: `data.path`: {what} (data.format = \"{}\")",
            match cfg.data.format {
                DataFormat::Parquet => "parquet",
                _ => "hf_dataset",
            }
        )))
    };
    match cfg.data.format {
        DataFormat::Parquet => match files.iter().find(|f| {
            !f.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
        }) {
            Some(f) => refuse(format!("{} is not a .parquet file", f.display())),
            None => Ok(()),
        },
        DataFormat::HfDataset if !anneal_data::records::is_hf_dataset(path) => refuse(format!(
            "{} is not a dataset saved by `datasets` (no dataset_info.json and state.json, \
             nor dataset_dict.json)",
            path.display()
        )),
        _ => Ok(()),
    }
}

/// Preference pairs and a preference loss go together; pairs are never packed.
fn preference_data(cfg: &JobConfig, kind: DataKind) -> Result<(), TrainError> {
    let pairs = kind == DataKind::Preference;
    let refuse = |m: &str| Err(TrainError::Config(format!("config: {m}")));
    match (pairs, cfg.preference.on()) {
        (true, false) => refuse(
            "`preference.loss`: the data holds preference pairs (prompt, chosen, rejected); \
             set preference.loss = \"dpo\" or \"simpo\"",
        ),
        (false, true) => refuse(
            "`preference.loss` needs preference pairs: JSON lines (or Parquet) of \
             {\"prompt\", \"chosen\", \"rejected\"} (data.format = \"preference\")",
        ),
        (true, true) if cfg.data.pack => {
            refuse("`data.pack` = true: preference pairs take a row per completion; drop data.pack")
        }
        _ => Ok(()),
    }
}

/// `data.pack` needs chat data, and a layout whose attention sees whole rows.
fn packing(cfg: &JobConfig, chat: bool) -> Result<(), TrainError> {
    if !chat {
        return Err(TrainError::Config(
            "config: `data.pack` = true: packing applies to chat data (text documents are \
             already packed into windows); set data.format = \"chat\" or drop data.pack"
                .into(),
        ));
    }
    let p = &cfg.parallelism;
    for (key, n) in [("pp", p.pp), ("cp", p.cp)] {
        if n > 1 {
            return Err(TrainError::Config(format!(
                "config: `data.pack` = true with `parallelism.{key}` = {n}: packed \
                 conversations train single-process, under DDP, FSDP or TP; not yet with \
                 {key} > 1"
            )));
        }
    }
    Ok(())
}

/// The text files of every source of a mixture (`[[data.sources]]`), each source checked as
/// `data.path` would be (errors keyed `data.sources[i].path`); chat sources are refused.
fn mixture(cfg: &JobConfig) -> Result<Vec<PathBuf>, TrainError> {
    if cfg.data.pack {
        packing(cfg, false)?;
    }
    if cfg.data.streaming {
        return Err(TrainError::Config(
            "config: `data.streaming` = true with `data.sources`: a mixture's text sources are \
             tokenized at start; streaming reads one text corpus (data.path), and token files \
             are read in place already"
                .into(),
        ));
    }
    let mut files = Vec::new();
    for (i, source) in cfg.data.sources.iter().enumerate() {
        let one = source_config(cfg, i);
        let found = data(&one).map_err(|e| in_source(e, i))?;
        match data_kind(&one, &found) {
            DataKind::Chat | DataKind::Preference => {
                return Err(TrainError::Config(format!(
                    "config: `data.sources[{i}].path`: {} holds conversations; a mixture mixes \
                     text and token sources, not chat data",
                    source.path
                )))
            }
            DataKind::Text => files.extend(found),
            DataKind::Tokens => {}
        }
    }
    Ok(files)
}

/// `cfg` with the `i`-th source of its mixture as its only data.
pub fn source_config(cfg: &JobConfig, i: usize) -> JobConfig {
    let mut one = cfg.clone();
    let source = &cfg.data.sources[i];
    one.data.path = source.path.clone();
    one.data.format = source.format;
    one.data.sources = Vec::new();
    one
}

/// `e` about `data.path` as about the `i`-th source's path.
fn in_source(e: TrainError, i: usize) -> TrainError {
    let key = format!("data.sources[{i}].path");
    match e {
        TrainError::At { key: k, source } if k == "data.path" => TrainError::At { key, source },
        TrainError::Config(m) => TrainError::Config(m.replace("`data.path`", &format!("`{key}`"))),
        e => e,
    }
}

/// What the data of a run is, `data.format` resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataKind {
    /// Documents packed into windows.
    Text,
    /// Conversations.
    Chat,
    /// Pre-tokenized ids read in place.
    Tokens,
    /// Preference pairs (`prompt`, `chosen`, `rejected`).
    Preference,
}

/// What `files` (under `data.path`) are read as: `data.format`, or for `auto` what they look
/// like.
pub fn data_kind(cfg: &JobConfig, files: &[PathBuf]) -> DataKind {
    use anneal_config::DataFormat;
    match cfg.data.format {
        _ if tokens_format(cfg) => DataKind::Tokens,
        DataFormat::Chat => DataKind::Chat,
        DataFormat::Text => DataKind::Text,
        DataFormat::Preference => DataKind::Preference,
        // Auto, and the containers of any.
        _ if anneal_data::preference::looks_like_pairs(files) => DataKind::Preference,
        _ if anneal_data::chat::looks_like_chat(files) => DataKind::Chat,
        _ => DataKind::Text,
    }
}

/// Whether `data.path` is read as token files (`data.format = "tokens"`, or for `auto` a
/// `.bin` / `.idx` path or a folder of `.bin` files).
fn tokens_format(cfg: &JobConfig) -> bool {
    match cfg.data.format {
        anneal_config::DataFormat::Tokens => true,
        anneal_config::DataFormat::Auto => {
            anneal_data::tokens::looks_like_tokens(std::path::Path::new(&cfg.data.path))
        }
        _ => false,
    }
}

/// The training token files under `data.path`, each opened and its layout checked (not its
/// ids, read as training goes); they need the tokenizer that made them.
fn token_files(cfg: &JobConfig) -> Result<Vec<PathBuf>, TrainError> {
    let d = &cfg.data;
    if d.tokenizer == "train" {
        return Err(TrainError::Config(
            "config: `data.tokenizer` = \"train\": token files need the tokenizer that made \
             their ids; set data.tokenizer to its tokenizer.json (or start from \
             checkpoint.init_from_hf)"
                .into(),
        ));
    }
    if d.pack {
        packing(cfg, false)?;
    }
    let path = std::path::Path::new(&d.path);
    let at = |e: anneal_data::DataError| TrainError::from(e).at("data.path");
    let (train, val) = anneal_data::tokens::discover_token_files(path).map_err(at)?;
    let raw = raw_width(d.token_dtype);
    for files in [&train, &val] {
        anneal_data::tokens::TokenFiles::open(files, raw, usize::MAX).map_err(at)?;
    }
    Ok(train)
}

/// How ids are stored in token files without a header (`data.token_dtype`).
pub fn raw_width(dtype: anneal_config::TokenDtype) -> anneal_data::tokens::Width {
    match dtype {
        anneal_config::TokenDtype::Uint16 => anneal_data::tokens::Width::U16,
        anneal_config::TokenDtype::Uint32 => anneal_data::tokens::Width::U32,
    }
}

/// A tokenizer of `tokens` tokens (from `what`) must fit the model's embeddings.
pub fn vocab(spec: &ModelSpec, tokens: usize, what: &str) -> Result<(), TrainError> {
    if tokens <= spec.vocab_size {
        return Ok(());
    }
    Err(TrainError::Config(format!(
        "config: `model.args.vocab_size`: the model has {} embeddings but the tokenizer ({what}) has {tokens} tokens; set model.args.vocab_size to at least {tokens}",
        spec.vocab_size
    )))
}

/// `e` about the plugin of `section` (`model` or `optimizer`), under the key that chose what
/// failed. A message that already names its key (`model.plugin` from a Hugging Face
/// directory's `model_type`) stays as it is.
fn keyed(e: TrainError, section: &str, args: &anneal_config::PluginArgs) -> TrainError {
    let key = match &e {
        TrainError::Plugin(PluginError::Create { msg, .. }) => args_key(section, msg, args),
        TrainError::Plugin(_) => format!("{section}.plugin"),
        _ => return e,
    };
    e.at(&key)
}

/// The key a plugin's refusal of its flavor or arguments is about.
fn args_key(section: &str, msg: &str, args: &anneal_config::PluginArgs) -> String {
    // The SDK says which call failed first.
    let msg = msg.strip_prefix("create: ").unwrap_or(msg);
    if msg.starts_with("unknown flavor") {
        return format!("{section}.flavor");
    }
    // `bad plugin arguments: betas[1]: ...` (the SDK's deserializer names the path).
    let named = msg.strip_prefix("bad plugin arguments: ").unwrap_or(msg);
    let word: String = named
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    match args.contains_key(&word) {
        true => format!("{section}.args.{word}"),
        false => format!("{section}.args"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plugin_refusal_names_the_argument_the_config_sets() {
        let mut args = anneal_config::PluginArgs::new();
        args.insert("first_k_dense".into(), 4.into());
        args.insert("betas".into(), serde_json::json!([0.9, "x"]));
        let key = |msg: &str| args_key("model", msg, &args);
        assert_eq!(
            key("first_k_dense (x) = 4 makes all"),
            "model.args.first_k_dense"
        );
        assert_eq!(
            key("bad plugin arguments: betas[1]: invalid type"),
            "model.args.betas"
        );
        assert_eq!(key("n_layers must be at least 1"), "model.args");
        assert_eq!(key("create: unknown flavor 'x' (known: a)"), "model.flavor");
        assert_eq!(
            key("create: first_k_dense (x) = 4"),
            "model.args.first_k_dense"
        );
    }

    #[test]
    fn key_paths_come_from_the_message_or_the_wrapper() {
        let e = TrainError::Config("config: `training.seq_len`: too long".into());
        assert_eq!(e.key_path().as_deref(), Some("training.seq_len"));
        let e = TrainError::Config("memory: the run needs".into());
        assert_eq!(e.key_path(), None);
        let e = TrainError::Config("config: `parallelism.tp` = 3 with x".into()).at("job.device");
        assert_eq!(e.key_path().as_deref(), Some("job.device"));
        assert!(e
            .to_string()
            .starts_with("config: `job.device`: config: `parallelism.tp`"));
        assert!(e.is_user_error());
    }
}
