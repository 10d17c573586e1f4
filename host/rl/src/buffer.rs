//! The rollout buffer between rollout workers and the trainer, keyed by policy version.
//!
//! The trainer holds policy version `c` (its parameters after `c` steps) and takes a batch to
//! make step `c + 1`; a rollout made with version `v` is then `c − v` versions stale. The
//! buffer guarantees `c − v ≤ max_staleness` for everything it hands out:
//! - a worker may only **begin** a rollout when (a) fewer than `capacity` rollouts are queued or
//!   in flight, and (b) the published version `p` satisfies `p + max_staleness ≥ n`, where `n`
//!   is the version of the next take (so with `max_staleness = 0` a worker waits for the new
//!   weights after each take: fully synchronous);
//! - a **take** at version `c` drops anything staler than `max_staleness` (counted in
//!   [`Taken::dropped`]) and hands out the oldest acceptable rollouts first.
//!
//! The weights travel with the version: [`RolloutBuffer::publish`] stores an `Arc` of the new
//! parameters, and [`RolloutBuffer::begin`] hands the worker the pair it must generate with.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

/// A finished rollout and the policy version that produced it.
#[derive(Debug)]
pub struct Item<T> {
    /// The version of the weights it was generated with.
    pub version: u64,
    /// The rollout.
    pub value: T,
}

/// What a take returned.
#[derive(Debug)]
pub struct Taken<T> {
    /// The rollouts, oldest first.
    pub items: Vec<Item<T>>,
    /// Rollouts discarded for being too stale.
    pub dropped: usize,
}

/// The shared state; the non-blocking `try_*` methods hold the whole protocol.
#[derive(Debug)]
pub struct State<T, W> {
    queue: VecDeque<Item<T>>,
    in_flight: usize,
    published: (u64, W),
    next_take: u64,
    closed: bool,
    dropped: usize,
    max_staleness: u64,
    capacity: usize,
}

impl<T, W: Clone> State<T, W> {
    /// An empty buffer whose first weights are `(0, weights)`.
    pub fn new(weights: W, max_staleness: u64, capacity: usize) -> Self {
        State {
            queue: VecDeque::new(),
            in_flight: 0,
            published: (0, weights),
            next_take: 0,
            closed: false,
            dropped: 0,
            max_staleness,
            capacity: capacity.max(1),
        }
    }

    /// Starts a rollout if allowed: the version and weights to generate with.
    pub fn try_begin(&mut self) -> Option<(u64, W)> {
        self.try_begin_many(1).map(|(v, w, _)| (v, w))
    }

    /// Starts as many rollouts as allowed, up to `max` (at least one, else `None`): the version
    /// and weights to generate them with, and how many were started. Each must end in a
    /// [`State::finish`] or [`State::abandon`].
    pub fn try_begin_many(&mut self, max: usize) -> Option<(u64, W, usize)> {
        let room = self
            .capacity
            .saturating_sub(self.queue.len() + self.in_flight)
            .min(max);
        let fresh = self.published.0 + self.max_staleness >= self.next_take;
        (room > 0 && fresh && !self.closed).then(|| {
            self.in_flight += room;
            (self.published.0, self.published.1.clone(), room)
        })
    }

    /// A rollout begun with `version` is done.
    pub fn finish(&mut self, version: u64, value: T) {
        debug_assert!(self.in_flight > 0, "finish without begin");
        self.in_flight -= 1;
        self.queue.push_back(Item { version, value });
    }

    /// A rollout begun earlier failed and produced nothing.
    pub fn abandon(&mut self) {
        debug_assert!(self.in_flight > 0, "abandon without begin");
        self.in_flight -= 1;
    }

    /// New weights.
    pub fn publish(&mut self, version: u64, weights: W) {
        debug_assert!(version >= self.published.0, "versions only grow");
        self.published = (version, weights);
    }

    /// Takes `n` rollouts for the trainer at `version` if that many acceptable ones are queued.
    pub fn try_take(&mut self, n: usize, version: u64) -> Option<Taken<T>> {
        self.next_take = self.next_take.max(version);
        let before = self.queue.len();
        let limit = self.max_staleness;
        self.queue
            .retain(|it| version.saturating_sub(it.version) <= limit);
        self.dropped += before - self.queue.len();
        if self.queue.len() < n {
            return None;
        }
        // The queue is in finishing order; hand out the oldest versions first.
        self.queue.make_contiguous().sort_by_key(|it| it.version);
        let items: Vec<Item<T>> = self.queue.drain(..n).collect();
        self.next_take = version + 1;
        Some(Taken {
            items,
            dropped: std::mem::take(&mut self.dropped),
        })
    }

