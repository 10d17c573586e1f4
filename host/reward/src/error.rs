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
}

impl ErrorKind {
    /// Every kind, in a fixed order (the order of the metrics counters).
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::Timeout,
        ErrorKind::FuelExhausted,
        ErrorKind::MemoryLimit,
        ErrorKind::Trap,
        ErrorKind::BadOutput,
        ErrorKind::AbiMismatch,
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

/// Why one scoring call did not produce a score.
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
        }
    }
}

/// Why a reward module could not be loaded, or the sandbox could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The module file could not be read.
    #[error("cannot read reward module {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
    /// The module is larger than the sandbox loads ([`crate::SandboxConfig::max_module_bytes`]).
    #[error(
        "reward module {name} is {bytes} bytes, over the limit of {max} bytes ({} MiB)",
        max >> 20
    )]
    TooLarge {
        /// The file (or the caller-given label).
        name: String,
        /// Its size.
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// The bytes are neither WebAssembly text nor a valid module or component.
    #[error("invalid reward module {name}: {message}")]
    Invalid {
        /// The module's name (file name or caller-given label).
        name: String,
        /// The parser's or validator's message.
        message: String,
    },
    /// The module imports something the sandbox does not grant.
    #[error("reward module {name} imports `{import}`, which the sandbox does not grant")]
    DisallowedImport {
        /// The module's name.
        name: String,
        /// The import, as `module::name` for core modules or the interface name for components.
        import: String,
    },
    /// The module's imports could not be linked (e.g. a WASI function with the wrong signature).
    #[error("cannot link reward module {name}: {message}")]
    Link {
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
