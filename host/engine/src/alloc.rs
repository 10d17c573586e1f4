//! A caching allocator for CPU tensor memory.
//!
//! Training allocates the same activation sizes every step; returning freed blocks to a size-class
//! cache instead of the system allocator removes that churn (page faults, zeroing of fresh pages).
//! Blocks are 64-byte aligned so SIMD kernels can use aligned loads on whole buffers.

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const ALIGN: usize = 64;
/// Cached bytes above this limit are returned to the system instead of kept.
const DEFAULT_CACHE_LIMIT: usize = 4 << 30;

/// Counters of the CPU allocator, all in bytes except the counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes held by live tensors (rounded up to size classes).
    pub current_bytes: usize,
    /// The highest `current_bytes` since the last [`reset_peak`].
    pub peak_bytes: usize,
    /// Bytes kept in the cache, ready for reuse.
    pub cached_bytes: usize,
    /// Allocations served from the cache.
    pub cache_hits: usize,
    /// Allocations that went to the system allocator.
    pub system_allocs: usize,
}

struct Cache {
    free: HashMap<usize, Vec<NonNull<u8>>>,
    cached_bytes: usize,
    limit: usize,
}

// SAFETY: the pointers in the cache are owned exclusively by the cache; no other thread
// holds them while they are there.
unsafe impl Send for Cache {}

static CACHE: Mutex<Option<Cache>> = Mutex::new(None);
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static HITS: AtomicUsize = AtomicUsize::new(0);
static SYSTEM: AtomicUsize = AtomicUsize::new(0);

/// Rounds a request up to its size class: 64-byte granularity below 4 KiB, then four classes per
/// power of two (at most 25% slack).
fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(ALIGN);
    if bytes <= 4096 {
        return bytes.div_ceil(ALIGN) * ALIGN;
    }
    let pow = usize::BITS - 1 - bytes.leading_zeros();
    let step = 1usize << (pow - 2);
    bytes.div_ceil(step) * step
}

/// An owned, 64-byte aligned, always-initialized block of bytes from the caching allocator.
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    class: usize,
}

// SAFETY: a Buffer owns its memory exclusively, like a Vec<u8>.
unsafe impl Send for Buffer {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// A buffer of `len` zero bytes.
    pub fn zeroed(len: usize) -> Buffer {
        let mut b = Buffer::any(len);
        b.as_bytes_mut().fill(0);
        b
    }

    /// A buffer of `len` bytes with unspecified (but initialized) contents, for kernels that
    /// overwrite every byte.
    pub fn any(len: usize) -> Buffer {
        let class = size_class(len);
        let cached = {
            let mut guard = CACHE.lock().expect("allocator cache poisoned");
            let cache = guard.get_or_insert_with(new_cache);
            let hit = cache.free.get_mut(&class).and_then(|v| v.pop());
            if hit.is_some() {
                cache.cached_bytes -= class;
            }
            hit
        };
        let ptr = match cached {
            Some(p) => {
                HITS.fetch_add(1, Ordering::Relaxed);
                p
            }
            None => {
                SYSTEM.fetch_add(1, Ordering::Relaxed);
                let layout = Layout::from_size_align(class, ALIGN).expect("size class overflows");
                // SAFETY: layout has non-zero size. Fresh memory is zeroed so that every byte a
                // Buffer exposes is initialized.
                let p = unsafe { alloc::alloc_zeroed(layout) };
                NonNull::new(p).unwrap_or_else(|| alloc::handle_alloc_error(layout))
            }
        };
        let now = CURRENT.fetch_add(class, Ordering::Relaxed) + class;
        PEAK.fetch_max(now, Ordering::Relaxed);
        Buffer { ptr, len, class }
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for `class >= len` initialized bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        CURRENT.fetch_sub(self.class, Ordering::Relaxed);
        let mut guard = CACHE.lock().expect("allocator cache poisoned");
        let cache = guard.get_or_insert_with(new_cache);
        if cache.cached_bytes + self.class <= cache.limit {
            cache.cached_bytes += self.class;
            cache.free.entry(self.class).or_default().push(self.ptr);
        } else {
            drop(guard);
            // SAFETY: allocated in `any` with exactly this layout.
            unsafe {
                alloc::dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.class, ALIGN),
                )
            };
        }
    }
}