    /// Whether nothing more can arrive.
    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

/// The buffer shared by worker threads and the trainer: [`State`] behind a mutex, with blocking
/// calls.
pub struct RolloutBuffer<T, W> {
    state: Mutex<State<T, W>>,
    changed: Condvar,
}

impl<T, W: Clone> RolloutBuffer<T, W> {
    /// See [`State::new`].
    pub fn new(weights: W, max_staleness: u64, capacity: usize) -> Self {
        RolloutBuffer {
            state: Mutex::new(State::new(weights, max_staleness, capacity)),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T, W>> {
        // A worker that panicked while holding the lock left consistent state behind (every
        // method completes its update before returning), so poisoning is ignored.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait_until<R>(&self, mut f: impl FnMut(&mut State<T, W>) -> Option<R>) -> Option<R> {
        let mut s = self.lock();
        loop {
            if let Some(r) = f(&mut s) {
                self.changed.notify_all();
                return Some(r);
            }
            if s.closed {
                return None;
            }
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Blocks until a rollout may start; `None` once closed.
    pub fn begin(&self) -> Option<(u64, W)> {
        self.wait_until(|s| s.try_begin())
    }

    /// Blocks until at least one rollout may start, then starts up to `max`; `None` once
    /// closed. See [`State::try_begin_many`].
    pub fn begin_many(&self, max: usize) -> Option<(u64, W, usize)> {
        self.wait_until(|s| s.try_begin_many(max))
    }

    /// See [`State::finish`].
    pub fn finish(&self, version: u64, value: T) {
        self.lock().finish(version, value);
        self.changed.notify_all();
    }

    /// See [`State::abandon`].
    pub fn abandon(&self) {
        self.lock().abandon();
        self.changed.notify_all();
    }

    /// See [`State::publish`].
    pub fn publish(&self, version: u64, weights: W) {
        self.lock().publish(version, weights);
        self.changed.notify_all();
    }

    /// Blocks until `n` acceptable rollouts for `version` are there; `None` once closed.
    pub fn take(&self, n: usize, version: u64) -> Option<Taken<T>> {
        self.wait_until(|s| s.try_take(n, version))
    }

    /// Wakes everyone; later calls return `None`.
    pub fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: a small seeded generator for the interleavings.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Random interleavings of several producers (begin → finish, sometimes abandon) and one
    /// consumer (take → publish the next version): the staleness of every taken rollout stays
    /// within the bound, the trainer always makes progress, and in synchronous mode nothing is
    /// ever generated in vain.
    #[test]
    fn staleness_is_never_exceeded() {
        for seed in 0..400u64 {
            let mut rng = Rng(seed);
            let max_staleness = rng.below(4);
            let per_step = 1 + rng.below(4) as usize;
            let producers = 1 + rng.below(5) as usize;
            let capacity = per_step * (max_staleness as usize + 1);
            let mut s: State<u64, u64> = State::new(0, max_staleness, capacity);
            // Each producer holds (version, rollouts begun) between begin and finish.
            let mut working: Vec<Option<(u64, usize)>> = vec![None; producers];
            let mut version = 0u64;
            let mut dropped = 0usize;
            let mut actions = 0;
            while version < 30 {
                actions += 1;
                assert!(actions < 100_000, "seed {seed}: no progress");
                let who = rng.below(producers as u64 + 1) as usize;
                if who == producers {
                    if let Some(t) = s.try_take(per_step, version) {
                        assert_eq!(t.items.len(), per_step);
                        for it in &t.items {
                            assert!(
                                version - it.version <= max_staleness,
                                "seed {seed}: took version {} at {version}",
                                it.version
                            );
                            assert_eq!(it.value, it.version);
                        }
                        dropped += t.dropped;
                        version += 1;
                        s.publish(version, version);
                    }
                    continue;
                }
                match working[who] {
                    None => {
                        let max = 1 + rng.below(3) as usize;
                        if let Some((v, w, k)) = s.try_begin_many(max) {
                            assert_eq!(v, w, "weights travel with their version");
                            assert!((1..=max).contains(&k));
                            assert!(s.queue.len() + s.in_flight <= capacity);
                            working[who] = Some((v, k));
                        }
                    }
                    Some((v, k)) => {
                        for _ in 0..k {
                            if rng.below(10) == 0 {
                                s.abandon();
                            } else {
                                s.finish(v, v);
                            }
                        }
                        working[who] = None;
                    }
                }
            }
            if max_staleness == 0 {
                assert_eq!(dropped, 0, "seed {seed}: synchronous mode wasted rollouts");
            }
        }
    }

    #[test]
    fn threads_make_progress_and_close_cleanly() {
        use std::sync::Arc;
        for max_staleness in [0u64, 2] {
            let buf = Arc::new(RolloutBuffer::<u64, u64>::new(0, max_staleness, 6));
            let workers: Vec<_> = (0..3)
                .map(|_| {
                    let buf = buf.clone();
                    std::thread::spawn(move || {
                        while let Some((v, _)) = buf.begin() {
                            buf.finish(v, v);
                        }
                    })
                })
                .collect();
            for version in 0..20u64 {
                let t = buf.take(3, version).expect("not closed");
                assert!(t
                    .items
                    .iter()
                    .all(|it| version - it.version <= max_staleness));
                buf.publish(version + 1, version + 1);
            }
            buf.close();
            for w in workers {
                w.join().expect("worker");
            }
        }
    }
}
