//! Job configs for Anneal.
//!
//! A config is composed in layers, each overriding the one before:
//! built-in defaults < a TOML file < `ANNEAL_<SECTION>__<KEY>` environment variables <
//! `--set section.key=value` overrides (in order). The result is a typed [`JobConfig`]; unknown
//! keys, wrong types and bad values fail with a [`ConfigError`] that names the key path and the
//! layer it came from.

mod schema;
mod tuning;

pub use schema::*;
pub use tuning::*;

use figment::providers::{Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use std::path::Path;

/// Where the TOML layer comes from.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// A file on disk (must exist).
    File(&'a Path),
    /// TOML text, with a name used in errors (an upload, a form field).
    Text {
        /// The TOML text.
        text: &'a str,
        /// What to call it in errors.
        name: &'a str,
    },
    /// No file: defaults, environment and overrides only.
    Defaults,
}

/// A config that cannot be used. `Display` is one line: the key path, what is wrong, where it
/// came from.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{}", self.line())]
pub struct ConfigError {
    /// Dotted key path (`training.steps`), when the error is about one key.
    pub key_path: Option<String>,
    /// What is wrong.
    pub message: String,
    /// The layer that supplied the value: a file path, an environment variable, `--set ...`.
    pub origin: Option<String>,
}

impl ConfigError {
    fn at(key: &str, message: impl Into<String>) -> Self {
        ConfigError {
            key_path: Some(key.to_string()),
            message: message.into(),
            origin: None,
        }
    }

    fn line(&self) -> String {
        let mut s = String::from("config: ");
        if let Some(k) = &self.key_path {
            s.push_str(&format!("`{k}`: "));
        }
        s.push_str(&self.message);
        if let Some(o) = &self.origin {
            s.push_str(&format!(" (from {o})"));
        }
        s
    }
}

/// The top-level sections; environment variables are only read for these.
pub const SECTIONS: &[&str] = &[
    "job",
    "model",
    "optimizer",
    "lr_scheduler",
    "training",
    "parallelism",
    "checkpoint",
    "activation_checkpoint",
    "data",
    "metrics",
    "rl",
    "fault_tolerance",
];

/// Composes a config from `source`, the process environment and `overrides`
/// (`"section.key=value"`, values parsed as TOML, else taken as strings), then validates it.
pub fn resolve(source: Source, overrides: &[String]) -> Result<JobConfig, ConfigError> {
    let env: Vec<(String, String)> = std::env::vars().collect();
    resolve_with_env(source, overrides, &env)
}

/// [`resolve`] with an explicit environment (tests, and servers validating on a user's behalf).
pub fn resolve_with_env(
    source: Source,
    overrides: &[String],
    env: &[(String, String)],
) -> Result<JobConfig, ConfigError> {
    let mut fig = Figment::from(Serialized::defaults(JobConfig::default()));
    fig = match source {
        Source::File(path) => {
            if !path.is_file() {
                return Err(ConfigError {
                    key_path: None,
                    message: format!("no config file at {}", path.display()),
                    origin: None,
                });
            }
            fig.merge(Toml::file_exact(path))
        }
        Source::Text { text, name } => fig.merge(Named {
            inner: Toml::string(text),
            name: name.to_string(),
        }),
        Source::Defaults => fig,
    };
    fig = fig.merge(env_layer(env)?);
    for raw in overrides {
        fig = fig.merge(SetOverride::parse(raw)?);
    }
    let cfg: JobConfig = fig.extract().map_err(from_figment)?;
    validate(&cfg)?;
    Ok(cfg)
}

impl JobConfig {
    /// The resolved config as TOML (what `anneal config show` prints and a run dir keeps).
    ///
    /// Every config [`resolve`] returns serializes: its plugin arguments hold no `null` (TOML
    /// has none, and a NaN or infinity, which serde_json turns into `null`, is refused there).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self)
            .expect("a resolved JobConfig serializes: validate() refuses null plugin arguments")
    }
}

