//! One episode: an instance that lives across the policy's turns, its budgets, and the rule
//! that the first error ends it.

use super::component::ComponentEnv;
use super::core::CoreEnv;
use super::{EnvModule, EpisodeLimits, EpisodeStart, Kind, StepOutcome};
use crate::config::CallLimits;
use crate::error::CallError;
use crate::exec::{classify, Failure};
use crate::metrics::Metrics;
use crate::sandbox::{Sandbox, Ticker};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The instance of either ABI, with its store.
pub(super) enum Instance {
    Core(Box<CoreEnv>),
    Component(ComponentEnv),
}

impl Instance {
    fn arm(&mut self, tick: Duration, limits: CallLimits) {
        match self {
            Instance::Core(c) => crate::exec::arm(&mut c.store, tick, limits),
            Instance::Component(c) => crate::exec::arm(&mut c.store, tick, limits),
        }
    }

    fn fuel_left(&self) -> u64 {
        match self {
            Instance::Core(c) => c.store.get_fuel().unwrap_or(0),
            Instance::Component(c) => c.store.get_fuel().unwrap_or(0),
        }
    }

    /// The refused grow of the last call, if any (cleared).
    fn take_hit(&mut self) -> Option<String> {
        match self {
            Instance::Core(c) => c.store.data_mut().limiter.hit.take(),
            Instance::Component(c) => c.store.data_mut().limiter.hit.take(),
        }
    }

    fn init(&mut self, task: &str, max: usize) -> Result<EpisodeStart, Failure> {
        match self {
            Instance::Core(c) => c.init(task, max),
            Instance::Component(c) => c.init(task, max),
        }
    }

    fn step(&mut self, turn: &str, max: usize) -> Result<StepOutcome, Failure> {
        match self {
            Instance::Core(c) => c.step(turn, max),
            Instance::Component(c) => c.step(turn, max),
        }
    }

    /// Calls `close` when the module exports it; `None` when it does not.
    fn close(&mut self) -> Option<Result<(), Failure>> {
        match self {
            Instance::Core(c) => c.close(),
            Instance::Component(c) => c.close(),
        }
    }
}

/// Where an episode stands.
enum State {
    Running,
    /// The environment returned `done`.
    Done,
    /// A call failed; the text says how.
    Failed(String),
}

/// One episode of an environment: its own instance (state persists across steps), budgets and
/// costs so far. `Send`: an episode may move between threads between calls.
pub struct Episode {
    instance: Instance,
    limits: EpisodeLimits,
    tick: Duration,
    fuel_used: u64,
    micros: u64,
    steps: usize,
    state: State,
    metrics: Arc<Metrics>,
    /// Keeps the epoch advancing while the episode lives, even if the sandbox is dropped.
    _ticker: Arc<Ticker>,
}

impl Episode {
    pub(super) fn start(
        sandbox: &Sandbox,
        module: &EnvModule,
        task: &str,
        limits: EpisodeLimits,
    ) -> Result<(Episode, EpisodeStart), CallError> {
        let instance = match &module.inner.kind {
            Kind::Core { pre, wasi } => {
                CoreEnv::new(sandbox, pre.clone(), *wasi).map(|c| Instance::Core(Box::new(c)))
            }
            Kind::Component { pre, exports } => {
                ComponentEnv::new(sandbox, pre.clone(), exports.clone()).map(Instance::Component)
            }
        };
        let instance = instance.map_err(|message| {
            let e = CallError::Trap { message };
            sandbox.metrics.record(Some(e.kind()), 0, 0);
            e
        })?;
        let mut episode = Episode {
            instance,
            limits,
            tick: sandbox.config.epoch_tick,
            fuel_used: 0,
            micros: 0,
            steps: 0,
            state: State::Running,
            metrics: sandbox.metrics.clone(),
            _ticker: sandbox.ticker.clone(),
        };
        let start = episode.call(|i, max| i.init(task, max))?;
        Ok((episode, start))
    }

