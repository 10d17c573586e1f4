//! A process-wide count of the floating-point operations matrix products and attention have
//! run (2 per multiply-add), so callers can measure what a piece of model costs, e.g. what
//! recomputing a block adds to a step. One relaxed atomic add per kernel call.

use std::sync::atomic::{AtomicU64, Ordering};

static FLOPS: AtomicU64 = AtomicU64::new(0);

/// Operations counted since the process started (take differences).
pub fn counted() -> u64 {
    FLOPS.load(Ordering::Relaxed)
}

pub(crate) fn add(n: u64) {
    FLOPS.fetch_add(n, Ordering::Relaxed);
}
