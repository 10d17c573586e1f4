//! The policy of the caching, stream-ordered device allocator, apart from the raw allocation
//! calls so it is tested without a GPU.
//!
//! Training asks for the same activation sizes every step; `cuMemAlloc` / `cuMemFree` are slow
//! and synchronise the device. The pool rounds requests up to size classes and keeps freed
//! blocks per (stream, class): a block freed on a stream is reused by a later allocation on the
//! *same* stream without any synchronisation, because the stream runs its work in order (the
//! kernels that used the old tensor finish before any kernel that uses the new one starts). A
//! block is never handed to another stream from the cache. When a raw allocation fails, the pool
//! frees every cached block and tries once more before reporting out-of-memory.
//!
//! Cross-stream use (PyTorch's `recordStream`): a block allocated on one stream and also used by
//! work queued on another (the communication stream reading a gradient buffer) is recorded with
//! [`Pool::record_stream`]. When such a block is freed, the pool records an event on each of
//! those streams and keeps the block aside until every event has completed; only then does it
//! go back to its own stream's cache. Without the record, the allocating stream could be handed
//! the block and overwrite it while the other stream's work still reads it. Pending blocks are
//! looked at (events queried, never waited on) at each allocation, and synchronised away by
//! [`Pool::empty_cache`].

use std::collections::HashMap;

/// Device allocations below this are rounded to 512 bytes; above, to four classes per power of
/// two (at most 25% slack), like the CPU allocator (alloc.rs) but with the device's alignment.
const SMALL: usize = 1 << 20;
const GRANULE: usize = 512;

/// The size class a request of `bytes` is served from.
pub fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(GRANULE);
    if bytes <= SMALL {
        return bytes.div_ceil(GRANULE) * GRANULE;
    }
    let pow = usize::BITS - 1 - bytes.leading_zeros();
    let step = 1usize << (pow - 2);
    bytes.div_ceil(step) * step
}

/// The raw device memory under a pool: `cuMemAlloc` / `cuMemFree` on a GPU, a counting fake in
/// tests.
pub trait RawAlloc {
    /// A device address for a block of `bytes`, or why not (out of memory).
    fn alloc(&mut self, bytes: usize) -> Result<u64, String>;
    /// Returns a block from [`RawAlloc::alloc`] (its work is done: the caller synchronised).
    fn free(&mut self, ptr: u64, bytes: usize);
    /// Waits until every stream's queued work is done (before cached blocks go back to the
    /// driver, since kernels may still use them).
    fn synchronize(&mut self);
    /// An event recorded now on `stream`: it completes once the work queued there so far is
    /// done.
    fn record_event(&mut self, stream: u64) -> Result<u64, String>;
    /// Whether `event` has completed (a query: never waits).
    fn event_done(&mut self, event: u64) -> bool;
    /// Releases an event from [`RawAlloc::record_event`].
    fn destroy_event(&mut self, event: u64);
}

/// The allocator's counters, in bytes except the counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes in blocks handed out and not yet freed (rounded to size classes).
    pub allocated: usize,
    /// Bytes obtained from the driver and not returned: allocated plus cached.
    pub reserved: usize,
    /// The highest `allocated` since the last [`Pool::reset_peak`].
    pub peak: usize,
    /// Raw device allocations made (each a `cuMemAlloc`).
    pub mallocs: usize,
    /// Allocations served from the cache.
    pub reuses: usize,
}

/// A block handed out by the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Its device address.
    pub ptr: u64,
    /// Its size class in bytes (at least the size asked for).
    pub class: usize,
    /// The stream it was allocated on and may be reused on.
    pub stream: u64,
}

/// A caching allocator over a [`RawAlloc`].
pub struct Pool<R: RawAlloc> {
    raw: R,
    free: HashMap<(u64, usize), Vec<u64>>,
    /// Other streams that used a live block (by address), from [`Pool::record_stream`].
    uses: HashMap<u64, Vec<u64>>,
    /// Freed blocks waiting for their events (one per other stream that used them).
    pending: Vec<(Block, Vec<u64>)>,
    stats: PoolStats,
}

impl<R: RawAlloc> Pool<R> {
    /// An empty pool over `raw`.
    pub fn new(raw: R) -> Pool<R> {
        Pool {
            raw,
            free: HashMap::new(),
            uses: HashMap::new(),
            pending: Vec::new(),
            stats: PoolStats::default(),
        }
    }