fn new_cache() -> Cache {
    Cache {
        free: HashMap::new(),
        cached_bytes: 0,
        limit: DEFAULT_CACHE_LIMIT,
    }
}

/// The allocator's counters now.
pub fn memory_stats() -> MemoryStats {
    let cached_bytes = CACHE
        .lock()
        .expect("allocator cache poisoned")
        .as_ref()
        .map_or(0, |c| c.cached_bytes);
    MemoryStats {
        current_bytes: CURRENT.load(Ordering::Relaxed),
        peak_bytes: PEAK.load(Ordering::Relaxed),
        cached_bytes,
        cache_hits: HITS.load(Ordering::Relaxed),
        system_allocs: SYSTEM.load(Ordering::Relaxed),
    }
}

/// Restarts peak tracking from the current usage.
pub fn reset_peak() {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// The highest bytes held at once on `device` since its last [`reset_peak_on`]: the host
/// allocator's peak for the CPU, the device pool's for a GPU (0 for a GPU never used).
pub fn peak_bytes_on(device: crate::Device) -> usize {
    match device {
        crate::Device::Cpu => memory_stats().peak_bytes,
        #[cfg(feature = "cuda")]
        crate::Device::Cuda(n) => crate::cuda::memory_stats(n).map_or(0, |s| s.peak),
        #[cfg(not(feature = "cuda"))]
        crate::Device::Cuda(_) => 0,
    }
}

/// Restarts the peak of `device` from its current usage (see [`peak_bytes_on`]).
pub fn reset_peak_on(device: crate::Device) {
    match device {
        crate::Device::Cpu => reset_peak(),
        #[cfg(feature = "cuda")]
        crate::Device::Cuda(n) => {
            if crate::cuda::memory_stats(n).is_some() {
                if let Ok(g) = crate::cuda::gpu(n) {
                    g.reset_peak();
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        crate::Device::Cuda(_) => {}
    }
}

/// Returns every cached block to the system allocator.
pub fn empty_cache() {
    let mut guard = CACHE.lock().expect("allocator cache poisoned");
    if let Some(cache) = guard.as_mut() {
        for (class, ptrs) in cache.free.drain() {
            for p in ptrs {
                // SAFETY: every cached pointer was allocated with this class and alignment.
                unsafe {
                    alloc::dealloc(p.as_ptr(), Layout::from_size_align_unchecked(class, ALIGN))
                };
            }
        }
        cache.cached_bytes = 0;
    }
}

/// Sets how many bytes the cache may keep (freed blocks beyond it go back to the system).
pub fn set_cache_limit(bytes: usize) {
    let mut guard = CACHE.lock().expect("allocator cache poisoned");
    guard.get_or_insert_with(new_cache).limit = bytes;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_bound_slack() {
        for n in [1, 63, 64, 65, 4095, 4097, 10_000, 1 << 20, (1 << 20) + 1] {
            let c = size_class(n);
            assert!(c >= n);
            assert!(c <= n.max(64) + n / 4 + 64, "class {c} for {n}");
            assert_eq!(c % 64, 0);
        }
    }

    #[test]
    fn reuses_freed_blocks_and_tracks_peak() {
        let n = (3 << 20) + 12_345; // an odd size no other test uses
        drop(Buffer::zeroed(n));
        let hits = memory_stats().cache_hits;
        let b = Buffer::zeroed(n);
        assert!(memory_stats().cache_hits > hits);
        assert!(memory_stats().peak_bytes >= size_class(n));
        assert!(b.as_bytes().iter().all(|&x| x == 0));
    }
}
