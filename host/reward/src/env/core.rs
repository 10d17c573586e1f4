//! The core-module environment ABI v1: `alloc` + `env_init` / `env_step` with UTF-8 JSON in,
//! a status out, and the call's output (JSON, or the error message) behind `output_ptr` /
//! `output_len`.

use super::output::{parse_start, parse_step};
use super::{EpisodeStart, StepOutcome};
use crate::error::CallError;
use crate::exec::{abi, bad, put, Failure};
use crate::module::{check_func, check_memory};
use crate::sandbox::Sandbox;
use crate::state::{wasi_builder, CoreState, Limiter};
use wasmtime::{InstancePre, Memory, Module, Store, TypedFunc};

/// The most bytes of an error message read from a module (the rest is cut).
pub(super) const MAX_ERROR_BYTES: usize = 4096;

/// Checks the exports of a core module against the environment ABI v1.
pub(super) fn check_abi(module: &Module) -> Result<(), String> {
    check_memory(module)?;
    check_func(module, "alloc", "(i32) -> i32", true)?;
    check_func(module, "env_init", "(i32, i32) -> i32", true)?;
    check_func(module, "env_step", "(i32, i32) -> i32", true)?;
    check_func(module, "output_ptr", "() -> i32", true)?;
    check_func(module, "output_len", "() -> i32", true)?;
    check_func(module, "env_close", "() -> ", false)?;
    check_func(module, "anneal_env_abi", "() -> i32", false)?;
    Ok(())
}

/// The exports an episode calls.
struct Fns {
    memory: Memory,
    alloc: TypedFunc<i32, i32>,
    step: TypedFunc<(i32, i32), i32>,
    close: Option<TypedFunc<(), ()>>,
    output_ptr: TypedFunc<(), i32>,
    output_len: TypedFunc<(), i32>,
}

/// A core module's episode: its store, and its exports once instantiated.
pub(crate) struct CoreEnv {
    pub(super) store: Store<CoreState>,
    pre: InstancePre<CoreState>,
    fns: Option<Fns>,
}

impl CoreEnv {
    /// A fresh store with the sandbox's memory limits (and a deny-all WASI context if needed).
    pub(super) fn new(
        sandbox: &Sandbox,
        pre: InstancePre<CoreState>,
        wasi: bool,
    ) -> Result<Self, String> {
        let p1 = if wasi {
            Some(wasi_builder(&sandbox.config.grants)?.build_p1())
        } else {
            None
        };
        let limiter = Limiter::new(sandbox.config.memory_bytes, sandbox.config.table_elements);
        let mut store = Store::new(&sandbox.engine, CoreState { limiter, p1 });
        store.limiter(|s| &mut s.limiter as &mut dyn wasmtime::ResourceLimiter);
        Ok(CoreEnv {
            store,
            pre,
            fns: None,
        })
    }

    /// Instantiates the module, then `env_init(task)`.
    pub(super) fn init(&mut self, task: &str, max: usize) -> Result<EpisodeStart, Failure> {
        let store = &mut self.store;
        let instance = self.pre.instantiate(&mut *store)?;
        // Reactors (Go's c-shared, WASI libc) initialize their runtime in `_initialize`.
        if let Ok(init) = instance.get_typed_func::<(), ()>(&mut *store, "_initialize") {
            init.call(&mut *store, ())?;
        }
        if let Ok(version) = instance.get_typed_func::<(), i32>(&mut *store, "anneal_env_abi") {
            let v = version.call(&mut *store, ())?;
            if v != 1 {
                return Err(abi(format!("anneal_env_abi() returned {v}, expected 1")));
            }
        }
        let memory = instance
            .get_memory(&mut *store, "memory")
            .ok_or_else(|| abi("missing memory export `memory`"))?;
        let func = |store: &mut Store<CoreState>, name: &str| {
            instance
                .get_func(&mut *store, name)
                .ok_or_else(|| abi(format!("missing function export `{name}`")))
        };
        let typed = |e: wasmtime::Error| abi(format!("{e:#}"));
        let init = func(store, "env_init")?
            .typed::<(i32, i32), i32>(&*store)
            .map_err(typed)?;
        let fns = Fns {
            memory,
            alloc: func(store, "alloc")?.typed(&*store).map_err(typed)?,
            step: func(store, "env_step")?.typed(&*store).map_err(typed)?,
            close: match instance.get_func(&mut *store, "env_close") {
                Some(f) => Some(f.typed(&*store).map_err(typed)?),
                None => None,
            },
            output_ptr: func(store, "output_ptr")?.typed(&*store).map_err(typed)?,
            output_len: func(store, "output_len")?.typed(&*store).map_err(typed)?,
        };
        let text = call_json(store, &fns, &init, task, max)?;
        let start = parse_start(&text)?;
        self.fns = Some(fns);
        Ok(start)
    }

    /// `env_step(turn)`.
    pub(super) fn step(&mut self, turn: &str, max: usize) -> Result<StepOutcome, Failure> {
        let fns = self
            .fns
            .as_ref()
            .ok_or_else(|| abi("the episode's instance was never initialized"))?;
        let text = call_json(&mut self.store, fns, &fns.step, turn, max)?;
        parse_step(&text)
    }

    /// `env_close()`, when exported.
    pub(super) fn close(&mut self) -> Option<Result<(), Failure>> {
        let close = self.fns.as_ref()?.close.as_ref()?;
        Some(close.call(&mut self.store, ()).map_err(Failure::from))
    }
}

/// Writes `input` into the module's memory, calls `f(ptr, len)` and returns its output as
/// text: the JSON result on status 0, an `env_error` with the message otherwise. The output's
/// length is checked against `max` before anything is copied.
fn call_json(
    store: &mut Store<CoreState>,
    fns: &Fns,
    f: &TypedFunc<(i32, i32), i32>,
    input: &str,
    max: usize,
) -> Result<String, Failure> {
    let (ptr, len) = put(store, &fns.alloc, &fns.memory, input.as_bytes())?;
    let status = f.call(&mut *store, (ptr, len))?;
    let out_ptr = fns.output_ptr.call(&mut *store, ())? as u32 as usize;
    let out_len = fns.output_len.call(&mut *store, ())? as u32 as usize;
    let data = fns.memory.data(&*store);
    let slice = |len: usize| {
        out_ptr
            .checked_add(len)
            .and_then(|end| data.get(out_ptr..end))
            .ok_or_else(|| {
                bad(format!(
                    "output at {out_ptr}+{out_len} is out of bounds of memory ({} bytes)",
                    data.len()
                ))
            })
    };
    if status != 0 {
        let bytes = slice(out_len.min(MAX_ERROR_BYTES))?;
        let mut message = String::from_utf8_lossy(bytes).into_owned();
        if out_len > MAX_ERROR_BYTES {
            message.push_str(&format!(" [... {} bytes cut]", out_len - MAX_ERROR_BYTES));
        }
        if message.is_empty() {
            message = format!("status {status}, no message");
        }
        return Err(Failure::Call(CallError::Env { message }));
    }
    if out_len > max {
        return Err(bad(format!(
            "output of {out_len} bytes is over the limit of {max} bytes (max_output_bytes)"
        )));
    }
    let text = std::str::from_utf8(slice(out_len)?)
        .map_err(|e| bad(format!("output is not UTF-8: {e}")))?;
    Ok(text.to_string())
}
