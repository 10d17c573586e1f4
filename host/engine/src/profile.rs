//! Where a training step's time goes: a per-op breakdown written as a table and as a Chrome
//! trace (open it in Perfetto or `chrome://tracing`).
//!
//! The CPU backend opens a [`scope`] around every kernel; callers mark [`phase`]s (forward,
//! backward, optimizer) and [`step`]s. Scopes nest: each records its *self* time (its duration
//! minus its children's), so the rows of the table add up to the step time without counting a
//! nested copy twice, and a phase's self time is the time spent outside any kernel in it
//! (autograd bookkeeping, plugin calls).
//!
//! On a GPU the host's time of an op is only its launch: the CUDA backend also times each op on
//! the device with a pair of events ([`record_device`]), and the table gives each op's device
//! time beside what the roofline allows it (its FLOPs and bytes against the device's peaks,
//! [`DevicePeak`]), so a kernel far from its bound shows without a profiler.
//!
//! Off by default: a disabled scope costs one relaxed atomic load. [`configure`] arms a window
//! of steps (skipping warm-up steps); [`finish`] returns what was recorded.

use crate::alloc::memory_stats;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Recording right now (inside the window).
static ACTIVE: AtomicBool = AtomicBool::new(false);
static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);
static NEXT_TID: AtomicU32 = AtomicU32::new(1);

thread_local! {
    /// Children's accumulated time of every open scope on this thread, innermost last.
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    static PHASE: Cell<&'static str> = const { Cell::new("other") };
    static TID: u32 = NEXT_TID.fetch_add(1, Ordering::Relaxed);
}

/// What a recorded span is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// A kernel or copy.
    Op,
    /// A phase of a step (its self time is the time outside kernels).
    Phase,
    /// A whole step (its self time is the time outside phases).
    Step,
}

/// One recorded span.
#[derive(Clone, Debug)]
pub struct Event {
    /// Op, phase or step name.
    pub name: &'static str,
    /// Which variant of the op (`silu` of `unary`), when it has variants.
    pub sub: Option<&'static str>,
    /// The phase it ran in (for an op: forward, backward, optimizer, ...).
    pub phase: &'static str,
    /// Extra detail (a matmul's shape), when the op gives one.
    pub detail: Option<String>,
    /// What the span is.
    pub kind: Kind,
    /// A small per-thread number.
    pub tid: u32,
    /// Start, in nanoseconds since the profile was configured.
    pub start_ns: u64,
    /// Duration in nanoseconds.
    pub dur_ns: u64,
    /// Duration minus the nested spans' durations.
    pub self_ns: u64,
}

/// The window of steps to record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Steps to let pass first (warm-up: caches, allocator, lazy initialization).
    pub skip: u64,
    /// Steps to record.
    pub steps: u64,
}

/// What an op computes and moves: the roofline's inputs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    /// Floating-point operations (2 per multiply-add).
    pub flops: f64,
    /// Bytes read and written in device memory (each operand and result once).
    pub bytes: f64,
    /// Whether the work can run on tensor cores (a bf16/f16 product), so the tensor peak
    /// bounds it rather than the vector units'.
    pub tensor_cores: bool,
}

/// A device's peak rates, what the roofline predicts an op's time from.
#[derive(Clone, Debug, PartialEq)]
pub struct DevicePeak {
    /// The device, as the driver names it.
    pub name: String,
    /// Dense bf16 tensor-core FLOP/s.
    pub tensor_flops: f64,
    /// FP32 FLOP/s of the vector units.
    pub vector_flops: f64,
    /// Memory bandwidth in bytes/s.
    pub bytes_per_s: f64,
}

impl DevicePeak {
    /// The fastest `cost` can run: its FLOPs at the compute peak or its bytes at the memory
    /// bandwidth, whichever takes longer (in ms); and whether compute is that bound.
    pub fn roofline_ms(&self, cost: &Cost) -> (f64, bool) {
        let peak = if cost.tensor_cores {
            self.tensor_flops
        } else {
            self.vector_flops
        };
        let compute = cost.flops / peak.max(1.0);
        let memory = cost.bytes / self.bytes_per_s.max(1.0);
        (compute.max(memory) * 1e3, compute > memory)
    }
}