    /// One policy turn (a JSON object: `text`, `content`, `tool_calls`, `error`, see `reward-wasm/ENVIRONMENTS.md`; passed to the module as text).
    /// After any error, or after the environment said `done`, the episode is over and later
    /// calls return [`CallError::EpisodeOver`] without running anything.
    pub fn step(&mut self, turn: &Value) -> Result<StepOutcome, CallError> {
        match &self.state {
            State::Running => {}
            State::Done => {
                return Err(CallError::EpisodeOver {
                    reason: "the environment already said the episode is done".into(),
                })
            }
            State::Failed(why) => {
                return Err(CallError::EpisodeOver {
                    reason: format!("the episode ended earlier with {why}"),
                })
            }
        }
        let turn = turn.to_string();
        self.steps += 1;
        let outcome = self.call(|i, max| i.step(&turn, max))?;
        if outcome.done {
            self.state = State::Done;
        }
        Ok(outcome)
    }

    /// Ends the episode: calls the module's `close` if it exports one and the episode did not
    /// fail (a failed instance is not entered again). A failing `close` is counted in the
    /// sandbox's metrics, not returned. Dropping an episode without `close` frees it too.
    pub fn close(mut self) {
        if matches!(self.state, State::Failed(_)) {
            return;
        }
        let _ = self.call(|i, _| i.close().unwrap_or(Ok(())));
    }

    /// Fuel used by all calls of the episode so far (instantiation and `init` included).
    pub fn fuel_used(&self) -> u64 {
        self.fuel_used
    }

    /// Wall-clock microseconds spent inside the module so far (all calls together).
    pub fn micros(&self) -> u64 {
        self.micros
    }

    /// The number of steps run so far (failed ones included, refused ones not).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The limits the episode runs under.
    pub fn limits(&self) -> EpisodeLimits {
        self.limits
    }

    /// Whether the episode is over (done, or failed).
    pub fn is_over(&self) -> bool {
        !matches!(self.state, State::Running)
    }

    /// Runs one call under the step limits cut to what is left of the episode's, accounts its
    /// costs, records it in the metrics and ends the episode on an error.
    fn call<R>(
        &mut self,
        f: impl FnOnce(&mut Instance, usize) -> Result<R, Failure>,
    ) -> Result<R, CallError> {
        let l = self.limits;
        let fuel_left = l.episode_fuel.saturating_sub(self.fuel_used);
        let time_left = l
            .episode_timeout
            .saturating_sub(Duration::from_micros(self.micros));
        let limits = CallLimits {
            fuel: fuel_left.min(l.step_fuel),
            timeout: time_left.min(l.step_timeout),
        };
        let start = Instant::now();
        self.instance.arm(self.tick, limits);
        let result = f(&mut self.instance, l.max_output_bytes);
        let fuel = limits.fuel.saturating_sub(self.instance.fuel_left());
        let hit = self.instance.take_hit();
        let micros = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.fuel_used = self.fuel_used.saturating_add(fuel);
        self.micros = self.micros.saturating_add(micros);
        let result = result.map_err(|failure| match classify(failure, hit, limits) {
            // The episode's budget, not the step's, was what ran out: say so.
            CallError::FuelExhausted { .. } if fuel_left <= l.step_fuel => {
                CallError::EpisodeFuelExhausted {
                    fuel: l.episode_fuel,
                }
            }
            CallError::Timeout { .. } if time_left <= l.step_timeout => CallError::EpisodeTimeout {
                timeout_ms: u64::try_from(l.episode_timeout.as_millis()).unwrap_or(u64::MAX),
            },
            e => e,
        });
        self.metrics
            .record(result.as_ref().err().map(|e| e.kind()), fuel, micros);
        if let Err(e) = &result {
            self.state = State::Failed(e.to_string());
        }
        result
    }
}

impl std::fmt::Debug for Episode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Episode")
            .field("steps", &self.steps)
            .field("fuel_used", &self.fuel_used)
            .field("micros", &self.micros)
            .field("over", &self.is_over())
            .finish()
    }
}
