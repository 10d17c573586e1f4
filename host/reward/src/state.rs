//! Per-call store data: the resource limiter and the deny-all WASI contexts.

use crate::config::Grants;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use wasmtime::ResourceLimiter;
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::{
    FsPerms, HostMonotonicClock, HostWallClock, ResourceTable, WasiCtx, WasiCtxBuilder,
    WasiCtxView, WasiView,
};

/// Limits memories and tables of one call and remembers whether a limit was hit, so that the
/// resulting error (a trap, or a failed instantiation) is reported as `memory_limit`.
pub(crate) struct Limiter {
    memory_bytes: usize,
    table_elements: usize,
    /// Set when a grow was refused; the message says what and how big.
    pub(crate) hit: Option<String>,
}

impl Limiter {
    pub(crate) fn new(memory_bytes: usize, table_elements: usize) -> Self {
        Limiter {
            memory_bytes,
            table_elements,
            hit: None,
        }
    }
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_bytes {
            let message = format!(
                "memory grow from {current} to {desired} bytes refused (limit {} bytes)",
                self.memory_bytes
            );
            self.hit = Some(message.clone());
            return Err(wasmtime::Error::msg(message));
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.table_elements {
            let message = format!(
                "table grow from {current} to {desired} elements refused (limit {})",
                self.table_elements
            );
            self.hit = Some(message.clone());
            return Err(wasmtime::Error::msg(message));
        }
        Ok(true)
    }

    fn instances(&self) -> usize {
        1000
    }

    fn tables(&self) -> usize {
        1000
    }

    fn memories(&self) -> usize {
        100
    }
}

/// Store data of a core-module call.
pub(crate) struct CoreState {
    pub(crate) limiter: Limiter,
    /// Present when the module imports WASI preview 1.
    pub(crate) p1: Option<WasiP1Ctx>,
}

/// Store data of a component call.
pub(crate) struct ComponentState {
    pub(crate) limiter: Limiter,
    pub(crate) wasi: WasiCtx,
    pub(crate) table: ResourceTable,
}

impl WasiView for ComponentState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// The clock a module sees when clocks are not granted: deterministic virtual time that starts
/// at a fixed instant and advances 1 µs per reading (a clock stuck at zero breaks runtimes such
/// as Go's, which refuse a zero `nanotime`).
struct VirtualClock {
    start_ns: u64,
    reads: AtomicU64,
}

impl VirtualClock {
    /// Wall time starts at 2000-01-01T00:00:00Z.
    const WALL_START_NS: u64 = 946_684_800 * 1_000_000_000;
    /// Monotonic time starts at one second.
    const MONOTONIC_START_NS: u64 = 1_000_000_000;

    fn new(start_ns: u64) -> Self {
        VirtualClock {
            start_ns,
            reads: AtomicU64::new(0),
        }
    }

    fn read(&self) -> u64 {
        let n = self.reads.fetch_add(1, Ordering::Relaxed);
        self.start_ns + n.saturating_mul(1000)
    }
}

impl HostWallClock for VirtualClock {
    fn resolution(&self) -> Duration {
        Duration::from_micros(1)
    }
    fn now(&self) -> Duration {
        Duration::from_nanos(self.read())
    }
}

impl HostMonotonicClock for VirtualClock {
    fn resolution(&self) -> u64 {
        1000
    }
    fn now(&self) -> u64 {
        self.read()
    }
}

/// The fixed byte cycle used as "random" data when random is not granted.
const FIXED_RANDOM: [u8; 8] = [0x2a, 0x9e, 0x37, 0x79, 0xb9, 0x7f, 0x4a, 0x7c];

/// A WASI builder that grants exactly `grants`: nothing by default.
pub(crate) fn wasi_builder(grants: &Grants) -> Result<WasiCtxBuilder, String> {
    let mut b = WasiCtxBuilder::new();
    if !grants.clocks {
        b.wall_clock(VirtualClock::new(VirtualClock::WALL_START_NS))
            .monotonic_clock(VirtualClock::new(VirtualClock::MONOTONIC_START_NS));
    }
    if !grants.random {
        b.secure_random(wasmtime_wasi::Deterministic::new(FIXED_RANDOM.to_vec()))
            .insecure_random(wasmtime_wasi::Deterministic::new(FIXED_RANDOM.to_vec()))
            .insecure_random_seed(0);
    }
    if grants.stdio {
        b.inherit_stdout().inherit_stderr();
    }
    b.envs(&grants.env);
    for (host, guest) in &grants.read_dirs {
        b.preopened_dir(host, guest, FsPerms::ReadOnly)
            .map_err(|e| format!("cannot grant directory {}: {e}", host.display()))?;
    }
    if grants.network {
        b.inherit_network()
            .allow_tcp(true)
            .allow_udp(true)
            .allow_ip_name_lookup(true);
    } else {
        b.allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
    }
    Ok(b)
}