/// One op timed on a device by the device's own events.
#[derive(Clone, Debug)]
pub struct DeviceSpan {
    /// The op.
    pub name: &'static str,
    /// The phase it was queued in.
    pub phase: &'static str,
    /// Device time in nanoseconds (start event to end event).
    pub ns: u64,
    /// What it computes and moves.
    pub cost: Cost,
}

/// A device span whose events may still be in the device's queue: resolved (waiting for them)
/// when its step ends.
pub(crate) trait PendingSpan: Send {
    /// The span, once both events have run (`None` when the device cannot time them).
    fn resolve(self: Box<Self>) -> Option<DeviceSpan>;
}

struct Recorder {
    epoch: Instant,
    window: Window,
    seen: u64,
    events: Vec<Event>,
    pending: Vec<Box<dyn PendingSpan>>,
    device: Vec<DeviceSpan>,
    peak: Option<DevicePeak>,
    alloc_start: Option<crate::alloc::MemoryStats>,
    alloc_end: Option<crate::alloc::MemoryStats>,
    recorded: u64,
}

/// What the window recorded.
#[derive(Clone, Debug)]
pub struct Profile {
    /// Every span, in the order they ended.
    pub events: Vec<Event>,
    /// Steps recorded.
    pub steps: u64,
    /// Allocations served from the caching allocator's cache during the window.
    pub cache_hits: usize,
    /// Allocations that went to the system allocator during the window.
    pub system_allocs: usize,
    /// Ops timed on a device, in the order they were queued.
    pub device_ops: Vec<DeviceSpan>,
    /// The peaks of the device they ran on.
    pub device_peak: Option<DevicePeak>,
}

/// Arms the profiler: steps after the first `window.skip` are recorded, `window.steps` of
/// them. Replaces anything recorded before.
pub fn configure(window: Window) {
    *RECORDER.lock().expect("profile lock poisoned") = Some(Recorder {
        epoch: Instant::now(),
        window,
        seen: 0,
        events: Vec::new(),
        pending: Vec::new(),
        device: Vec::new(),
        peak: None,
        alloc_start: None,
        alloc_end: None,
        recorded: 0,
    });
    ACTIVE.store(false, Ordering::SeqCst);
}

/// Stops profiling and returns what was recorded (`None` when [`configure`] was not called).
pub fn finish() -> Option<Profile> {
    ACTIVE.store(false, Ordering::SeqCst);
    let mut rec = RECORDER.lock().expect("profile lock poisoned").take()?;
    let pending = std::mem::take(&mut rec.pending);
    rec.device
        .extend(pending.into_iter().filter_map(|p| p.resolve()));
    let end = rec.alloc_end.unwrap_or_else(memory_stats);
    let (hits, system) = match rec.alloc_start {
        Some(s) => (
            end.cache_hits - s.cache_hits,
            end.system_allocs - s.system_allocs,
        ),
        None => (0, 0),
    };
    Some(Profile {
        events: rec.events,
        steps: rec.recorded,
        cache_hits: hits,
        system_allocs: system,
        device_ops: rec.device,
        device_peak: rec.peak,
    })
}

/// The phase ops on this thread belong to now.
pub(crate) fn current_phase() -> &'static str {
    PHASE.with(|p| p.get())
}

/// Records an op timed on a device (its events resolved when the step ends); `peak` gives the
/// device's peaks the first time.
pub(crate) fn record_device(span: Box<dyn PendingSpan>, peak: impl FnOnce() -> DevicePeak) {
    let mut guard = RECORDER.lock().expect("profile lock poisoned");
    if let Some(rec) = guard.as_mut() {
        if rec.peak.is_none() {
            rec.peak = Some(peak());
        }
        rec.pending.push(span);
    }
}

/// True while spans are being recorded.
#[inline]
pub fn enabled() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// An open span; records itself when dropped (and restores the phase it replaced).
#[must_use = "a scope measures until it is dropped"]
pub struct Scope {
    open: Option<Open>,
    restore_phase: Option<&'static str>,
}

