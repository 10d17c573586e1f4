//! Training runs: checkpoints ([`checkpoint`]), the run harness that `anneal train` and
//! `anneal rl` share ([`harness`]: run directory, plugins, resume, saving, clipping), the
//! pretraining [`Trainer`], learning-rate schedules, metrics, and the loop behind
//! `anneal train` ([`run`]).

pub mod checkpoint;
pub mod device;
pub mod harness;
pub mod lora;
pub mod memory;
mod metrics;
pub mod outputs;
pub mod parallel;
pub mod plan;
pub mod preference;
pub mod preflight;
mod run;
mod schedule;
pub mod tensorboard;
mod trainer;

pub use metrics::{cpu_peak_tflops, measure_peak_tflops, Console, MetricsLog, MetricsRow};
pub use parallel::context::RankRing;
pub use parallel::cp::Context as CpContext;
pub use parallel::dist::{BatchSplit, Dist};
pub use parallel::fsdp::{ExpertsActive, FsdpPolicy};
pub use parallel::tp_infer::{TpActive, TpInference};
pub use run::{run, run_dist, RunSummary};
pub use schedule::LrSchedule;
pub use trainer::{Evaluation, RunFiles, StepOutcome, Trainer};

use std::path::PathBuf;

/// Why a run could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The config asks for something that cannot work (the message names the key).
    #[error("{0}")]
    Config(String),
    /// The corpus or the tokenizer.
    #[error(transparent)]
    Data(#[from] anneal_data::DataError),
    /// A plugin is missing, mismatched or failed.
    #[error(transparent)]
    Plugin(#[from] anneal_runtime::plugins::PluginError),
    /// An op failed (shapes, dtypes); a bug in a plugin or the host.
    #[error("engine: {0}")]
    Engine(#[from] anneal_engine::Error),
    /// The loss or gradient stopped being a number; nothing was applied for this step.
    #[error("step {step}: the {what} is {value}; stopping (parameters of step {} are kept, no update was applied)", step - 1)]
    NonFinite {
        /// The step that failed.
        step: u64,
        /// `loss` or `gradient norm`.
        what: &'static str,
        /// The value seen.
        value: f64,
    },
    /// Saving or loading a checkpoint.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// Another live process holds the run directory.
    #[error("{} is in use by {}; wait for it to end or pick another --run-dir", dir.display(), match pid { Some(p) => format!("process {p}"), None => "another process".to_string() })]
    RunDirBusy {
        /// The run directory.
        dir: PathBuf,
        /// The holder's pid, when it could be read.
        pid: Option<u32>,
    },
    /// The rollout workers of an RL run failed (generation or scoring), so no batch came.
    #[error("rollouts failed: {0}")]
    Rollout(String),
    /// The `[parallelism]` mesh does not fit the job's processes.
    #[error(transparent)]
    Mesh(#[from] anneal_dist::MeshError),
    /// The stages of a pipeline disagree about what they exchange (a runtime failure).
    #[error("pipeline: {0}")]
    Pipeline(String),
    /// A collective between the job's processes failed.
    #[error("distributed: {0}")]
    Dist(#[from] anneal_dist::DistError),
    /// An error about what the config key `key` names (a plugin, the data, the device).
    #[error("config: `{key}`: {source}")]
    At {
        /// The dotted key path (`model.plugin`, `data.path`).
        key: String,
        /// What went wrong there.
        #[source]
        source: Box<TrainError>,
    },
    /// Reading or writing a run file.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

impl TrainError {
    /// `self` as being about the config key `key` (which the message then names first).
    pub fn at(self, key: &str) -> TrainError {
        TrainError::At {
            key: key.to_string(),
            source: Box::new(self),
        }
    }

    /// The config key this error is about, when it names one: the key of a `config: `key`: ..`
    /// message, of a mesh that does not fit (`parallelism.*`), of the data (`data.path`, or
    /// `data.tokenizer` for a tokenizer file). What `anneal serve` reports a problem under.
    pub fn key_path(&self) -> Option<String> {
        use anneal_data::DataError as D;
        use anneal_dist::MeshError as M;
        match self {
            TrainError::At { key, .. } => Some(key.clone()),
            TrainError::Config(message) => {
                let rest = message.strip_prefix("config: `")?;
                let key = &rest[..rest.find('`')?];
                let plain = !key.is_empty()
                    && key
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '[' | ']'));
                plain.then(|| key.to_string())
            }
            TrainError::Mesh(e) => Some(match e {
                M::BadDegree { key, .. } => format!("parallelism.{key}"),
                M::TwoWildcards { second, .. } => format!("parallelism.{second}"),
                M::EpNotDividing { .. } => "parallelism.ep".into(),
                M::WorldSize { .. } => "parallelism".into(),
            }),
            TrainError::Data(D::Tokenizer { .. } | D::NoEos { .. }) => {
                Some("data.tokenizer".into())
            }
            TrainError::Data(_) => Some("data.path".into()),
            _ => None,
        }
    }

    /// Whether the user can fix this by changing the config, the data or the plugins (the CLI
    /// exits with code 2 for these).
    pub fn is_user_error(&self) -> bool {
        use crate::checkpoint::CheckpointError as C;
        match self {
            TrainError::At { source, .. } => return source.is_user_error(),
            TrainError::Plugin(p) => return p.is_user_error(),
            TrainError::Engine(e) => {
                return matches!(e, anneal_engine::Error::PluginRefused { .. });
            }
            _ => {}
        }
        matches!(
            self,
            TrainError::Config(_)
                | TrainError::Data(_)
                | TrainError::Plugin(_)
                | TrainError::RunDirBusy { .. }
                | TrainError::Mesh(_)
                | TrainError::Checkpoint(
                    C::NoneUsable { .. }
                        | C::NoSuchStep { .. }
                        | C::Mismatch(_)
                        | C::Corrupt { .. }
                )
        )
    }
}

/// Maps an IO error on `path` to [`TrainError::Io`].
pub fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}
