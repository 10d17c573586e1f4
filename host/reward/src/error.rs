//! Typed errors: what a single scoring call can end with, and why a module could not be loaded.

use serde::Serialize;
use std::path::PathBuf;

/// The kind of a failed scoring call, as counted in metrics and printed by the CLI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The call ran past its wall-clock deadline (epoch interruption).
    Timeout,
    /// The call used up its fuel budget (deterministic instruction count).
    FuelExhausted,
    /// The module tried to grow a memory or table past the configured limit.
    MemoryLimit,
    /// The module trapped (`unreachable`, out-of-bounds access, stack overflow, exit, ...).
    Trap,
    /// The module returned something the ABI does not allow (NaN, bad details, bad pointers).
    BadOutput,
    /// The module does not export what the ABI requires, or with the wrong signature.
    AbiMismatch,
    /// An environment module reported an error of its own (`init` or `step` returned an error
    /// result, e.g. a task it cannot run).
    EnvError,
    /// A step was asked of an episode that is already over (it failed earlier, or the
    /// environment said it was done). Nothing ran; such calls are not counted in metrics.
    EpisodeOver,
}

impl ErrorKind {
    /// Every kind, in a fixed order (the order of the metrics counters).
    pub const ALL: [ErrorKind; 8] = [
        ErrorKind::Timeout,
        ErrorKind::FuelExhausted,
        ErrorKind::MemoryLimit,
        ErrorKind::Trap,
        ErrorKind::BadOutput,
        ErrorKind::AbiMismatch,
        ErrorKind::EnvError,
        ErrorKind::EpisodeOver,
    ];

    /// The snake_case name used in JSON output and metrics (`fuel_exhausted`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Timeout => "timeout",
            ErrorKind::FuelExhausted => "fuel_exhausted",
            ErrorKind::MemoryLimit => "memory_limit",
            ErrorKind::Trap => "trap",
            ErrorKind::BadOutput => "bad_output",
            ErrorKind::AbiMismatch => "abi_mismatch",
            ErrorKind::EnvError => "env_error",
            ErrorKind::EpisodeOver => "episode_over",
        }
    }

    /// The position of this kind in [`ErrorKind::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why one call into a module (a reward's `score`, an environment's `init` or `step`) did not
/// produce a result.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CallError {
    /// The wall-clock deadline passed.
    #[error("timeout: the call ran past its deadline of {timeout_ms} ms")]
    Timeout {
        /// The configured deadline.
        timeout_ms: u64,
    },
    /// The fuel budget ran out.
    #[error("fuel_exhausted: the call used up its budget of {fuel} fuel")]
    FuelExhausted {
        /// The configured budget.
        fuel: u64,
    },
    /// A memory or table grew past the limit.
    #[error("memory_limit: {message}")]
    MemoryLimit {
        /// What was being grown, and to what size.
        message: String,
    },
    /// The module trapped.
    #[error("trap: {message}")]
    Trap {
        /// The trap's description, e.g. "wasm `unreachable` instruction executed".
        message: String,
    },
    /// The module returned something the ABI does not allow.
    #[error("bad_output: {reason}")]
    BadOutput {
        /// What was wrong with it.
        reason: String,
    },
    /// The module's exports do not match the ABI.
    #[error("abi_mismatch: {reason}")]
    AbiMismatch {
        /// Which export is missing or has the wrong type.
        reason: String,
    },
    /// An episode used up its total fuel budget (over several calls); kind `fuel_exhausted`.
    #[error("fuel_exhausted: the episode used up its budget of {fuel} fuel")]
    EpisodeFuelExhausted {
        /// The episode's budget ([`crate::EpisodeLimits::episode_fuel`]).
        fuel: u64,
    },
    /// An episode's calls together ran past its wall-clock budget; kind `timeout`.
    #[error("timeout: the episode's calls ran past its budget of {timeout_ms} ms")]
    EpisodeTimeout {
        /// The episode's budget ([`crate::EpisodeLimits::episode_timeout`]).
        timeout_ms: u64,
    },
    /// The environment returned an error result from `init` or `step`.
    #[error("env_error: the environment reported: {message}")]
    Env {
        /// The environment's message.
        message: String,
    },
    /// The episode is already over: nothing was run.
    #[error("episode_over: {reason}")]
    EpisodeOver {
        /// Why it is over (the error that ended it, or that the environment said done).
        reason: String,
    },
}