struct Open {
    name: &'static str,
    sub: Option<&'static str>,
    detail: Option<String>,
    kind: Kind,
    start: Instant,
}

const IDLE: Scope = Scope {
    open: None,
    restore_phase: None,
};

fn open(name: &'static str, kind: Kind, detail: Option<String>) -> Scope {
    STACK.with(|s| s.borrow_mut().push(0));
    Scope {
        open: Some(Open {
            name,
            sub: None,
            detail,
            kind,
            start: Instant::now(),
        }),
        restore_phase: None,
    }
}

/// Measures an op until the returned guard drops.
#[inline]
pub fn scope(name: &'static str) -> Scope {
    if !enabled() {
        return IDLE;
    }
    open(name, Kind::Op, None)
}

/// [`scope`] of one variant of an op (`unary` `silu`); the table names it `unary silu`.
#[inline]
pub fn scope_sub(name: &'static str, sub: &'static str) -> Scope {
    if !enabled() {
        return IDLE;
    }
    let mut s = open(name, Kind::Op, None);
    if let Some(o) = &mut s.open {
        o.sub = Some(sub);
    }
    s
}

/// [`scope`] with a detail string, built only while recording.
#[inline]
pub fn scope_with(name: &'static str, detail: impl FnOnce() -> String) -> Scope {
    if !enabled() {
        return IDLE;
    }
    open(name, Kind::Op, Some(detail()))
}

/// Marks the ops on this thread as belonging to phase `name` until the guard drops (phases
/// nest; the innermost names the ops).
pub fn phase(name: &'static str) -> Scope {
    let prev = PHASE.with(|p| p.replace(name));
    let mut s = if enabled() {
        open(name, Kind::Phase, None)
    } else {
        IDLE
    };
    s.restore_phase = Some(prev);
    s
}

/// Step `n` of a run: recorded when it falls in the configured window. Call at the start of
/// every step and keep the guard for the whole step.
pub fn step(n: u64) -> StepGuard {
    let mut guard = RECORDER.lock().expect("profile lock poisoned");
    let Some(rec) = guard.as_mut() else {
        return StepGuard { scope: None };
    };
    rec.seen += 1;
    let w = rec.window;
    if rec.seen <= w.skip || rec.seen > w.skip + w.steps {
        return StepGuard { scope: None };
    }
    if rec.alloc_start.is_none() {
        rec.alloc_start = Some(memory_stats());
    }
    drop(guard);
    ACTIVE.store(true, Ordering::SeqCst);
    let prev = PHASE.with(|p| p.replace("step"));
    let mut s = open("step", Kind::Step, Some(format!("step {n}")));
    s.restore_phase = Some(prev);
    StepGuard { scope: Some(s) }
}

/// Keeps a step's span open; ends the recording window after its last step.
#[must_use = "the step is measured until the guard drops"]
pub struct StepGuard {
    scope: Option<Scope>,
}

impl Drop for StepGuard {
    fn drop(&mut self) {
        let Some(s) = self.scope.take() else { return };
        drop(s);
        let pending = match RECORDER.lock().expect("profile lock poisoned").as_mut() {
            Some(rec) => std::mem::take(&mut rec.pending),
            None => Vec::new(),
        };
        // The step's device spans: waiting for their events here (outside the lock) is the
        // profiler's own cost, after the step's measured span.
        let resolved: Vec<DeviceSpan> = pending.into_iter().filter_map(|p| p.resolve()).collect();
        let mut guard = RECORDER.lock().expect("profile lock poisoned");
        if let Some(rec) = guard.as_mut() {
            rec.device.extend(resolved);
            rec.recorded += 1;
            if rec.seen >= rec.window.skip + rec.window.steps {
                ACTIVE.store(false, Ordering::SeqCst);
                rec.alloc_end = Some(memory_stats());
            }
        }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(prev) = self.restore_phase.take() {
            PHASE.with(|p| p.set(prev));
        }
        let Some(o) = self.open.take() else { return };
        let dur_ns = o.start.elapsed().as_nanos() as u64;
        let child = STACK.with(|s| {
            let mut s = s.borrow_mut();
            let child = s.pop().unwrap_or(0);
            if let Some(parent) = s.last_mut() {
                *parent += dur_ns;
            }
            child
        });
        let phase = match o.kind {
            Kind::Op => PHASE.with(|p| p.get()),
            _ => o.name,
        };
        let mut guard = RECORDER.lock().expect("profile lock poisoned");
        let Some(rec) = guard.as_mut() else { return };
        let start_ns = o.start.saturating_duration_since(rec.epoch).as_nanos() as u64;
        rec.events.push(Event {
            name: o.name,
            sub: o.sub,
            phase,
            detail: o.detail,
            kind: o.kind,
            tid: TID.with(|t| *t),
            start_ns,
            dur_ns,
            self_ns: dur_ns.saturating_sub(child),
        });
    }
}

