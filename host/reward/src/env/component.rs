//! The component environment ABI: the WIT world `anneal:environment/environment`
//! (`reward-wasm/wit/environment/environment.wit`).
//!
//! Results are lifted as owned strings: wasmtime runs the export's post-return (which frees
//! them in the component) inside the call, so a lazy view of the component's memory would read
//! freed bytes. The output limit is therefore checked after the copy; the copy is bounded by
//! the component's memory limit (the strings live in its linear memory) and costs fuel per
//! byte as it is lifted.

use super::core::MAX_ERROR_BYTES;
use super::output::{outcome, parse_details, parse_tools, start, user};
use super::{EnvMessage, EpisodeStart, StepOutcome};
use crate::error::CallError;
use crate::exec::{abi, bad, Failure};
use crate::sandbox::Sandbox;
use crate::state::{wasi_builder, ComponentState, Limiter};
use wasmtime::component::{
    Component, ComponentExportIndex, ComponentType, Instance, InstancePre, Lift, ResourceTable,
};
use wasmtime::Store;

/// The world's exports, found at load.
#[derive(Clone)]
pub(crate) struct Exports {
    init: Option<ComponentExportIndex>,
    step: Option<ComponentExportIndex>,
    close: Option<ComponentExportIndex>,
}

impl Exports {
    pub(super) fn find(component: &Component) -> Self {
        Exports {
            init: component.get_export_index(None, "init"),
            step: component.get_export_index(None, "step"),
            // `finish` in the WIT world; `close` accepted from toolchains where it does not
            // collide with libc's.
            close: component
                .get_export_index(None, "finish")
                .or_else(|| component.get_export_index(None, "close")),
        }
    }

    /// What is missing, if anything (`finish` is optional).
    pub(super) fn problem(&self) -> Option<String> {
        match (&self.init, &self.step) {
            (None, _) => Some("missing function export `init`".into()),
            (_, None) => Some("missing function export `step`".into()),
            _ => None,
        }
    }
}

#[derive(ComponentType, Lift)]
#[component(record)]
struct WitMessage {
    role: String,
    content: String,
}

#[derive(ComponentType, Lift)]
#[component(variant)]
enum WitPrompt {
    #[component(name = "messages")]
    Messages(Vec<WitMessage>),
    #[component(name = "text")]
    Text(String),
}

#[derive(ComponentType, Lift)]
#[component(record)]
struct WitStarted {
    prompt: WitPrompt,
    tools: String,
}

#[derive(ComponentType, Lift)]
#[component(record)]
struct WitStepped {
    observation: String,
    role: Option<String>,
    reward: f64,
    done: bool,
    details: Option<String>,
}

/// A component's episode: its store, and its instance once instantiated.
pub(crate) struct ComponentEnv {
    pub(super) store: Store<ComponentState>,
    pre: InstancePre<ComponentState>,
    exports: Exports,
    instance: Option<Instance>,
}

/// Counts the bytes of one result's strings against `max_output_bytes`.
struct Budget {
    left: usize,
    max: usize,
}

impl Budget {
    fn take(&mut self, text: String, what: &str) -> Result<String, Failure> {
        if text.len() > self.left {
            return Err(bad(format!(
                "{what} of {} bytes takes the output over the limit of {} bytes \
                 (max_output_bytes)",
                text.len(),
                self.max
            )));
        }
        self.left -= text.len();
        Ok(text)
    }
}

/// An error result: the environment's message, cut to [`MAX_ERROR_BYTES`].
fn env_error(mut message: String) -> Failure {
    if message.len() > MAX_ERROR_BYTES {
        let mut end = MAX_ERROR_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        let cut = message.len() - end;
        message.truncate(end);
        message.push_str(&format!(" [... {cut} bytes cut]"));
    }
    Failure::Call(CallError::Env { message })
}

impl ComponentEnv {
    /// A fresh store with the sandbox's memory limits and deny-all WASI.
    pub(super) fn new(
        sandbox: &Sandbox,
        pre: InstancePre<ComponentState>,
        exports: Exports,
    ) -> Result<Self, String> {
        let wasi = wasi_builder(&sandbox.config.grants)?.build();
        let limiter = Limiter::new(sandbox.config.memory_bytes, sandbox.config.table_elements);
        let state = ComponentState {
            limiter,
            wasi,
            table: ResourceTable::new(),
        };
        let mut store = Store::new(&sandbox.engine, state);
        store.limiter(|s| &mut s.limiter as &mut dyn wasmtime::ResourceLimiter);
        Ok(ComponentEnv {
            store,
            pre,
            exports,
            instance: None,
        })
    }

    /// Instantiates the component, then `init(task)`.
    pub(super) fn init(&mut self, task: &str, max: usize) -> Result<EpisodeStart, Failure> {
        let index = self
            .exports
            .init
            .ok_or_else(|| abi("missing function export `init`"))?;
        let instance = self.pre.instantiate(&mut self.store)?;
        self.instance = Some(instance);
        let init = instance
            .get_typed_func::<(&str,), (Result<WitStarted, String>,)>(&mut self.store, index)
            .map_err(|e| abi(format!("export `init`: {e:#}")))?;
        let (result,) = init.call(&mut self.store, (task,))?;
        let started = result.map_err(env_error)?;
        let mut budget = Budget { left: max, max };
        let messages = match started.prompt {
            WitPrompt::Text(t) => vec![user(budget.take(t, "init text")?)],
            WitPrompt::Messages(list) => list
                .into_iter()
                .enumerate()
                .map(|(i, m)| {
                    Ok(EnvMessage {
                        role: budget.take(m.role, &format!("init messages[{i}].role"))?,
                        content: budget.take(m.content, &format!("init messages[{i}].content"))?,
                    })
                })
                .collect::<Result<_, Failure>>()?,
        };
        let tools = parse_tools(&budget.take(started.tools, "init tools")?)?;
        start(messages, tools)
    }

    /// `step(turn)`.
    pub(super) fn step(&mut self, turn: &str, max: usize) -> Result<StepOutcome, Failure> {
        let (Some(instance), Some(index)) = (self.instance, self.exports.step) else {
            return Err(abi("the episode's instance was never initialized"));
        };
        let step = instance
            .get_typed_func::<(&str,), (Result<WitStepped, String>,)>(&mut self.store, index)
            .map_err(|e| abi(format!("export `step`: {e:#}")))?;
        let (result,) = step.call(&mut self.store, (turn,))?;
        let s = result.map_err(env_error)?;
        let mut budget = Budget { left: max, max };
        let observation = budget.take(s.observation, "observation")?;
        let role = s.role.map(|r| budget.take(r, "role")).transpose()?;
        let details = match s.details {
            Some(d) if !d.is_empty() => Some(parse_details(&budget.take(d, "details")?)?),
            _ => None,
        };
        outcome(observation, role, s.reward, s.done, details)
    }

    /// `finish()`, when exported.
    pub(super) fn close(&mut self) -> Option<Result<(), Failure>> {
        let (instance, index) = (self.instance?, self.exports.close?);
        let result = instance
            .get_typed_func::<(), ()>(&mut self.store, index)
            .map_err(|e| abi(format!("export `finish`: {e:#}")))
            .and_then(|close| close.call(&mut self.store, ()).map_err(Failure::from));
        Some(result)
    }
}
