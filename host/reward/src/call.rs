//! One scoring call: a fresh store with fuel, an epoch deadline and a memory limit; the ABI
//! dance; and the mapping of every failure to a typed [`CallError`].

use crate::config::CallLimits;
use crate::error::CallError;
use crate::exec::{abi, bad, classify, limit, put, Failure};
use crate::module::{Kind, RewardModule};
use crate::sandbox::Sandbox;
use crate::state::{wasi_builder, ComponentState, CoreState, Limiter};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::time::Instant;
use wasmtime::component::{ComponentType, Lift, ResourceTable};
use wasmtime::{InstancePre, Store};

/// One thing to score: the prompt, the model's completion, and metadata (e.g. the reference
/// answer). This is also the JSON line format of `anneal reward test`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct ScoreInput {
    /// The prompt as given to the model.
    pub prompt: String,
    /// The model's completion.
    pub completion: String,
    /// A JSON object passed to the module as text; `{}` when absent.
    #[serde(default = "empty_object")]
    pub metadata: Value,
}

fn empty_object() -> Value {
    Value::Object(Map::new())
}

/// The result of one call: the score or the typed error, the reward to train on, and costs.
#[derive(Clone, Debug)]
pub struct ScoreOutcome {
    /// The module's score, or why there is none.
    pub result: Result<f64, CallError>,
    /// The score, or the configured error reward when the call failed.
    pub reward: f64,
    /// The extra named values the module reported (`details_ptr`/`details_len` or the
    /// component's `details` field), when it reported any.
    pub details: Option<Map<String, Value>>,
    /// Fuel the call used (instantiation included).
    pub fuel_used: u64,
    /// Wall-clock microseconds of the call (store creation, instantiation and call).
    pub micros: u64,
}

impl ScoreOutcome {
    /// The outcome as one JSON object: `score` (or null), `error` kind and `message` (or null),
    /// `reward`, `details`, `fuel`, `micros` — what `anneal reward test` prints and the server's
    /// reward test returns.
    pub fn to_json(&self) -> Value {
        let (score, error, message) = match &self.result {
            Ok(score) => (serde_json::json!(score), Value::Null, Value::Null),
            Err(e) => (
                Value::Null,
                serde_json::json!(e.kind()),
                serde_json::json!(e.message()),
            ),
        };
        serde_json::json!({
            "score": score,
            "error": error,
            "message": message,
            "reward": self.reward,
            "details": self.details,
            "fuel": self.fuel_used,
            "micros": self.micros,
        })
    }
}

/// What a component's `score` returns (the `scored` record of the WIT world).
#[derive(ComponentType, Lift)]
#[component(record)]
struct Scored {
    score: f64,
    details: Option<String>,
}

/// A score with its optional details.
type ScoreAndDetails = (f64, Option<Map<String, Value>>);
type Scoring = Result<ScoreAndDetails, Failure>;
/// The classified result of a call and the fuel it used.
type CallResult = (Result<ScoreAndDetails, CallError>, u64);

impl Sandbox {
    /// Scores one input in a fresh store. Never panics on anything the module does; failures
    /// come back as [`CallError`]s and are counted in [`Sandbox::metrics`].
    pub fn score(&self, module: &RewardModule, input: &ScoreInput) -> ScoreOutcome {
        self.score_within(module, input, self.config.call_limits())
    }

    /// [`Sandbox::score`] with this call's own fuel and deadline instead of the configured
    /// ones (errors then name these limits).
    pub fn score_within(
        &self,
        module: &RewardModule,
        input: &ScoreInput,
        limits: CallLimits,
    ) -> ScoreOutcome {
        let start = Instant::now();
        let metadata = input.metadata.to_string();
        let (result, fuel_used) = match &module.inner.abi_problem {
            Some(reason) => (
                Err(CallError::AbiMismatch {
                    reason: reason.clone(),
                }),
                0,
            ),
            None => match &module.inner.kind {
                Kind::Core { pre, wasi } => self.call_core(pre, *wasi, input, &metadata, limits),
                Kind::Component { pre, score } => match score {
                    Some(index) => self.call_component(pre, index, input, &metadata, limits),
                    None => (
                        Err(CallError::AbiMismatch {
                            reason: "missing function export `score`".into(),
                        }),
                        0,
                    ),
                },
            },
        };
        let micros = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.metrics
            .record(result.as_ref().err().map(|e| e.kind()), fuel_used, micros);
        let (result, details) = match result {
            Ok((score, details)) => (Ok(score), details),
            Err(e) => (Err(e), None),
        };
        ScoreOutcome {
            reward: *result.as_ref().unwrap_or(&self.config.error_reward),
            result,
            details,
            fuel_used,
            micros,
        }
    }

    fn call_core(
        &self,
        pre: &InstancePre<CoreState>,
        wasi: bool,
        input: &ScoreInput,
        metadata: &str,
        limits: CallLimits,
    ) -> CallResult {
        let p1 = if wasi {
            match wasi_builder(&self.config.grants) {
                Ok(mut b) => Some(b.build_p1()),
                Err(message) => return (Err(CallError::Trap { message }), 0),
            }
        } else {
            None
        };
        let limiter = Limiter::new(self.config.memory_bytes, self.config.table_elements);
        let mut store = Store::new(&self.engine, CoreState { limiter, p1 });
        limit(
            &mut store,
            |s| &mut s.limiter,
            self.config.epoch_tick,
            limits,
        );
        let result = run_core(&mut store, pre, input, metadata);
        let fuel_used = limits.fuel.saturating_sub(store.get_fuel().unwrap_or(0));
        let hit = store.data_mut().limiter.hit.take();
        (result.map_err(|f| classify(f, hit, limits)), fuel_used)
    }