/// One row of [`Profile::rows`].
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The op (or `(outside kernels)` for a phase's own time).
    pub name: String,
    /// The phase it ran in.
    pub phase: &'static str,
    /// Calls per step.
    pub calls: f64,
    /// Self milliseconds per step.
    pub ms: f64,
}

impl Profile {
    /// Mean milliseconds of a recorded step.
    pub fn step_ms(&self) -> f64 {
        let total: u64 = self
            .events
            .iter()
            .filter(|e| e.kind == Kind::Step)
            .map(|e| e.dur_ns)
            .sum();
        total as f64 / 1e6 / self.steps.max(1) as f64
    }

    /// Self time per (op, phase), per step, largest first. A phase's time outside kernels is
    /// the row `(outside kernels)`; a step's time outside phases is `(between phases)`.
    pub fn rows(&self) -> Vec<Row> {
        let mut acc: BTreeMap<(String, &'static str), (u64, u64)> = BTreeMap::new();
        for e in &self.events {
            let name = match (e.kind, e.sub) {
                (Kind::Op, Some(sub)) => format!("{} {sub}", e.name),
                (Kind::Op, None) => e.name.to_string(),
                (Kind::Phase, _) => "(outside kernels)".to_string(),
                (Kind::Step, _) => "(between phases)".to_string(),
            };
            let a = acc.entry((name, e.phase)).or_default();
            a.0 += 1;
            a.1 += e.self_ns;
        }
        let steps = self.steps.max(1) as f64;
        let mut rows: Vec<Row> = acc
            .into_iter()
            .map(|((name, phase), (calls, ns))| Row {
                name,
                phase,
                calls: calls as f64 / steps,
                ms: ns as f64 / 1e6 / steps,
            })
            .collect();
        rows.sort_by(|a, b| b.ms.total_cmp(&a.ms).then(a.name.cmp(&b.name)));
        rows
    }

    /// Self time per op detail (matmul shapes), per step, largest first: `(detail, op, phase,
    /// calls per step, ms per step)`.
    pub fn detail_rows(&self) -> Vec<(String, &'static str, &'static str, f64, f64)> {
        let mut acc: BTreeMap<(String, &'static str, &'static str), (u64, u64)> = BTreeMap::new();
        for e in &self.events {
            if let (Kind::Op, Some(d)) = (e.kind, &e.detail) {
                let a = acc.entry((d.clone(), e.name, e.phase)).or_default();
                a.0 += 1;
                a.1 += e.self_ns;
            }
        }
        let steps = self.steps.max(1) as f64;
        let mut rows: Vec<_> = acc
            .into_iter()
            .map(|((d, n, p), (c, ns))| (d, n, p, c as f64 / steps, ns as f64 / 1e6 / steps))
            .collect();
        rows.sort_by(|a, b| b.4.total_cmp(&a.4));
        rows
    }

    /// Milliseconds per step of each phase (inclusive).
    pub fn phase_ms(&self) -> Vec<(&'static str, f64)> {
        let mut acc: BTreeMap<&'static str, u64> = BTreeMap::new();
        for e in self.events.iter().filter(|e| e.kind == Kind::Phase) {
            *acc.entry(e.name).or_default() += e.dur_ns;
        }
        let steps = self.steps.max(1) as f64;
        let mut v: Vec<_> = acc
            .into_iter()
            .map(|(n, ns)| (n, ns as f64 / 1e6 / steps))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    /// The fraction of allocations the caching allocator served from its cache.
    pub fn cache_hit_rate(&self) -> f64 {
        let total = self.cache_hits + self.system_allocs;
        if total == 0 {
            1.0
        } else {
            self.cache_hits as f64 / total as f64
        }
    }

    /// The breakdown as a plain-text table (what `anneal train --profile` prints).
    pub fn table(&self) -> String {
        let step = self.step_ms();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "profile of {} step(s): {step:.1} ms per step, {} thread(s), SIMD {:?}",
            self.steps,
            crate::num_threads(),
            crate::simd_level()
        );
        let phases: Vec<String> = self
            .phase_ms()
            .iter()
            .map(|(n, ms)| format!("{n} {ms:.1} ms ({:.1}%)", 100.0 * ms / step.max(1e-9)))
            .collect();
        let _ = writeln!(s, "phases: {}", phases.join(", "));
        let _ = writeln!(
            s,
            "| {:<28} | {:<10} | {:>10} | {:>10} | {:>6} |",
            "op", "phase", "calls/step", "ms/step", "%"
        );
        let _ = writeln!(
            s,
            "|{:-<30}|{:-<12}|{:->12}|{:->12}|{:->8}|",
            "", "", "", "", ""
        );
        for r in self.rows() {
            let _ = writeln!(
                s,
                "| {:<28} | {:<10} | {:>10.1} | {:>10.2} | {:>6.1} |",
                r.name,
                r.phase,
                r.calls,
                r.ms,
                100.0 * r.ms / step.max(1e-9)
            );
        }
        let details = self.detail_rows();
        if !details.is_empty() {
            let _ = writeln!(
                s,
                "\nmatmul shapes (C[m,n] = A[m,k] B[k,n]; t = operand read transposed):"
            );
            let _ = writeln!(
                s,
                "| {:<40} | {:<10} | {:>10} | {:>10} | {:>8} |",
                "shape", "phase", "calls/step", "ms/step", "GFLOP/s"
            );
            let _ = writeln!(
                s,
                "|{:-<42}|{:-<12}|{:->12}|{:->12}|{:->10}|",
                "", "", "", "", ""
            );
            for (d, _, phase, calls, ms) in details.iter().take(16) {
                let gflops = flops_of(d).map_or(f64::NAN, |f| f * calls / (ms * 1e6));
                let _ = writeln!(
                    s,
                    "| {d:<40} | {phase:<10} | {calls:>10.1} | {ms:>10.2} | {gflops:>8.1} |"
                );
            }
        }
        self.device_table(&mut s);
        let total = self.cache_hits + self.system_allocs;
        let _ = writeln!(
            s,
            "\nallocator: {:.0} allocations per step, {:.2}% served from the cache ({} system allocations in {} step(s))",
            total as f64 / self.steps.max(1) as f64,
            100.0 * self.cache_hit_rate(),
            self.system_allocs,
            self.steps
        );
        s
    }

    /// Device time per (op, phase), per step, largest first: `(op, phase, calls, ms, cost)`
    /// with the cost summed over the calls.
    pub fn device_rows(&self) -> Vec<(&'static str, &'static str, f64, f64, Cost)> {
        let mut acc: BTreeMap<(&'static str, &'static str), (u64, u64, Cost)> = BTreeMap::new();
        for d in &self.device_ops {
            let a = acc.entry((d.name, d.phase)).or_default();
            a.0 += 1;
            a.1 += d.ns;
            a.2.flops += d.cost.flops;
            a.2.bytes += d.cost.bytes;
            a.2.tensor_cores |= d.cost.tensor_cores;
        }
        let steps = self.steps.max(1) as f64;
        let mut rows: Vec<_> = acc
            .into_iter()
            .map(|((n, p), (calls, ns, c))| {
                let per_step = Cost {
                    flops: c.flops / steps,
                    bytes: c.bytes / steps,
                    tensor_cores: c.tensor_cores,
                };
                (
                    n,
                    p,
                    calls as f64 / steps,
                    ns as f64 / 1e6 / steps,
                    per_step,
                )
            })
            .collect();
        rows.sort_by(|a, b| b.3.total_cmp(&a.3).then(a.0.cmp(b.0)));
        rows
    }

    /// The device ops' table: device time beside the roofline's (empty without device ops).
    fn device_table(&self, s: &mut String) {
        let (Some(peak), false) = (&self.device_peak, self.device_ops.is_empty()) else {
            return;
        };
        let rows = self.device_rows();
        let busy: f64 = rows.iter().map(|r| r.3).sum();
        let _ = writeln!(
            s,
            "\ndevice time per op on {} (device events; roofline at {:.1} TFLOP/s bf16 tensor, {:.1} TFLOP/s f32, {:.0} GB/s): busy {busy:.2} ms of a {:.2} ms step",
            peak.name,
            peak.tensor_flops / 1e12,
            peak.vector_flops / 1e12,
            peak.bytes_per_s / 1e9,
            self.step_ms()
        );
        let _ = writeln!(
            s,
            "| {:<28} | {:<10} | {:>10} | {:>10} | {:>9} | {:>9} | {:>11} | {:>7} | {:<7} |",
            "op",
            "phase",
            "calls/step",
            "ms/step",
            "FLOP",
            "bytes",
            "roofline ms",
            "% peak",
            "bound"
        );
        let _ = writeln!(
            s,
            "|{:-<30}|{:-<12}|{:->12}|{:->12}|{:->11}|{:->11}|{:->13}|{:->9}|{:-<9}|",
            "", "", "", "", "", "", "", "", ""
        );
        for (name, phase, calls, ms, cost) in rows {
            let (roof, compute) = peak.roofline_ms(&cost);
            let _ = writeln!(
                s,
                "| {name:<28} | {phase:<10} | {calls:>10.1} | {ms:>10.3} | {:>9.3e} | {:>9.3e} | {roof:>11.4} | {:>7.1} | {:<7} |",
                cost.flops,
                cost.bytes,
                100.0 * roof / ms.max(1e-9),
                if compute { "compute" } else { "memory" }
            );
        }
    }

    /// The spans as a Chrome trace (JSON object format), loadable in Perfetto.
    pub fn chrome_trace(&self) -> String {
        let mut s = String::from("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
        let mut first = true;
        for e in &self.events {
            if !first {
                s.push_str(",\n");
            }
            first = false;
            let cat = match e.kind {
                Kind::Op => "op",
                Kind::Phase => "phase",
                Kind::Step => "step",
            };
            let _ = write!(
                s,
                "{{\"name\":\"{}\",\"cat\":\"{cat}\",\"ph\":\"X\",\"pid\":1,\"tid\":{},\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"phase\":\"{}\",\"self_us\":{:.3}",
                json_escape(e.name),
                e.tid,
                e.start_ns as f64 / 1e3,
                e.dur_ns as f64 / 1e3,
                json_escape(e.phase),
                e.self_ns as f64 / 1e3
            );
            if let Some(d) = &e.detail {
                let _ = write!(s, ",\"detail\":\"{}\"", json_escape(d));
            }
            s.push_str("}}");
        }
        s.push_str("\n]}\n");
        s
    }
}

/// FLOPs of a matmul detail string `m=.. k=.. n=.. ...` (2·m·k·n).
fn flops_of(detail: &str) -> Option<f64> {
    let get = |key: &str| -> Option<f64> {
        detail
            .split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some(2.0 * get("m=")? * get("k=")? * get("n=")? * get("batch=").unwrap_or(1.0))
}

fn json_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_parse() {
        assert_eq!(flops_of("m=2 k=3 n=4 a=n b=t"), Some(48.0));
        assert_eq!(flops_of("batch=2 m=2 k=3 n=4"), Some(96.0));
        assert_eq!(flops_of("nothing"), None);
    }

    #[test]
    fn escapes() {
        assert_eq!(json_escape("a\"b\\c\n"), "a\\\"b\\\\c\\u000a");
    }
}