    /// A block of at least `bytes` for work queued on `stream`: a cached block of the class freed
    /// on that stream when there is one (no synchronisation needed), else a fresh one.
    pub fn alloc(&mut self, bytes: usize, stream: u64) -> Result<Block, String> {
        self.collect_pending();
        let class = size_class(bytes);
        let ptr = match self.free.get_mut(&(stream, class)).and_then(|v| v.pop()) {
            Some(ptr) => {
                self.stats.reuses += 1;
                ptr
            }
            None => {
                let ptr = match self.raw.alloc(class) {
                    Ok(p) => p,
                    Err(_) => {
                        // Out of memory: give the cached blocks back and try once more.
                        self.empty_cache();
                        self.raw.alloc(class).map_err(|e| {
                            format!(
                                "out of device memory allocating {bytes} bytes ({} allocated, {} reserved): {e}",
                                self.stats.allocated, self.stats.reserved
                            )
                        })?
                    }
                };
                self.stats.mallocs += 1;
                self.stats.reserved += class;
                ptr
            }
        };
        self.stats.allocated += class;
        self.stats.peak = self.stats.peak.max(self.stats.allocated);
        Ok(Block { ptr, class, stream })
    }

    /// Notes that work queued on `stream` uses `block` (live, from this pool): when it is freed
    /// it is kept from reuse until the work queued on `stream` by then is done. Its own stream
    /// needs no record.
    pub fn record_stream(&mut self, block: &Block, stream: u64) {
        if stream == block.stream {
            return;
        }
        let uses = self.uses.entry(block.ptr).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// Returns `block` to the cache of its stream. Work already queued on that stream may still
    /// read it; only later work on the same stream can get it back, so that is safe. A block
    /// other streams used waits for an event on each of them first.
    pub fn free(&mut self, block: Block) {
        self.stats.allocated -= block.class;
        if let Some(streams) = self.uses.remove(&block.ptr) {
            let mut events = Vec::with_capacity(streams.len());
            for s in streams {
                match self.raw.record_event(s) {
                    Ok(e) => events.push(e),
                    // No event: wait for everything instead, which covers that stream's work.
                    Err(_) => self.raw.synchronize(),
                }
            }
            if !events.is_empty() {
                self.pending.push((block, events));
                return;
            }
        }
        self.cache(block);
    }

    fn cache(&mut self, block: Block) {
        self.free
            .entry((block.stream, block.class))
            .or_default()
            .push(block.ptr);
    }

    /// Moves the pending blocks whose events have all completed to their stream's cache.
    fn collect_pending(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let raw = &mut self.raw;
            let (_, events) = &mut self.pending[i];
            events.retain(|&e| {
                let done = raw.event_done(e);
                if done {
                    raw.destroy_event(e);
                }
                !done
            });
            if events.is_empty() {
                let (block, _) = self.pending.swap_remove(i);
                self.cache(block);
            } else {
                i += 1;
            }
        }
    }

    /// Freed blocks still waiting for another stream's work.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Synchronises, then returns every cached block (and every pending one) to the driver.
    pub fn empty_cache(&mut self) {
        if self.free.values().all(|v| v.is_empty()) && self.pending.is_empty() {
            return;
        }
        self.raw.synchronize();
        for (block, events) in std::mem::take(&mut self.pending) {
            for e in events {
                self.raw.destroy_event(e);
            }
            self.cache(block);
        }
        for ((_, class), ptrs) in self.free.drain() {
            for p in ptrs {
                self.raw.free(p, class);
                self.stats.reserved -= class;
            }
        }
    }

    /// The counters now.
    pub fn stats(&self) -> PoolStats {
        self.stats
    }

    /// Restarts peak tracking from the current usage.
    pub fn reset_peak(&mut self) {
        self.stats.peak = self.stats.allocated;
    }

