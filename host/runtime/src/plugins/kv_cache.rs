//! The host's KV cache: keys and values of every position a sequence has seen, per layer.
//!
//! Two shapes of batch use it. A *shared* cache ([`KvCache::new`]) holds `[B, Hkv, S, D]` per
//! layer for `B` rows that advance together (same length, same positions): `generate_batch` and
//! RL rollouts. A *per-row* cache ([`KvCache::per_row`]) is a list of single-row caches, one per
//! batch row, each with its own length: continuous batching, where requests join a running batch
//! at any step and leave it when done. Rows then keep their own positions (`[B, T]`), and the
//! attention op attends each row over its own cache only, so a row's arithmetic is the same
//! whatever else is in the batch.

use anneal_engine::Tensor;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Per-layer inference state kept by the host: keys and values `[B, Hkv, S, D]` of every
/// position seen so far, addressed by layer index; or, for a per-row batch, one such cache per
/// row.
#[derive(Default)]
pub struct KvCache {
    layers: Mutex<HashMap<usize, (Tensor, Tensor)>>,
    rows: Vec<Arc<KvCache>>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// A batch whose row `i` reads and extends `rows[i]` (a single-row cache, which may be
    /// shared with later batches: the same row can sit at another index next step).
    pub fn per_row(rows: Vec<Arc<KvCache>>) -> Self {
        KvCache {
            layers: Mutex::default(),
            rows,
        }
    }

    /// The row caches of a per-row batch; empty for a shared cache.
    pub fn rows(&self) -> &[Arc<KvCache>] {
        &self.rows
    }

    /// True for a batch made with [`KvCache::per_row`].
    pub fn is_per_row(&self) -> bool {
        !self.rows.is_empty()
    }

    /// Appends `k`, `v` to layer `layer` along the sequence dim; returns everything cached.
    pub fn append(
        &self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> anneal_engine::Result<(Tensor, Tensor)> {
        if self.is_per_row() {
            return Err(anneal_engine::Error::Invalid {
                op: "kv_cache.append",
                msg: "a per-row cache is appended row by row (KvCache::rows)".into(),
            });
        }
        let mut layers = self.layers.lock().expect("kv cache lock poisoned");
        let (k, v) = match layers.get(&layer) {
            Some((pk, pv)) => (concat_seq(pk, k)?, concat_seq(pv, v)?),
            None => (k.detach().contiguous()?, v.detach().contiguous()?),
        };
        layers.insert(layer, (k.clone(), v.clone()));
        Ok((k, v))
    }

    /// Number of cached positions (0 when empty); for a per-row batch, the longest row's.
    pub fn len(&self) -> usize {
        if self.is_per_row() {
            return self.rows.iter().map(|r| r.len()).max().unwrap_or(0);
        }
        let layers = self.layers.lock().expect("kv cache lock poisoned");
        layers.values().next().map_or(0, |(k, _)| k.shape()[2])
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `[B, H, S1, D] ++ [B, H, S2, D]` along dim 2, without autograd (cached state is constant).
fn concat_seq(a: &Tensor, b: &Tensor) -> anneal_engine::Result<Tensor> {
    let (sa, sb) = (a.shape(), b.shape());
    if sa.len() != 4 || sb.len() != 4 || sa[0] != sb[0] || sa[1] != sb[1] || sa[3] != sb[3] {
        return Err(anneal_engine::Error::ShapeMismatch {
            op: "kv_cache.append",
            lhs: sa.to_vec(),
            rhs: sb.to_vec(),
        });
    }
    let out = Tensor::zeros(&[sa[0], sa[1], sa[2] + sb[2], sa[3]], a.dtype());
    out.narrow(2, 0, sa[2])?.copy_from(a)?;
    out.narrow(2, sa[2], sb[2])?.copy_from(b)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(b: usize, s: usize, fill: f32) -> Tensor {
        Tensor::from_vec(vec![fill; b * 2 * s * 4], &[b, 2, s, 4]).unwrap()
    }

    #[test]
    fn rows_of_a_per_row_batch_grow_on_their_own() {
        let (a, b) = (Arc::new(KvCache::new()), Arc::new(KvCache::new()));
        a.append(0, &kv(1, 3, 1.0), &kv(1, 3, 1.0)).unwrap();
        b.append(0, &kv(1, 5, 2.0), &kv(1, 5, 2.0)).unwrap();
        let batch = KvCache::per_row(vec![a.clone(), b.clone()]);
        assert!(batch.is_per_row());
        assert_eq!(batch.len(), 5);
        let err = batch.append(0, &kv(2, 1, 0.0), &kv(2, 1, 0.0)).unwrap_err();
        assert!(err.to_string().contains("row by row"), "{err}");
        batch.rows()[0]
            .append(0, &kv(1, 1, 3.0), &kv(1, 1, 3.0))
            .unwrap();
        assert_eq!((a.len(), b.len()), (4, 5));
    }
}