impl CallError {
    /// The kind of this error (its metrics counter).
    pub fn kind(&self) -> ErrorKind {
        match self {
            CallError::Timeout { .. } => ErrorKind::Timeout,
            CallError::FuelExhausted { .. } => ErrorKind::FuelExhausted,
            CallError::MemoryLimit { .. } => ErrorKind::MemoryLimit,
            CallError::Trap { .. } => ErrorKind::Trap,
            CallError::BadOutput { .. } => ErrorKind::BadOutput,
            CallError::AbiMismatch { .. } => ErrorKind::AbiMismatch,
            CallError::EpisodeFuelExhausted { .. } => ErrorKind::FuelExhausted,
            CallError::EpisodeTimeout { .. } => ErrorKind::Timeout,
            CallError::Env { .. } => ErrorKind::EnvError,
            CallError::EpisodeOver { .. } => ErrorKind::EpisodeOver,
        }
    }

    /// The detail text without the kind prefix (the trap message, the reason, ...).
    pub fn message(&self) -> String {
        match self {
            CallError::Timeout { timeout_ms } => format!("ran past {timeout_ms} ms"),
            CallError::FuelExhausted { fuel } => format!("used up {fuel} fuel"),
            CallError::MemoryLimit { message } => message.clone(),
            CallError::Trap { message } => message.clone(),
            CallError::BadOutput { reason } => reason.clone(),
            CallError::AbiMismatch { reason } => reason.clone(),
            CallError::EpisodeFuelExhausted { fuel } => {
                format!("the episode used up its {fuel} fuel")
            }
            CallError::EpisodeTimeout { timeout_ms } => {
                format!("the episode ran past {timeout_ms} ms")
            }
            CallError::Env { message } => message.clone(),
            CallError::EpisodeOver { reason } => reason.clone(),
        }
    }
}

/// What a module is loaded as: the ABI its exports are checked against, and the word used in
/// load errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModuleRole {
    /// A reward module (`reward-wasm/README.md`).
    Reward,
    /// An environment module (`reward-wasm/ENVIRONMENTS.md`).
    Environment,
}

impl std::fmt::Display for ModuleRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ModuleRole::Reward => "reward",
            ModuleRole::Environment => "environment",
        })
    }
}

/// Why a reward or environment module could not be loaded, or the sandbox could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The module file could not be read.
    #[error("cannot read {role} module {path}: {error}")]
    Io {
        /// What the module was loaded as.
        role: ModuleRole,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
    /// The module is larger than the sandbox loads ([`crate::SandboxConfig::max_module_bytes`]).
    #[error(
        "{role} module {name} is {bytes} bytes, over the limit of {max} bytes ({} MiB)",
        max >> 20
    )]
    TooLarge {
        /// What the module was loaded as.
        role: ModuleRole,
        /// The file (or the caller-given label).
        name: String,
        /// Its size.
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// The bytes are neither WebAssembly text nor a valid module or component.
    #[error("invalid {role} module {name}: {message}")]
    Invalid {
        /// What the module was loaded as.
        role: ModuleRole,
        /// The module's name (file name or caller-given label).
        name: String,
        /// The parser's or validator's message.
        message: String,
    },
    /// The module imports something the sandbox does not grant.
    #[error("{role} module {name} imports `{import}`, which the sandbox does not grant")]
    DisallowedImport {
        /// What the module was loaded as.
        role: ModuleRole,
        /// The module's name.
        name: String,
        /// The import, as `module::name` for core modules or the interface name for components.
        import: String,
    },
    /// The module's imports could not be linked (e.g. a WASI function with the wrong signature).
    #[error("cannot link {role} module {name}: {message}")]
    Link {
        /// What the module was loaded as.
        role: ModuleRole,
        /// The module's name.
        name: String,
        /// The linker's message.
        message: String,
    },
    /// The engine could not be created with the requested configuration.
    #[error("cannot set up the reward sandbox: {message}")]
    Engine {
        /// The engine's message.
        message: String,
    },
}