/// The `ANNEAL_<SECTION>__<KEY>` variables. Other `ANNEAL_*` variables (such as
/// `ANNEAL_PLUGIN_PATH`) belong to the host and are skipped, except ones that look like a config
/// key written with a single underscore, which are refused so they are not silently ignored.
fn env_layer(env: &[(String, String)]) -> Result<Figment, ConfigError> {
    let mut dict = Dict::new();
    for (name, value) in env {
        let Some(rest) = name.strip_prefix("ANNEAL_") else {
            continue;
        };
        let lower = rest.to_ascii_lowercase();
        let parts: Vec<&str> = lower.split("__").collect();
        if !SECTIONS.contains(&parts[0]) {
            if let Some(s) = SECTIONS
                .iter()
                .find(|s| lower.starts_with(&format!("{s}_")))
            {
                return Err(ConfigError {
                    key_path: None,
                    message: format!(
                        "environment variable {name} does not name a key: separate the section with two underscores, like ANNEAL_{}__{}",
                        s.to_ascii_uppercase(),
                        rest[s.len() + 1..].to_ascii_uppercase()
                    ),
                    origin: None,
                });
            }
            continue;
        }
        let key = parts.join(".");
        let v = parse_value(value);
        let nested = figment::util::nest(&key, v);
        if let figment::value::Value::Dict(_, d) = nested {
            merge_dict(&mut dict, d);
        }
    }
    Ok(Figment::from(Named {
        inner: Serialized::defaults(dict),
        name: "ANNEAL_* environment".into(),
    }))
}

fn merge_dict(into: &mut Dict, from: Dict) {
    for (k, v) in from {
        match (into.get_mut(&k), v) {
            (Some(figment::value::Value::Dict(_, a)), figment::value::Value::Dict(_, b)) => {
                merge_dict(a, b)
            }
            (_, v) => {
                into.insert(k, v);
            }
        }
    }
}

/// Parses an override value as a TOML value (`3`, `1e-4`, `true`, `[0.9, 0.95]`, `{a = 1}`,
/// `"text"`); anything that is not valid TOML is taken as a plain string.
fn parse_value(raw: &str) -> figment::value::Value {
    let parsed: Result<toml::Table, _> = toml::from_str(&format!("v = {raw}"));
    match parsed.ok().and_then(|mut t| t.remove("v")) {
        Some(v) => figment::value::Value::serialize(v).unwrap_or_else(|_| raw.into()),
        None => raw.into(),
    }
}

/// One `--set key.path=value`.
struct SetOverride {
    raw: String,
    key: String,
    value: figment::value::Value,
}

impl SetOverride {
    fn parse(raw: &str) -> Result<Self, ConfigError> {
        let bad = |m: &str| ConfigError {
            key_path: None,
            message: format!("bad override `{raw}`: {m}"),
            origin: Some("--set".into()),
        };
        let (key, value) = raw
            .split_once('=')
            .ok_or_else(|| bad("expected section.key=value"))?;
        let key = key.trim();
        let valid = !key.is_empty()
            && key
                .split('.')
                .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        if !valid {
            return Err(bad("the key must be a dotted path like training.steps"));
        }
        Ok(SetOverride {
            raw: raw.to_string(),
            key: key.to_string(),
            value: parse_value(value.trim()),
        })
    }
}

impl Provider for SetOverride {
    fn metadata(&self) -> Metadata {
        Metadata::named(format!("--set {}", self.raw))
    }

    fn data(&self) -> figment::Result<Map<Profile, Dict>> {
        Serialized::default(&self.key, &self.value).data()
    }
}

/// A provider under a name of our choosing (shown in errors).
struct Named<P> {
    inner: P,
    name: String,
}

impl<P: Provider> Provider for Named<P> {
    fn metadata(&self) -> Metadata {
        let mut m = self.inner.metadata();
        m.name = self.name.clone().into();
        m
    }

    fn data(&self) -> figment::Result<Map<Profile, Dict>> {
        self.inner.data()
    }
}

fn from_figment(e: figment::Error) -> ConfigError {
    // figment can chain several errors; the first is the one to fix first.
    let e = e
        .into_iter()
        .next()
        .expect("a figment error holds at least one error");
    // figment's path already ends with the offending key, unknown ones included.
    let path = &e.path;
    let message = match &e.kind {
        figment::error::Kind::UnknownField(_, expected) => {
            let known = expected.join(", ");
            format!("unknown key (known keys here: {known})")
        }
        figment::error::Kind::InvalidType(found, expected) => {
            format!("wrong type: found {found}, expected {expected}")
        }
        // TOML parse errors quote the offending line over several lines (`3 | text`, a caret
        // line); keep the position and the reason, on one line.
        kind => kind
            .to_string()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !is_quoted_source(l))
            .collect::<Vec<_>>()
            .join(" "),
    };
    let origin = e.metadata.as_ref().map(|m| match &m.source {
        Some(figment::Source::File(p)) => p.display().to_string(),
        _ => m.name.to_string(),
    });
    ConfigError {
        key_path: (!path.is_empty()).then(|| path.join(".")),
        message,
        origin,
    }
}

