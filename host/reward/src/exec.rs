//! What every call into a module shares, whatever its ABI: arming a store with fuel and an
//! epoch deadline, copying inputs into linear memory, and classifying failures into typed
//! [`CallError`]s.

use crate::config::CallLimits;
use crate::error::CallError;
use crate::state::{CoreState, Limiter};
use std::time::Duration;
use wasmtime::{Memory, Store, Trap, TypedFunc};

/// A failure inside a call, before classification.
pub(crate) enum Failure {
    Wasm(wasmtime::Error),
    Call(CallError),
}

impl From<wasmtime::Error> for Failure {
    fn from(e: wasmtime::Error) -> Self {
        Failure::Wasm(e)
    }
}

impl From<CallError> for Failure {
    fn from(e: CallError) -> Self {
        Failure::Call(e)
    }
}

/// An `abi_mismatch` failure.
pub(crate) fn abi(reason: impl std::fmt::Display) -> Failure {
    Failure::Call(CallError::AbiMismatch {
        reason: reason.to_string(),
    })
}

/// A `bad_output` failure.
pub(crate) fn bad(reason: impl Into<String>) -> Failure {
    Failure::Call(CallError::BadOutput {
        reason: reason.into(),
    })
}

/// The epoch deadline of a call, in ticks of `tick`.
fn deadline_ticks(tick: Duration, timeout: Duration) -> u64 {
    let tick = tick.as_nanos().max(1);
    let ticks = timeout.as_nanos().div_ceil(tick);
    u64::try_from(ticks).unwrap_or(u64::MAX).max(1)
}

/// Installs the limiter of a fresh store and arms it for one call.
pub(crate) fn limit<T>(
    store: &mut Store<T>,
    limiter: fn(&mut T) -> &mut Limiter,
    tick: Duration,
    limits: CallLimits,
) {
    store.limiter(move |s| limiter(s) as &mut dyn wasmtime::ResourceLimiter);
    arm(store, tick, limits);
}

/// Gives a store the fuel and the epoch deadline (from now) of one call.
pub(crate) fn arm<T>(store: &mut Store<T>, tick: Duration, limits: CallLimits) {
    store
        .set_fuel(limits.fuel)
        .expect("fuel consumption is enabled in the engine config");
    store.set_epoch_deadline(deadline_ticks(tick, limits.timeout));
    store.epoch_deadline_trap();
}

/// Turns a failure into a typed error. A refused grow wins over whatever trap it caused.
pub(crate) fn classify(
    failure: Failure,
    limit_hit: Option<String>,
    limits: CallLimits,
) -> CallError {
    if let Some(message) = limit_hit {
        return CallError::MemoryLimit { message };
    }
    let err = match failure {
        Failure::Call(e) => return e,
        Failure::Wasm(e) => e,
    };
    if let Some(trap) = err.downcast_ref::<Trap>() {
        return match trap {
            Trap::OutOfFuel => CallError::FuelExhausted { fuel: limits.fuel },
            Trap::Interrupt => CallError::Timeout {
                timeout_ms: u64::try_from(limits.timeout.as_millis()).unwrap_or(u64::MAX),
            },
            other => CallError::Trap {
                message: other.to_string(),
            },
        };
    }
    if let Some(exit) = err.downcast_ref::<wasmtime_wasi::I32Exit>() {
        return CallError::Trap {
            message: format!("module exited with code {}", exit.0),
        };
    }
    CallError::Trap {
        message: err.root_cause().to_string(),
    }
}

/// Copies `bytes` into the module's memory at a pointer its `alloc` returns.
pub(crate) fn put(
    store: &mut Store<CoreState>,
    alloc: &TypedFunc<i32, i32>,
    memory: &Memory,
    bytes: &[u8],
) -> Result<(i32, i32), Failure> {
    let len = i32::try_from(bytes.len()).map_err(|_| {
        Failure::Call(CallError::MemoryLimit {
            message: format!(
                "an input of {} bytes does not fit a 32-bit module",
                bytes.len()
            ),
        })
    })?;
    let ptr = alloc.call(&mut *store, len)?;
    if len > 0 {
        memory
            .write(&mut *store, ptr as u32 as usize, bytes)
            .map_err(|_| {
                bad(format!(
                    "alloc({len}) returned {ptr}, out of bounds of memory"
                ))
            })?;
    }
    Ok((ptr, len))
}
