//! WASI sleeps that never block. Epoch interruption only stops running WASM code, not a host
//! call that sleeps, so a module sleeping for an hour would hang its worker. The sandbox
//! replaces preview 1 `poll_oneoff` with a version that reports every subscription ready at
//! once, and preview 2 `wasi:clocks/monotonic-clock.subscribe-{duration,instant}` with pollables
//! that are ready at once: sleeps return immediately (time is virtual unless clocks are granted).

use crate::state::{ComponentState, CoreState};
use wasmtime::component::Resource;
use wasmtime::{Caller, Extern, Linker, StoreContextMut};
use wasmtime_wasi::p2::{subscribe, DynPollable, Pollable};

/// The preview 2 monotonic clock interface as the WASI linker names it.
const MONOTONIC_CLOCK: &str = "wasi:clocks/monotonic-clock@0.2.12";

/// WASI errno values used here.
const ERRNO_SUCCESS: i32 = 0;
const ERRNO_FAULT: i32 = 21;
const ERRNO_INVAL: i32 = 28;
/// Sizes of the preview 1 `subscription` and `event` records.
const SUBSCRIPTION_SIZE: usize = 48;
const EVENT_SIZE: usize = 32;

/// Shadows `wasi_snapshot_preview1::poll_oneoff` in `linker` with the non-blocking version.
pub(crate) fn install(linker: &mut Linker<CoreState>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    linker.func_wrap("wasi_snapshot_preview1", "poll_oneoff", poll_oneoff)?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Shadows the monotonic clock's `subscribe-duration` and `subscribe-instant` in `linker` with
/// pollables that are ready at once.
pub(crate) fn install_p2(
    linker: &mut wasmtime::component::Linker<ComponentState>,
) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let mut clock = linker.instance(MONOTONIC_CLOCK)?;
    clock.func_wrap("subscribe-duration", subscribe_ready)?;
    clock.func_wrap("subscribe-instant", subscribe_ready)?;
    linker.allow_shadowing(false);
    Ok(())
}

/// A pollable that is always ready.
struct Ready;

#[wasmtime_wasi::async_trait]
impl Pollable for Ready {
    async fn ready(&mut self) {}
}

fn subscribe_ready(
    mut store: StoreContextMut<'_, ComponentState>,
    _: (u64,),
) -> wasmtime::Result<(Resource<DynPollable>,)> {
    let table = &mut store.data_mut().table;
    let ready = table.push(Ready)?;
    Ok((subscribe(table, ready)?,))
}

fn poll_oneoff(
    mut caller: Caller<'_, CoreState>,
    subscriptions: i32,
    events: i32,
    count: i32,
    nevents: i32,
) -> i32 {
    let Some(Extern::Memory(memory)) = caller.get_export("memory") else {
        return ERRNO_INVAL;
    };
    let n = count as u32 as usize;
    if n == 0 {
        return ERRNO_INVAL;
    }
    let data = memory.data_mut(&mut caller);
    for i in 0..n {
        let sub = subscriptions as u32 as usize + i * SUBSCRIPTION_SIZE;
        let ev = events as u32 as usize + i * EVENT_SIZE;
        let Some(header) = data.get(sub..sub + 9) else {
            return ERRNO_FAULT;
        };
        let mut event = [0u8; EVENT_SIZE];
        event[0..8].copy_from_slice(&header[0..8]); // userdata
        event[10] = header[8]; // the event type is the subscription's tag; error 0, nbytes 0
        let Some(slot) = data.get_mut(ev..ev + EVENT_SIZE) else {
            return ERRNO_FAULT;
        };
        slot.copy_from_slice(&event);
    }
    let at = nevents as u32 as usize;
    let Some(slot) = data.get_mut(at..at + 4) else {
        return ERRNO_FAULT;
    };
    slot.copy_from_slice(&(n as u32).to_le_bytes());
    ERRNO_SUCCESS
}