/// A line of a TOML parse error that quotes the file: `  |`, `3 | steps = = 3`, `  |   ^`.
fn is_quoted_source(line: &str) -> bool {
    let gutter = line.split_once('|').map(|(g, _)| g.trim());
    gutter.is_some_and(|g| g.chars().all(|c| c.is_ascii_digit()))
        || line.chars().all(|c| c == '|' || c == '^' || c == ' ')
}

/// Checks that go beyond types: ranges and relations between keys.
fn validate(c: &JobConfig) -> Result<(), ConfigError> {
    validate_job_name(&c.job.name)?;
    if parse_device(&c.job.device).is_none() {
        return Err(ConfigError::at(
            "job.device",
            format!(
                "`{}` is not a device (use cpu, cuda or cuda:N)",
                c.job.device
            ),
        ));
    }
    for (key, args) in [
        ("model.args", &c.model.args),
        ("optimizer.args", &c.optimizer.args),
    ] {
        for (k, v) in args {
            finite_args(&format!("{key}.{k}"), v)?;
        }
    }
    let t = &c.training;
    if t.steps == 0 {
        return Err(ConfigError::at("training.steps", "must be at least 1"));
    }
    if t.seq_len < 2 {
        return Err(ConfigError::at("training.seq_len", "must be at least 2"));
    }
    if t.micro_batch_size == 0 {
        return Err(ConfigError::at(
            "training.micro_batch_size",
            "must be at least 1",
        ));
    }
    if t.batch_size == 0 || !t.batch_size.is_multiple_of(t.micro_batch_size) {
        return Err(ConfigError::at(
            "training.batch_size",
            format!(
                "must be a positive multiple of training.micro_batch_size ({})",
                t.micro_batch_size
            ),
        ));
    }
    if !(t.max_grad_norm >= 0.0 && t.max_grad_norm.is_finite()) {
        return Err(ConfigError::at(
            "training.max_grad_norm",
            "must be a finite number ≥ 0",
        ));
    }
    if !matches!(t.dtype.as_str(), "float32" | "f32" | "bfloat16" | "bf16") {
        return Err(ConfigError::at(
            "training.dtype",
            format!(
                "`{}` is not supported (use float32, or bfloat16 for bf16 mixed precision)",
                t.dtype
            ),
        ));
    }
    if !(c.optimizer.lr >= 0.0 && c.optimizer.lr.is_finite()) {
        return Err(ConfigError::at(
            "optimizer.lr",
            "must be a finite number ≥ 0",
        ));
    }
    let s = &c.lr_scheduler;
    if !(0.0..=1.0).contains(&s.min_lr_ratio) {
        return Err(ConfigError::at(
            "lr_scheduler.min_lr_ratio",
            "must be within [0, 1]",
        ));
    }
    if !(0.0..=1.0).contains(&s.decay_fraction) {
        return Err(ConfigError::at(
            "lr_scheduler.decay_fraction",
            "must be within [0, 1]",
        ));
    }
    let p = &c.parallelism;
    let degrees = [
        ("parallelism.dp_replicate", p.dp_replicate),
        ("parallelism.dp_shard", p.dp_shard),
        ("parallelism.tp", p.tp),
        ("parallelism.pp", p.pp),
        ("parallelism.cp", p.cp),
        ("parallelism.ep", p.ep),
    ];
    for (k, v) in degrees {
        if v == 0 || v < -1 {
            return Err(ConfigError::at(
                k,
                "must be at least 1, or -1 for the rest of the world size",
            ));
        }
    }
    if p.ep == -1 {
        return Err(ConfigError::at(
            "parallelism.ep",
            "expert parallelism borrows the ranks of dp_shard, so it takes no rest of the world size; set a degree that divides parallelism.dp_shard",
        ));
    }
    if let [(a, _), (b, _), ..] = degrees.iter().filter(|(_, v)| *v == -1).collect::<Vec<_>>()[..] {
        return Err(ConfigError::at(
            b,
            format!("{a} is already -1; only one degree may take the rest of the world size"),
        ));
    }
    // Data parallelism (replicas and shards) is what runs today; a mesh that needs the others
    // is refused before anything starts (so is -1 on them: it could resolve to more than 1).
    for (k, v) in &degrees[2..] {
        // Expert parallelism (within dp_shard, which the trainer checks), pipeline and tensor
        // parallelism (their layouts are checked against the model when it loads) and context
        // parallelism (the trainer checks seq_len against it) run.
        if *v != 1
            && !matches!(
                *k,
                "parallelism.ep" | "parallelism.pp" | "parallelism.tp" | "parallelism.cp"
            )
        {
            let what = match *k {
                "parallelism.tp" => "tensor parallelism",
                "parallelism.pp" => "pipeline parallelism",
                "parallelism.cp" => "context parallelism",
                _ => "expert parallelism",
            };
            return Err(ConfigError::at(
                k,
                format!("{what} is not implemented yet; set it to 1 (parallelism.dp_replicate and dp_shard spread the batch over processes)"),
            ));
        }
    }
    if p.tp_sequence && p.tp == 1 {
        return Err(ConfigError::at(
            "parallelism.tp_sequence",
            "sequence parallelism splits the sequence over the tensor-parallel ranks; set parallelism.tp above 1 or tp_sequence = false",
        ));
    }
    match (p.pp_schedule.as_str(), p.pp_virtual_stages) {
        ("1f1b", 1) | ("interleaved_1f1b" | "zero_bubble", 1..) | ("zbv", 2) => {}
        ("1f1b", v) => {
            return Err(ConfigError::at(
                "parallelism.pp_virtual_stages",
                format!("is {v}, but parallelism.pp_schedule = \"1f1b\" runs one stage per rank; set pp_schedule = \"interleaved_1f1b\" or pp_virtual_stages = 1"),
            ))
        }
        ("zbv", v) => {
            return Err(ConfigError::at(
                "parallelism.pp_virtual_stages",
                format!("is {v}, but parallelism.pp_schedule = \"zbv\" runs two stages per rank in V order; set pp_virtual_stages = 2"),
            ))
        }
        ("interleaved_1f1b" | "zero_bubble", _) => {
            return Err(ConfigError::at(
                "parallelism.pp_virtual_stages",
                "must be at least 1",
            ))
        }
        (other, _) => {
            return Err(ConfigError::at(
                "parallelism.pp_schedule",
                format!("unknown schedule '{other}' (1f1b, interleaved_1f1b, zero_bubble or zbv)"),
            ))
        }
    }
    if let Some(bad) = p.pp_split.iter().find(|&&n| n < 1) {
        return Err(ConfigError::at(
            "parallelism.pp_split",
            format!("holds {bad}: every pipeline stage needs at least one block"),
        ));
    }
    // Context parallelism cuts every sequence into 2·cp chunks (a head chunk and its mirror
    // per rank).
    if p.cp > 1 {
        let chunks = 2 * p.cp as usize;
        if !c.training.seq_len.is_multiple_of(chunks) {
            return Err(ConfigError::at(
                "training.seq_len",
                format!(
                    "is {}, not a multiple of 2 × parallelism.cp = {chunks}: each cp rank holds a chunk from the head and one from the tail of every sequence",
                    c.training.seq_len
                ),
            ));
        }
    }
    const GATHER_DTYPES: [&str; 6] = ["float32", "f32", "bfloat16", "bf16", "int8", "fp8_e4m3"];
    if !GATHER_DTYPES.contains(&p.fsdp_all_gather_dtype.as_str()) {
        return Err(ConfigError::at(
            "parallelism.fsdp_all_gather_dtype",
            format!(
                "unknown dtype '{}' (float32, bfloat16, int8 or fp8_e4m3)",
                p.fsdp_all_gather_dtype
            ),
        ));
    }
    if !(1..=1 << 20).contains(&p.fsdp_all_gather_block) {
        return Err(ConfigError::at(
            "parallelism.fsdp_all_gather_block",
            "must be between 1 and 1048576 values per scale",
        ));
    }
    if !(0.0..=1.0).contains(&c.activation_checkpoint.memory_budget) {
        return Err(ConfigError::at(
            "activation_checkpoint.memory_budget",
            "must be between 0 (recompute every block) and 1 (keep everything)",
        ));
    }
    if c.activation_checkpoint.every == 0 {
        return Err(ConfigError::at(
            "activation_checkpoint.every",
            "must be at least 1",
        ));
    }
    let d = &c.data;
    if d.path.is_empty() {
        return Err(ConfigError::at("data.path", "must name a file or folder"));
    }
    if !(0.0..0.5).contains(&d.val_fraction) {
        return Err(ConfigError::at(
            "data.val_fraction",
            "must be within [0, 0.5)",
        ));
    }
    if d.tokenizer == "train" && d.vocab_size < 257 {
        return Err(ConfigError::at(
            "data.vocab_size",
            "must be at least 257 (256 bytes plus the end-of-text token; 257 = bytes only)",
        ));
    }
    if d.image_min_pixels == 0 || d.image_min_pixels > d.image_max_pixels {
        return Err(ConfigError::at(
            "data.image_min_pixels",
            "must be at least 1 and at most data.image_max_pixels",
        ));
    }
    if c.metrics.log_freq == 0 {
        return Err(ConfigError::at("metrics.log_freq", "must be at least 1"));
    }
    if c.metrics.eval_freq > 0 && c.metrics.eval_batches == 0 {
        return Err(ConfigError::at(
            "metrics.eval_batches",
            "must be at least 1 when eval_freq > 0",
        ));
    }
    validate_rl(&c.rl)?;
    if c.checkpoint.keep_latest == 0 {
        return Err(ConfigError::at(
            "checkpoint.keep_latest",
            "must be at least 1",
        ));
    }
    validate_lora(&c.lora)?;
    validate_preference(c)?;
    validate_fault_tolerance(c)
}

