//! Multi-turn RL environments as WebAssembly modules (`reward-wasm/ENVIRONMENTS.md`).
//!
//! An environment module is loaded once ([`Sandbox::load_env_file`]) and instantiated once per
//! episode ([`Sandbox::start_episode`], which calls its `init` with the task). The instance
//! keeps its state across the policy's turns: each [`Episode::step`] hands it one turn (a JSON
//! object: the host's parse of the policy's text, `anneal_data::chat::tools`) and gets back an observation, a reward and whether the episode is
//! done. Every call runs under the step's fuel and deadline, cut to what is left of the
//! episode's totals ([`EpisodeLimits`]); the first error ends the episode.
//!
//! Two ABIs, as for rewards: core modules exporting `env_init` / `env_step` (JSON in, JSON out
//! through `output_ptr` / `output_len`), and components of the WIT world
//! `anneal:environment/environment` (`reward-wasm/wit/environment/environment.wit`).

mod component;
mod core;
mod episode;
mod output;

pub use episode::Episode;

use crate::error::{CallError, LoadError, ModuleRole};
use crate::module::{hex, Compiled, ModuleKind};
use crate::sandbox::Sandbox;
use crate::state::{ComponentState, CoreState};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use wasmtime::InstancePre;

/// The budgets of one episode: each call (`init`, a `step`, `close`) gets the step's fuel and
/// deadline, cut to what is left of the episode's totals, which count every call's fuel and the
/// wall-clock time spent inside the module (not the time between calls, when the policy
/// generates).
#[derive(Clone, Copy, Debug)]
pub struct EpisodeLimits {
    /// Fuel of one call (instantiation and `init` together are one call).
    pub step_fuel: u64,
    /// Wall-clock deadline of one call (accurate to about one epoch tick).
    pub step_timeout: Duration,
    /// Fuel of all calls of the episode together.
    pub episode_fuel: u64,
    /// Wall-clock time of all calls of the episode together.
    pub episode_timeout: Duration,
    /// The largest output of one call, in bytes: the output JSON of a core module (refused as
    /// `bad_output` from its length, before it is read), or the strings of a component's
    /// result together (checked once lifted: wasmtime frees them in the component before the
    /// call returns).
    pub max_output_bytes: usize,
}

impl Default for EpisodeLimits {
    /// 10⁹ fuel and 2 s per call, 10¹⁰ fuel and 30 s per episode, 64 KiB per output.
    fn default() -> Self {
        EpisodeLimits {
            step_fuel: 1_000_000_000,
            step_timeout: Duration::from_secs(2),
            episode_fuel: 10_000_000_000,
            episode_timeout: Duration::from_secs(30),
            max_output_bytes: 64 << 10,
        }
    }
}

/// One chat message an environment opens the episode with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvMessage {
    /// `system`, `user`, ... (any non-empty text).
    pub role: String,
    /// The message text.
    pub content: String,
}

/// What `init` returned: the conversation's first messages and the tools the policy may call.
#[derive(Clone, Debug, PartialEq)]
pub struct EpisodeStart {
    /// The first messages (an init that returned `text` gives one `user` message).
    pub messages: Vec<EnvMessage>,
    /// Tool specs in the OpenAI function format,
    /// `{"type":"function","function":{"name","description","parameters"}}`.
    pub tools: Vec<Value>,
}

/// What one step returned.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    /// The environment's answer to the turn (a tool result, feedback, ...).
    pub observation: String,
    /// The observation's chat role (`tool` unless the environment said otherwise).
    pub role: String,
    /// The reward of this step (a finite number).
    pub reward: f64,
    /// Whether the episode is over; later steps return [`CallError::EpisodeOver`].
    pub done: bool,
    /// Extra named values to log, e.g. `{"correct": true}`.
    pub details: Option<Map<String, Value>>,
}

impl StepOutcome {
    /// The outcome as one JSON object: `observation`, `role`, `reward`, `done`, `details`.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "observation": self.observation,
            "role": self.role,
            "reward": self.reward,
            "done": self.done,
            "details": self.details,
        })
    }
}

/// A compiled, linked environment module, ready to start episodes. Cheap to clone.
#[derive(Clone)]
pub struct EnvModule {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    hash: String,
    abi_problem: Option<String>,
    kind: Kind,
}

/// The compiled form of each ABI.
pub(crate) enum Kind {
    Core {
        pre: InstancePre<CoreState>,
        wasi: bool,
    },
    Component {
        pre: wasmtime::component::InstancePre<ComponentState>,
        exports: component::Exports,
    },
}

impl EnvModule {
    fn new(name: &str, hash: &[u8; 32], compiled: Compiled) -> Self {
        let (abi_problem, kind) = match compiled {
            Compiled::Core { module, pre, wasi } => {
                (core::check_abi(&module).err(), Kind::Core { pre, wasi })
            }
            Compiled::Component { component, pre } => {
                let exports = component::Exports::find(&component);
                (exports.problem(), Kind::Component { pre, exports })
            }
        };
        EnvModule {
            inner: Arc::new(Inner {
                name: name.to_string(),
                hash: hex(hash),
                abi_problem,
                kind,
            }),
        }
    }

    /// The name given at load (the file name for [`Sandbox::load_env_file`]).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The SHA-256 of the module's binary, in hex.
    pub fn hash(&self) -> &str {
        &self.inner.hash
    }

    /// Which ABI the module follows.
    pub fn kind(&self) -> ModuleKind {
        match self.inner.kind {
            Kind::Core { .. } => ModuleKind::Core,
            Kind::Component { .. } => ModuleKind::Component,
        }
    }

    /// Why the module's exports do not match the environment ABI, if they do not; every
    /// episode of such a module fails to start with `abi_mismatch`.
    pub fn abi_problem(&self) -> Option<&str> {
        self.inner.abi_problem.as_deref()
    }
}

impl std::fmt::Debug for EnvModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvModule")
            .field("name", &self.inner.name)
            .field("kind", &self.kind())
            .field("hash", &self.inner.hash)
            .finish()
    }
}

impl Sandbox {
    /// Loads an environment module or component from a file (`.wasm` binary or `.wat` text);
    /// a file over [`crate::SandboxConfig::max_module_bytes`] is refused from its size.
    pub fn load_env_file(&self, path: &Path) -> Result<EnvModule, LoadError> {
        let (name, bytes) = self.read_module_file(ModuleRole::Environment, path)?;
        self.load_env_bytes(&name, &bytes)
    }

    /// Loads an environment module or component from bytes (binary or WebAssembly text),
    /// compiled once per content hash (the cache is shared with reward modules).
    pub fn load_env_bytes(&self, name: &str, bytes: &[u8]) -> Result<EnvModule, LoadError> {
        let (compiled, hash) = self.compile(ModuleRole::Environment, name, bytes)?;
        Ok(EnvModule::new(name, &hash, compiled))
    }

    /// Instantiates the module for one episode and calls its `init` with `task` (as JSON
    /// text), under the step limits (cut to the episode's). The episode owns the instance;
    /// an error here is counted in [`Sandbox::metrics`] like every call's.
    pub fn start_episode(
        &self,
        module: &EnvModule,
        task: &Value,
        limits: EpisodeLimits,
    ) -> Result<(Episode, EpisodeStart), CallError> {
        if let Some(reason) = &module.inner.abi_problem {
            let e = CallError::AbiMismatch {
                reason: reason.clone(),
            };
            self.metrics.record(Some(e.kind()), 0, 0);
            return Err(e);
        }
        Episode::start(self, module, &task.to_string(), limits)
    }
}
