//! Counters of scoring calls, per outcome.

use crate::error::ErrorKind;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters, shared by all calls of one [`crate::Sandbox`]. Cheap to update from many threads.
#[derive(Debug, Default)]
pub struct Metrics {
    calls: AtomicU64,
    ok: AtomicU64,
    errors: [AtomicU64; ErrorKind::ALL.len()],
    fuel: AtomicU64,
    micros: AtomicU64,
}

/// A copy of the counters at one moment, ready to log as JSON.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MetricsSnapshot {
    /// Calls finished, successful or not.
    pub calls: u64,
    /// Calls that returned a score.
    pub ok: u64,
    /// Failed calls per error kind (every kind is present, zeros included).
    pub errors: BTreeMap<ErrorKind, u64>,
    /// Fuel used by all calls together.
    pub fuel_used: u64,
    /// Wall-clock microseconds spent in all calls together.
    pub micros: u64,
}

impl MetricsSnapshot {
    /// The count of one error kind.
    pub fn errors_of(&self, kind: ErrorKind) -> u64 {
        self.errors.get(&kind).copied().unwrap_or(0)
    }

    /// Failed calls of all kinds together.
    pub fn total_errors(&self) -> u64 {
        self.errors.values().sum()
    }
}

impl Metrics {
    /// Records one finished call.
    pub(crate) fn record(&self, kind: Option<ErrorKind>, fuel: u64, micros: u64) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        match kind {
            None => self.ok.fetch_add(1, Ordering::Relaxed),
            Some(k) => self.errors[k.index()].fetch_add(1, Ordering::Relaxed),
        };
        self.fuel.fetch_add(fuel, Ordering::Relaxed);
        self.micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// The count of one error kind so far.
    pub fn errors_of(&self, kind: ErrorKind) -> u64 {
        self.errors[kind.index()].load(Ordering::Relaxed)
    }

    /// Copies the counters.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            calls: self.calls.load(Ordering::Relaxed),
            ok: self.ok.load(Ordering::Relaxed),
            errors: ErrorKind::ALL
                .iter()
                .map(|&k| (k, self.errors_of(k)))
                .collect(),
            fuel_used: self.fuel.load(Ordering::Relaxed),
            micros: self.micros.load(Ordering::Relaxed),
        }
    }
}
