//! Limits and grants of the sandbox.

use std::path::PathBuf;
use std::time::Duration;

/// The largest reward module loaded, in bytes, by default: what `anneal serve` accepts as an
/// upload (`--max-upload-mb`) and what [`crate::Sandbox::load_file`] reads (`anneal reward
/// test`, `anneal rl`). Parsing and compiling take a few times a module's size in memory.
pub const MAX_MODULE_BYTES: usize = 64 << 20;

/// How every scoring call is limited, and what it gets when it fails.
#[derive(Clone, Debug)]
pub struct SandboxConfig {
    /// Fuel per call (roughly one unit per executed WASM instruction). Deterministic: the same
    /// module and input use the same fuel on every machine.
    pub fuel: u64,
    /// Wall-clock deadline per call, enforced by epoch interruption (a backstop for host calls
    /// and for modules that are slow per instruction).
    pub timeout: Duration,
    /// The largest size any one linear memory of a call may reach, in bytes.
    pub memory_bytes: usize,
    /// The largest number of elements any one table of a call may reach.
    pub table_elements: usize,
    /// The reward given for a call that fails (any [`crate::ErrorKind`]).
    pub error_reward: f64,
    /// Worker threads for [`crate::Sandbox::score_batch`]; 0 means one per available core.
    pub threads: usize,
    /// How often the epoch ticker thread advances the engine's epoch; the deadline is
    /// accurate to about one tick.
    pub epoch_tick: Duration,
    /// Where compiled modules are cached on disk (by content hash and engine configuration);
    /// `None` keeps the cache in memory only.
    pub cache_dir: Option<PathBuf>,
    /// What the module may reach outside its own memory.
    pub grants: Grants,
    /// The largest module loaded, in bytes (a file is checked before it is read).
    pub max_module_bytes: usize,
}

impl SandboxConfig {
    /// The per-call fuel and deadline of this configuration.
    pub fn call_limits(&self) -> CallLimits {
        CallLimits {
            fuel: self.fuel,
            timeout: self.timeout,
        }
    }
}

/// The fuel and wall-clock deadline of one call. [`crate::Sandbox::score`] uses the configured
/// ones; a caller with a budget across many calls (the server's reward test) passes smaller
/// ones to [`crate::Sandbox::score_within`] so that no single call can overrun it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallLimits {
    /// Fuel for the call.
    pub fuel: u64,
    /// Wall-clock deadline of the call (accurate to about one epoch tick).
    pub timeout: Duration,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            fuel: 1_000_000_000,
            timeout: Duration::from_secs(2),
            memory_bytes: 256 << 20,
            table_elements: 1_000_000,
            error_reward: 0.0,
            threads: 0,
            epoch_tick: Duration::from_millis(1),
            cache_dir: None,
            grants: Grants::default(),
            max_module_bytes: MAX_MODULE_BYTES,
        }
    }
}

/// Capabilities a reward module may use. The default grants nothing but deny-all WASI stubs:
/// a module may import WASI (Go, componentize-py and componentize-js modules do), but it sees
/// no files, no sockets, no environment, no arguments, a deterministic virtual clock (starting at
/// 2000-01-01T00:00:00Z, advancing 1 µs per reading) and deterministic random bytes; its stdout
/// and stderr are discarded. WASI sleeps always return at once (even with clocks granted): a
/// blocked host call could not be stopped by the epoch deadline.
#[derive(Clone, Debug)]
pub struct Grants {
    /// Link WASI (preview 1 for core modules, preview 2 for components) as deny-all stubs.
    /// When false, a module importing WASI fails to load.
    pub wasi: bool,
    /// Give the module the host's real wall and monotonic clocks (otherwise a deterministic
    /// virtual clock).
    pub clocks: bool,
    /// Give the module the host's real random generator (otherwise a fixed byte cycle).
    pub random: bool,
    /// Forward the module's stdout and stderr to the host's (otherwise discarded).
    pub stdio: bool,
    /// Environment variables the module may read.
    pub env: Vec<(String, String)>,
    /// Host directories the module may read, as `(host path, guest path)`; read-only.
    pub read_dirs: Vec<(PathBuf, String)>,
    /// Allow TCP, UDP and name lookups (components only; preview 1 has no sockets).
    pub network: bool,
}

impl Default for Grants {
    fn default() -> Self {
        Grants {
            wasi: true,
            clocks: false,
            random: false,
            stdio: false,
            env: Vec::new(),
            read_dirs: Vec::new(),
            network: false,
        }
    }
}