/// A restart resumes from the newest checkpoint, so a fault-tolerant run must write them
/// during training, and must be allowed at least one restart.
fn validate_lora(l: &Lora) -> Result<(), ConfigError> {
    if l.rank == 0 {
        return Ok(());
    }
    if !(l.alpha.is_finite() && l.alpha > 0.0) {
        return Err(ConfigError::at("lora.alpha", "must be a positive number"));
    }
    if l.targets.is_empty() || l.targets.iter().any(|t| t.trim().is_empty()) {
        return Err(ConfigError::at(
            "lora.targets",
            "name the weights that get adapters (e.g. [\"q_proj\", \"v_proj\"])",
        ));
    }
    if !matches!(l.base_dtype.as_str(), "f32" | "bf16") {
        return Err(ConfigError::at(
            "lora.base_dtype",
            format!("`{}` is not f32 or bf16", l.base_dtype),
        ));
    }
    Ok(())
}

fn validate_preference(c: &JobConfig) -> Result<(), ConfigError> {
    let p = &c.preference;
    if !p.on() {
        return Ok(());
    }
    if !(p.beta.is_finite() && p.beta > 0.0) {
        return Err(ConfigError::at(
            "preference.beta",
            "must be a positive number",
        ));
    }
    if !p.gamma.is_finite() {
        return Err(ConfigError::at(
            "preference.gamma",
            "must be a finite number",
        ));
    }
    if !c.training.micro_batch_size.is_multiple_of(2) {
        return Err(ConfigError::at(
            "training.micro_batch_size",
            format!(
                "{} rows do not hold whole preference pairs (two rows each); use an even number",
                c.training.micro_batch_size
            ),
        ));
    }
    Ok(())
}

