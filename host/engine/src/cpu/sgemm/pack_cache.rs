//! Packed copies of right operands that do not change between products (a model's weights
//! while it decodes), so a product with a few rows does not repack its weights every call.
//!
//! Why: packing B is one strided pass over all of B. With hundreds of rows that is noise next
//! to the arithmetic, but a decode step has one row per sequence, and packing then costs
//! several times the product itself. An entry is keyed by the storage it was packed from, held
//! weakly (so its address cannot be reused while the entry lives), by that storage's write
//! count (any write through a tensor bumps it, so a stale copy is never used), and by the
//! operand's layout. A B is packed into the cache only the second time it is seen unchanged:
//! activations and KV caches change between calls and never take memory here. The cache is
//! bounded (`ANNEAL_PACK_CACHE_MB`, default 1024; 0 turns it off); once full, further operands
//! are packed per call as before.
//!
//! The cached layout is exactly what [`super::sgemm`] packs per block, so results are the same
//! bits with or without the cache.

use super::{pack_b, MatRef, KC, NC, NR};
use crate::storage::Storage;
use std::sync::{Arc, Mutex, RwLock, Weak};

/// Which operand a packed copy was made from: the storage (weakly), its write count, and the
/// matrix's place and shape in it.
#[derive(Clone)]
pub(crate) struct Source {
    storage: Weak<RwLock<Storage>>,
    writes: u64,
    off: usize,
    rs: usize,
    cs: usize,
    k: usize,
    n: usize,
}

impl Source {
    /// The key of the `k × n` matrix `b` read from `storage`, whose write count is `writes`
    /// (read while the caller holds the storage's read lock, so it cannot change meanwhile).
    pub(crate) fn new(
        storage: &Arc<RwLock<Storage>>,
        writes: u64,
        b: &MatRef<'_>,
        k: usize,
        n: usize,
    ) -> Source {
        Source {
            storage: Arc::downgrade(storage),
            writes,
            off: b.off,
            rs: b.rs,
            cs: b.cs,
            k,
            n,
        }
    }

    fn same(&self, o: &Source) -> bool {
        Weak::ptr_eq(&self.storage, &o.storage)
            && (self.writes, self.off, self.rs, self.cs, self.k, self.n)
                == (o.writes, o.off, o.rs, o.cs, o.k, o.n)
    }

    fn same_matrix(&self, o: &Source) -> bool {
        Weak::ptr_eq(&self.storage, &o.storage)
            && (self.off, self.rs, self.cs, self.k, self.n) == (o.off, o.rs, o.cs, o.k, o.n)
    }

    fn alive(&self) -> bool {
        self.storage.strong_count() > 0
    }

    /// Worth keeping next to `src`: its storage lives, and it is not an older version of
    /// `src`'s matrix.
    fn current_beside(&self, src: &Source) -> bool {
        self.alive() && (self.same(src) || !self.same_matrix(src))
    }
}

/// All of B packed: for each KC block of k and NC block of columns, the strips [`pack_b`] makes.
pub(crate) struct PackedB {
    data: Vec<f32>,
    /// NR-column strips across all of n.
    strips: usize,
}

impl PackedB {
    fn pack(b: MatRef<'_>, k: usize, n: usize, parallel: bool) -> PackedB {
        let strips = n.div_ceil(NR);
        let mut data = vec![0f32; strips * NR * k];
        for p0 in (0..k).step_by(KC) {
            let kc = KC.min(k - p0);
            for j0 in (0..n).step_by(NC) {
                let nc = NC.min(n - j0);
                let dst = &mut data[Self::start(strips, p0, j0, kc)..][..nc.div_ceil(NR) * NR * kc];
                pack_b(b, n, p0, j0, kc, nc, dst, parallel);
            }
        }
        PackedB { data, strips }
    }

    /// Where block (`p0`, `j0`) of depth `kc` starts: the KC blocks before it span all strips,
    /// and NC is a multiple of NR, so the strips before `j0` are `j0 / NR`.
    fn start(strips: usize, p0: usize, j0: usize, kc: usize) -> usize {
        p0 * strips * NR + (j0 / NR) * NR * kc
    }

    /// The packed block for rows `p0..p0+kc` of B and columns `j0..j0+nc`.
    pub(crate) fn block(&self, p0: usize, j0: usize, kc: usize, nc: usize) -> &[f32] {
        &self.data[Self::start(self.strips, p0, j0, kc)..][..nc.div_ceil(NR) * NR * kc]
    }

    fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}

#[derive(Default)]
struct Cache {
    packed: Vec<(Source, Arc<PackedB>)>,
    /// Operands seen once, unchanged since: packed into the cache when seen again.
    seen: Vec<Source>,
    bytes: usize,
}

impl Cache {
    /// Drops entries whose storage is gone, and older versions of `src`'s matrix.
    fn prune(&mut self, src: &Source) {
        let mut freed = 0;
        self.packed.retain(|(s, p)| {
            let keep = s.current_beside(src);
            if !keep {
                freed += p.bytes();
            }
            keep
        });
        self.bytes -= freed;
        self.seen.retain(|s| s.current_beside(src));
    }
}

/// Bounds the list of operands seen once (live activations of small products).
const MAX_SEEN: usize = 4096;

static CACHE: Mutex<Option<Cache>> = Mutex::new(None);

fn limit_bytes() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("ANNEAL_PACK_CACHE_MB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(1024)
            .saturating_mul(1 << 20)
    })
}

/// The cached packing of `b` (described by `src`), packing it now if this is the second time
/// it is seen unchanged and it fits the cache; `None` means: pack per call.
pub(crate) fn get(src: &Source, b: MatRef<'_>, parallel: bool) -> Option<Arc<PackedB>> {
    let limit = limit_bytes();
    let size = src.n.div_ceil(NR) * NR * src.k * 4;
    if limit == 0 {
        return None;
    }
    {
        let mut guard = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        let cache = guard.get_or_insert_with(Cache::default);
        if let Some((_, p)) = cache.packed.iter().find(|(s, _)| s.same(src)) {
            return Some(p.clone());
        }
        cache.prune(src);
        if !cache.seen.iter().any(|s| s.same(src)) {
            if cache.seen.len() >= MAX_SEEN {
                cache.seen.clear();
            }
            cache.seen.push(src.clone());
            return None;
        }
        if cache.bytes + size > limit {
            return None;
        }
    }
    // Packed without holding the lock: packing may fan out over rayon, whose workers may be
    // waiting for this lock in another product.
    let packed = Arc::new(PackedB::pack(b, src.k, src.n, parallel));
    let mut guard = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let cache = guard.get_or_insert_with(Cache::default);
    if let Some((_, p)) = cache.packed.iter().find(|(s, _)| s.same(src)) {
        return Some(p.clone());
    }
    if cache.bytes + size > limit {
        return Some(packed);
    }
    cache.seen.retain(|s| !s.same(src));
    cache.bytes += size;
    cache.packed.push((src.clone(), packed.clone()));
    Some(packed)
}
