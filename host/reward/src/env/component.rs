//! The component environment ABI: the WIT world `anneal:environment/environment`
//! (`reward-wasm/wit/environment/environment.wit`). Strings are lifted as [`WasmStr`] (bounds-checked views
//! of the module's memory), so an output over the limit is refused from its length before it
//! is copied.

use super::core::MAX_ERROR_BYTES;
use super::output::{outcome, parse_details, parse_tools, start, user};
use super::{EnvMessage, EpisodeStart, StepOutcome};
use crate::error::CallError;
use crate::exec::{abi, bad, Failure};
use crate::sandbox::Sandbox;
use crate::state::{wasi_builder, ComponentState, Limiter};
use wasmtime::component::{
    Component, ComponentExportIndex, ComponentType, Instance, InstancePre, Lift, ResourceTable,
    WasmList, WasmStr,
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
            close: component.get_export_index(None, "close"),
        }
    }

    /// What is missing, if anything (`close` is optional).
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
    role: WasmStr,
    content: WasmStr,
}

#[derive(ComponentType, Lift)]
#[component(variant)]
enum WitPrompt {
    #[component(name = "messages")]
    Messages(WasmList<WitMessage>),
    #[component(name = "text")]
    Text(WasmStr),
}

#[derive(ComponentType, Lift)]
#[component(record)]
struct WitStarted {
    prompt: WitPrompt,
    tools: WasmStr,
}

#[derive(ComponentType, Lift)]
#[component(record)]
struct WitStepped {
    observation: WasmStr,
    role: Option<WasmStr>,
    reward: f64,
    done: bool,
    details: Option<WasmStr>,
}

/// A component's episode: its store, and its instance once instantiated.
pub(crate) struct ComponentEnv {
    pub(super) store: Store<ComponentState>,
    pre: InstancePre<ComponentState>,
    exports: Exports,
    instance: Option<Instance>,
}

/// Copies strings out of the module's memory within a byte budget (`max_output_bytes` for all
/// strings of one result together).
struct Reader<'a> {
    store: &'a mut Store<ComponentState>,
    left: usize,
    max: usize,
}

impl Reader<'_> {
    fn text(&mut self, s: &WasmStr, what: &str) -> Result<String, Failure> {
        let text = s
            .to_str(&*self.store)
            .map_err(|e| bad(format!("{what} is not valid UTF-8: {e:#}")))?;
        if text.len() > self.left {
            return Err(bad(format!(
                "{what} of {} bytes takes the output over the limit of {} bytes \
                 (max_output_bytes)",
                text.len(),
                self.max
            )));
        }
        self.left -= text.len();
        Ok(text.into_owned())
    }

    /// An error result's message, cut to [`MAX_ERROR_BYTES`].
    fn error(&mut self, s: &WasmStr) -> Failure {
        let message = match s.to_str(&*self.store) {
            Ok(text) if text.len() > MAX_ERROR_BYTES => {
                let mut end = MAX_ERROR_BYTES;
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                format!("{} [... {} bytes cut]", &text[..end], text.len() - end)
            }
            Ok(text) => text.into_owned(),
            Err(e) => format!("(an error message that is not valid UTF-8: {e:#})"),
        };
        Failure::Call(CallError::Env { message })
    }
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
            .get_typed_func::<(&str,), (Result<WitStarted, WasmStr>,)>(&mut self.store, index)
            .map_err(|e| abi(format!("export `init`: {e:#}")))?;
        let (result,) = init.call(&mut self.store, (task,))?;
        let mut r = Reader {
            store: &mut self.store,
            left: max,
            max,
        };
        let started = result.map_err(|e| r.error(&e))?;
        let messages = match started.prompt {
            WitPrompt::Text(t) => vec![user(r.text(&t, "init text")?)],
            WitPrompt::Messages(list) => {
                let mut messages = Vec::with_capacity(list.len().min(1024));
                for i in 0..list.len() {
                    let what = format!("init messages[{i}]");
                    let m = list
                        .get(&mut *r.store, i)
                        .ok_or_else(|| bad(format!("{what} is out of bounds")))??;
                    messages.push(EnvMessage {
                        role: r.text(&m.role, &format!("{what}.role"))?,
                        content: r.text(&m.content, &format!("{what}.content"))?,
                    });
                }
                messages
            }
        };
        let tools = parse_tools(&r.text(&started.tools, "init tools")?)?;
        start(messages, tools)
    }

    /// `step(turn)`.
    pub(super) fn step(&mut self, turn: &str, max: usize) -> Result<StepOutcome, Failure> {
        let (Some(instance), Some(index)) = (self.instance, self.exports.step) else {
            return Err(abi("the episode's instance was never initialized"));
        };
        let step = instance
            .get_typed_func::<(&str,), (Result<WitStepped, WasmStr>,)>(&mut self.store, index)
            .map_err(|e| abi(format!("export `step`: {e:#}")))?;
        let (result,) = step.call(&mut self.store, (turn,))?;
        let mut r = Reader {
            store: &mut self.store,
            left: max,
            max,
        };
        let s = result.map_err(|e| r.error(&e))?;
        let observation = r.text(&s.observation, "observation")?;
        let role = match &s.role {
            Some(role) => Some(r.text(role, "role")?),
            None => None,
        };
        let details = match &s.details {
            Some(d) => Some(r.text(d, "details")?).filter(|d| !d.is_empty()),
            None => None,
        };
        let details = details.as_deref().map(parse_details).transpose()?;
        outcome(observation, role, s.reward, s.done, details)
    }

    /// `close()`, when exported.
    pub(super) fn close(&mut self) -> Option<Result<(), Failure>> {
        let (instance, index) = (self.instance?, self.exports.close?);
        let result = instance
            .get_typed_func::<(), ()>(&mut self.store, index)
            .map_err(|e| abi(format!("export `close`: {e:#}")))
            .and_then(|close| close.call(&mut self.store, ()).map_err(Failure::from));
        Some(result)
    }
}