fn validate_fault_tolerance(c: &JobConfig) -> Result<(), ConfigError> {
    if !c.fault_tolerance.enabled {
        return Ok(());
    }
    if c.fault_tolerance.max_restarts == 0 {
        return Err(ConfigError::at(
            "fault_tolerance.max_restarts",
            "must be at least 1 when fault_tolerance.enabled = true",
        ));
    }
    if c.checkpoint.interval == 0 {
        return Err(ConfigError::at(
            "fault_tolerance.enabled",
            "needs checkpoint.interval > 0: a restarted job resumes from the newest checkpoint",
        ));
    }
    Ok(())
}

/// Where a job runs, as `job.device` spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceName {
    /// The host's cores.
    Cpu,
    /// CUDA device `N` (`cuda` is `cuda:0`).
    Cuda(usize),
}

/// Parses `cpu`, `cuda` or `cuda:N` (the values `job.device` and `anneal generate --device`
/// take); `None` for anything else. Whether that device exists is the engine's question.
pub fn parse_device(s: &str) -> Option<DeviceName> {
    match s {
        "cpu" => Some(DeviceName::Cpu),
        "cuda" => Some(DeviceName::Cuda(0)),
        _ => {
            let n = s.strip_prefix("cuda:")?;
            // Digits only: `cuda:+1` or `cuda: 1` are typos, not device 1.
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            n.parse().ok().map(DeviceName::Cuda)
        }
    }
}