    fn call_component(
        &self,
        pre: &wasmtime::component::InstancePre<ComponentState>,
        index: &wasmtime::component::ComponentExportIndex,
        input: &ScoreInput,
        metadata: &str,
        limits: CallLimits,
    ) -> CallResult {
        let wasi = match wasi_builder(&self.config.grants) {
            Ok(mut b) => b.build(),
            Err(message) => return (Err(CallError::Trap { message }), 0),
        };
        let limiter = Limiter::new(self.config.memory_bytes, self.config.table_elements);
        let state = ComponentState {
            limiter,
            wasi,
            table: ResourceTable::new(),
        };
        let mut store = Store::new(&self.engine, state);
        limit(
            &mut store,
            |s| &mut s.limiter,
            self.config.epoch_tick,
            limits,
        );
        let result = run_component(&mut store, pre, index, input, metadata);
        let fuel_used = limits.fuel.saturating_sub(store.get_fuel().unwrap_or(0));
        let hit = store.data_mut().limiter.hit.take();
        (result.map_err(|f| classify(f, hit, limits)), fuel_used)
    }
}

fn run_core(
    store: &mut Store<CoreState>,
    pre: &InstancePre<CoreState>,
    input: &ScoreInput,
    metadata: &str,
) -> Scoring {
    let instance = pre.instantiate(&mut *store)?;
    // Reactors (Go's c-shared, WASI libc) initialize their runtime in `_initialize`.
    if let Ok(init) = instance.get_typed_func::<(), ()>(&mut *store, "_initialize") {
        init.call(&mut *store, ())?;
    }
    if let Ok(version) = instance.get_typed_func::<(), i32>(&mut *store, "anneal_reward_abi") {
        let v = version.call(&mut *store, ())?;
        if v != 1 {
            return Err(abi(format!("anneal_reward_abi() returned {v}, expected 1")));
        }
    }
    let memory = instance
        .get_memory(&mut *store, "memory")
        .ok_or_else(|| abi("missing memory export `memory`"))?;
    let alloc = instance
        .get_typed_func::<i32, i32>(&mut *store, "alloc")
        .map_err(|e| abi(format!("export `alloc`: {e:#}")))?;
    let score = instance
        .get_typed_func::<(i32, i32, i32, i32, i32, i32), f64>(&mut *store, "score")
        .map_err(|e| abi(format!("export `score`: {e:#}")))?;
    let (pp, pl) = put(store, &alloc, &memory, input.prompt.as_bytes())?;
    let (cp, cl) = put(store, &alloc, &memory, input.completion.as_bytes())?;
    let (mp, ml) = put(store, &alloc, &memory, metadata.as_bytes())?;
    let value = score.call(&mut *store, (pp, pl, cp, cl, mp, ml))?;
    check_score(value)?;
    let details_ptr = instance.get_typed_func::<(), i32>(&mut *store, "details_ptr");
    let details_len = instance.get_typed_func::<(), i32>(&mut *store, "details_len");
    let details = match (details_ptr, details_len) {
        (Ok(fp), Ok(fl)) => {
            let ptr = fp.call(&mut *store, ())? as u32 as usize;
            let len = fl.call(&mut *store, ())? as u32 as usize;
            if len == 0 {
                None
            } else {
                let bytes = ptr
                    .checked_add(len)
                    .and_then(|end| memory.data(&*store).get(ptr..end))
                    .ok_or_else(|| bad(format!("details at {ptr}+{len} out of bounds")))?;
                Some(parse_details(bytes)?)
            }
        }
        _ => None,
    };
    Ok((value, details))
}

fn run_component(
    store: &mut Store<ComponentState>,
    pre: &wasmtime::component::InstancePre<ComponentState>,
    index: &wasmtime::component::ComponentExportIndex,
    input: &ScoreInput,
    metadata: &str,
) -> Scoring {
    let instance = pre.instantiate(&mut *store)?;
    let score = instance
        .get_typed_func::<(&str, &str, &str), (Scored,)>(&mut *store, index)
        .map_err(|e| abi(format!("export `score`: {e:#}")))?;
    let (out,) = score.call(
        &mut *store,
        (input.prompt.as_str(), input.completion.as_str(), metadata),
    )?;
    check_score(out.score)?;
    let details = match out.details {
        Some(text) if !text.is_empty() => Some(parse_details(text.as_bytes())?),
        _ => None,
    };
    Ok((out.score, details))
}

/// A score must be a finite number: NaN or infinity is `bad_output`.
fn check_score(value: f64) -> Result<(), Failure> {
    if value.is_finite() {
        Ok(())
    } else {
        Err(bad(format!("score is {value}, not a finite number")))
    }
}

/// Details must be a UTF-8 JSON object.
fn parse_details(bytes: &[u8]) -> Result<Map<String, Value>, Failure> {
    let text = std::str::from_utf8(bytes).map_err(|e| bad(format!("details: {e}")))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(bad("details is not a JSON object")),
        Err(e) => Err(bad(format!("details is not valid JSON: {e}"))),
    }
}