    /// The raw allocator (to release it, or to inspect it in tests).
    pub fn raw(&self) -> &R {
        &self.raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake device: hands out increasing addresses, counts calls, can run out of memory.
    #[derive(Default)]
    struct Fake {
        next: u64,
        live: usize,
        limit: usize,
        frees: usize,
        syncs: usize,
        /// Events recorded; those numbered up to `done` have completed.
        events: u64,
        done: u64,
        destroyed: usize,
    }

    impl RawAlloc for Fake {
        fn alloc(&mut self, bytes: usize) -> Result<u64, String> {
            if self.limit > 0 && self.live + bytes > self.limit {
                return Err("CUDA_ERROR_OUT_OF_MEMORY".into());
            }
            self.live += bytes;
            self.next += bytes as u64;
            Ok(self.next)
        }
        fn free(&mut self, _ptr: u64, bytes: usize) {
            self.live -= bytes;
            self.frees += 1;
        }
        fn synchronize(&mut self) {
            self.syncs += 1;
            self.done = self.events;
        }
        fn record_event(&mut self, _stream: u64) -> Result<u64, String> {
            self.events += 1;
            Ok(self.events)
        }
        fn event_done(&mut self, event: u64) -> bool {
            event <= self.done
        }
        fn destroy_event(&mut self, _event: u64) {
            self.destroyed += 1;
        }
    }

    #[test]
    fn classes_bound_the_slack() {
        for n in [0, 1, 511, 513, SMALL - 1, SMALL + 1, 3 << 20, (1 << 30) + 7] {
            let c = size_class(n);
            assert!(c >= n && c.is_multiple_of(GRANULE), "class {c} for {n}");
            assert!(c <= n.max(GRANULE) + n / 4 + GRANULE, "class {c} for {n}");
        }
        assert_eq!(size_class(5 << 20), 5 << 20);
    }

    #[test]
    fn a_freed_block_is_reused_on_its_stream_without_a_malloc_or_a_sync() {
        let mut pool = Pool::new(Fake::default());
        let a = pool.alloc(10_000, 1).expect("fits");
        pool.free(a);
        let b = pool.alloc(9_900, 1).expect("fits");
        assert_eq!(b.ptr, a.ptr, "same class, same stream: the cached block");
        let s = pool.stats();
        assert_eq!((s.mallocs, s.reuses), (1, 1));
        assert_eq!(pool.raw().syncs, 0);
        assert_eq!(s.allocated, size_class(10_000));
        assert_eq!(s.reserved, size_class(10_000));
    }

    #[test]
    fn another_stream_never_gets_a_cached_block() {
        let mut pool = Pool::new(Fake::default());
        let a = pool.alloc(4096, 1).expect("fits");
        pool.free(a);
        let b = pool.alloc(4096, 2).expect("fits");
        assert_ne!(b.ptr, a.ptr);
        assert_eq!(pool.stats().mallocs, 2);
        assert_eq!(pool.stats().reserved, 2 * 4096);
    }

    #[test]
    fn a_block_used_on_another_stream_waits_for_that_streams_event() {
        let mut pool = Pool::new(Fake::default());
        let a = pool.alloc(4096, 1).expect("fits");
        pool.record_stream(&a, 2);
        pool.record_stream(&a, 2);
        pool.record_stream(&a, 1); // its own stream: nothing to wait for
        pool.free(a);
        assert_eq!(pool.raw().events, 1, "one event, on stream 2");
        assert_eq!(pool.pending(), 1);
        let b = pool.alloc(4096, 1).expect("fits");
        assert_ne!(b.ptr, a.ptr, "stream 2 may still be reading it");
        assert_eq!(
            pool.stats().allocated,
            4096,
            "a pending block is not allocated"
        );
        assert_eq!(pool.stats().reserved, 2 * 4096);
        // Stream 2's work is done: the next allocation on stream 1 gets the block back.
        pool.raw.done = 1;
        let c = pool.alloc(4096, 1).expect("fits");
        assert_eq!(c.ptr, a.ptr);
        assert_eq!((pool.pending(), pool.raw().destroyed), (0, 1));
        assert_eq!(pool.raw().syncs, 0, "no synchronisation on the way");
        // The record ended with the block: its next life starts without one.
        pool.free(c);
        assert_eq!(pool.pending(), 0);
        pool.free(b);
    }

    #[test]
    fn emptying_the_cache_synchronises_pending_blocks_away() {
        let mut pool = Pool::new(Fake::default());
        let a = pool.alloc(1 << 20, 1).expect("fits");
        pool.record_stream(&a, 9);
        pool.free(a);
        assert_eq!(pool.pending(), 1);
        pool.empty_cache();
        assert_eq!(pool.pending(), 0);
        assert_eq!((pool.raw().syncs, pool.raw().frees), (1, 1));
        assert_eq!(pool.stats().reserved, 0);
    }

    #[test]
    fn peak_and_allocated_track_live_blocks() {
        let mut pool = Pool::new(Fake::default());
        let a = pool.alloc(1 << 20, 1).expect("fits");
        let b = pool.alloc(1 << 20, 1).expect("fits");
        pool.free(a);
        let s = pool.stats();
        assert_eq!(
            (s.allocated, s.peak, s.reserved),
            (1 << 20, 2 << 20, 2 << 20)
        );
        pool.reset_peak();
        assert_eq!(pool.stats().peak, 1 << 20);
        pool.free(b);
        assert_eq!(pool.stats().allocated, 0);
    }

    #[test]
    fn out_of_memory_empties_the_cache_and_retries() {
        let mut pool = Pool::new(Fake {
            limit: 3 << 20,
            ..Fake::default()
        });
        let a = pool.alloc(2 << 20, 1).expect("fits");
        pool.free(a);
        // 2 MiB cached + 2 MiB new > 3 MiB: the pool must give the cached block back first.
        let b = pool
            .alloc(2 << 20, 7)
            .expect("fits once the cache is empty");
        assert_eq!(pool.raw().frees, 1);
        assert_eq!(
            pool.raw().syncs,
            1,
            "cached blocks go back only after a sync"
        );
        assert_eq!(pool.stats().reserved, 2 << 20);
        pool.free(b);
        let err = pool.alloc(4 << 20, 1).expect_err("larger than the device");
        assert!(err.contains("out of device memory"), "{err}");
    }
}