/// The job name becomes a folder under `runs/` (`runs/<name>-<time>`), so it must not reach
/// outside it or hide there.
fn validate_job_name(name: &str) -> Result<(), ConfigError> {
    let problem = if name.is_empty() {
        Some("must not be empty")
    } else if name.contains(['/', '\\']) {
        Some("must not contain `/` or `\\`: it names a folder under runs/")
    } else if name.starts_with('.') {
        Some("must not start with `.`: it names a folder under runs/")
    } else if name.chars().any(char::is_control) {
        Some("must not contain control characters")
    } else {
        None
    };
    match problem {
        Some(p) => Err(ConfigError::at("job.name", p)),
        None => Ok(()),
    }
}

/// Refuses `null` anywhere in a plugin argument. TOML has no null, so one only comes from a
/// NaN or an infinity, which serde_json (the plugins' argument format) cannot represent.
fn finite_args(key: &str, v: &serde_json::Value) -> Result<(), ConfigError> {
    match v {
        serde_json::Value::Null => Err(ConfigError::at(
            key,
            "must be a finite number (NaN and infinity cannot be passed to a plugin)",
        )),
        serde_json::Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, x)| finite_args(&format!("{key}[{i}]"), x)),
        serde_json::Value::Object(map) => map
            .iter()
            .try_for_each(|(k, x)| finite_args(&format!("{key}.{k}"), x)),
        _ => Ok(()),
    }
}

fn validate_rl(r: &Rl) -> Result<(), ConfigError> {
    for (k, v) in [
        ("rl.group_size", r.group_size),
        ("rl.prompts_per_step", r.prompts_per_step),
        ("rl.max_new_tokens", r.max_new_tokens),
        ("rl.rollout_threads", r.rollout_threads),
        ("rl.updates_per_batch", r.updates_per_batch),
    ] {
        if v == 0 {
            return Err(ConfigError::at(k, "must be at least 1"));
        }
    }
    if r.group_size < 2 && r.loss.needs_groups() {
        return Err(ConfigError::at(
            "rl.group_size",
            format!(
                "is 1, but rl.loss = \"{}\" scores each completion against the others of its group: with one, every advantage is 0 and the policy never learns; set rl.group_size to at least 2",
                r.loss.name()
            ),
        ));
    }
    if !(r.temperature > 0.0 && r.temperature.is_finite()) {
        return Err(ConfigError::at(
            "rl.temperature",
            "must be a finite number > 0",
        ));
    }
    if !(r.top_p > 0.0 && r.top_p <= 1.0) {
        return Err(ConfigError::at("rl.top_p", "must be within (0, 1]"));
    }
    for (k, v) in [
        ("rl.clip_low", r.clip_low),
        ("rl.clip_high", r.clip_high),
        ("rl.kl_coef", r.kl_coef),
        ("rl.entropy_coef", r.entropy_coef),
        ("rl.is_correction_cap", r.is_correction_cap),
    ] {
        if !(v >= 0.0 && v.is_finite()) {
            return Err(ConfigError::at(k, "must be a finite number ≥ 0"));
        }
    }
    if r.clip_low >= 1.0 {
        return Err(ConfigError::at("rl.clip_low", "must be below 1"));
    }
    if r.is_correction_cap > 0.0 && r.is_correction_cap < 1.0 {
        return Err(ConfigError::at(
            "rl.is_correction_cap",
            "must be 0 (off) or at least 1",
        ));
    }
    if !r.error_reward.is_finite() {
        return Err(ConfigError::at(
            "rl.error_reward",
            "must be a finite number",
        ));
    }
    if r.reward_timeout_ms == 0 {
        return Err(ConfigError::at(
            "rl.reward_timeout_ms",
            "must be at least 1",
        ));
    }
    if r.max_turns == 0 {
        return Err(ConfigError::at("rl.max_turns", "must be at least 1"));
    }
    for (key, ms) in [
        ("rl.env_step_timeout_ms", r.env_step_timeout_ms),
        ("rl.env_episode_timeout_ms", r.env_episode_timeout_ms),
    ] {
        if ms == 0 {
            return Err(ConfigError::at(key, "must be at least 1"));
        }
    }
    if r.prompts_path.is_empty() && !["digits_sort", "arithmetic"].contains(&r.task.as_str()) {
        return Err(ConfigError::at(
            "rl.task",
            format!(
                "`{}` is not a built-in task (digits_sort, arithmetic), and rl.prompts_path is empty",
                r.task
            ),
        ));
    }
    for (i, w) in r.rewards.iter().enumerate() {
        if !w.weight.is_finite() {
            return Err(ConfigError::at(
                &format!("rl.rewards[{i}].weight"),
                "must be a finite number",
            ));
        }
    }
    Ok(())
}
