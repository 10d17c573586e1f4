//! The reward sandbox of Anneal: runs reward functions compiled to WebAssembly.
//!
//! A reward module scores `(prompt, completion, metadata)` and returns a number plus optional
//! details. Two ABIs are supported (see `reward-wasm/README.md`):
//! - **core modules** exporting `memory`, `alloc(len) -> ptr` and
//!   `score(p_ptr, p_len, c_ptr, c_len, m_ptr, m_len) -> f64` (optionally `details_ptr`,
//!   `details_len`, `anneal_reward_abi`), which any WASM toolchain can produce;
//! - **components** of the WIT world `anneal:reward/reward` (`reward-wasm/wit/reward.wit`).
//!
//! Every call runs in a fresh store with a fuel budget (deterministic), an epoch deadline
//! (wall-clock backstop, advanced by a ticker thread), a memory limit and deny-all WASI stubs.
//! Every call ends with a score or a typed [`CallError`]; failures get the configured error
//! reward and are counted per [`ErrorKind`] in [`Metrics`]. A [`RewardSet`] combines several
//! modules by weight into one reward (and one verdict on correctness): the rule `anneal rl`
//! trains on and the server applies.
//!
//! **Environments** (multi-turn RL, `reward-wasm/ENVIRONMENTS.md`) run in the same sandbox: an
//! [`EnvModule`] is instantiated once per [`Episode`] ([`Sandbox::start_episode`]), which keeps
//! its state across the policy's turns ([`Episode::step`]) under per-step and per-episode
//! budgets ([`EpisodeLimits`]).
//!
//! ```no_run
//! use anneal_reward::{Sandbox, SandboxConfig, ScoreInput};
//! let sandbox = Sandbox::new(SandboxConfig::default())?;
//! let module = sandbox.load_file(std::path::Path::new("reward.wasm"))?;
//! let input = ScoreInput {
//!     prompt: "2+2?".into(),
//!     completion: "Answer: 4".into(),
//!     metadata: serde_json::json!({"answer": "4"}),
//! };
//! let outcome = sandbox.score(&module, &input);
//! println!("{:?} -> reward {}", outcome.result, outcome.reward);
//! # Ok::<(), anneal_reward::LoadError>(())
//! ```

#![warn(missing_docs)]

mod call;
mod config;
mod env;
mod error;
mod exec;
mod metrics;
mod module;
mod nowait;
mod pool;
mod sandbox;
mod set;
mod state;

pub use call::{ScoreInput, ScoreOutcome};
pub use config::{CallLimits, Grants, SandboxConfig, MAX_MODULE_BYTES};
pub use env::{EnvMessage, EnvModule, Episode, EpisodeLimits, EpisodeStart, StepOutcome};
pub use error::{CallError, ErrorKind, LoadError, ModuleRole};
pub use metrics::{Metrics, MetricsSnapshot};
pub use module::{ModuleKind, RewardModule};
pub use sandbox::Sandbox;
pub use set::{Combined, MemberSpec, ModuleScore, RewardSet, SetError};
