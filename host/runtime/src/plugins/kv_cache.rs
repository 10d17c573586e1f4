//! The host's KV cache: keys and values of every position a sequence has seen, per layer.
//!
//! Two shapes of batch use it. A *shared* cache ([`KvCache::new`]) holds `[B, Hkv, S, D]` per
//! layer for `B` rows that advance together (same length, same positions): `generate_batch` and
//! RL rollouts. A *per-row* cache ([`KvCache::per_row`]) is a list of single-row caches, one per
//! batch row, each with its own length: continuous batching, where requests join a running batch
//! at any step and leave it when done. Rows then keep their own positions (`[B, T]`), and the
//! attention op attends each row over its own cache only, so a row's arithmetic is the same
//! whatever else is in the batch.
//!
//! Besides keys and values, a layer may keep named state of any shape (see `ops_state.rs`): a
//! cache grown along a dim (a latent cache) or a tensor replaced each call (a recurrent state).

use anneal_engine::ops::{DeltaRuleCache, DeltaRuleParams};
use anneal_engine::Tensor;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A named state of a layer: `(layer, name)`.
type StateKey = (usize, String);

/// Per-layer inference state kept by the host: keys and values `[B, Hkv, S, D]` of every
/// position seen so far, addressed by layer index; or, for a per-row batch, one such cache per
/// row.
#[derive(Default)]
pub struct KvCache {
    layers: Mutex<HashMap<usize, Layer>>,
    /// Named per-layer state: `(layer, name)` to its tensor and, for a cache grown by
    /// [`KvCache::append_state`], the dim it grows along.
    states: Mutex<HashMap<StateKey, (Tensor, Option<usize>)>>,
    /// The delta rule's decode state per layer (linear attention).
    delta_rules: Mutex<HashMap<usize, DeltaRuleCache>>,
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
            rows,
            ..Default::default()
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
        let layer = match layers.entry(layer) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(Layer::for_first(k, v)?),
        };
        layer.append(k, v)
    }

    /// Layer `layer`'s state `name`, if set (a shared cache's own; see [`KvCache::rows`]).
    pub fn state(&self, layer: usize, name: &str) -> Option<Tensor> {
        let states = self.states.lock().expect("kv cache lock poisoned");
        states
            .get(&(layer, name.to_string()))
            .map(|(t, _)| t.clone())
    }

    /// Replaces layer `layer`'s state `name` (kept detached: inference state has no gradient).
    pub fn set_state(&self, layer: usize, name: &str, t: &Tensor) {
        let mut states = self.states.lock().expect("kv cache lock poisoned");
        states.insert((layer, name.to_string()), (t.detach(), None));
    }

    /// Feeds the tokens `q` .. `beta` (shaped as for `anneal_engine::ops::gated_delta_rule`) to
    /// layer `layer`'s delta-rule state, started from zeros on the first call; returns their
    /// outputs. A shared cache's state covers its whole batch.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_rule_step(
        &self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        params: DeltaRuleParams,
    ) -> anneal_engine::Result<Tensor> {
        let mut caches = self.delta_rules.lock().expect("kv cache lock poisoned");
        let cache = match caches.entry(layer) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let (qs, vs) = (q.shape(), v.shape());
                if qs.len() != 4 || vs.len() != 4 {
                    return Err(anneal_engine::Error::ShapeMismatch {
                        op: "kv_cache.delta_rule_step",
                        lhs: qs.to_vec(),
                        rhs: vs.to_vec(),
                    });
                }
                e.insert(DeltaRuleCache::zeros(qs[0], vs[2], qs[3], vs[3], params)?)
            }
        };
        cache.step(q, k, v, g, beta)
    }

    /// Bytes of fixed-size inference state one sequence holds, over all layers: recurrent
    /// states (the delta rule's, with what its exact decode keeps) and convolution tails; what
    /// grows with the tokens is in [`KvCache::bytes_per_token`] instead.
    pub fn state_bytes_per_sequence(&self) -> usize {
        if self.is_per_row() {
            return self
                .rows
                .first()
                .map_or(0, |r| r.state_bytes_per_sequence());
        }
        let per_row =
            |bytes: usize, t: &Tensor| bytes / t.shape().first().copied().unwrap_or(1).max(1);
        let states = self.states.lock().expect("kv cache lock poisoned");
        let fixed: usize = states
            .values()
            .filter(|(_, grows)| grows.is_none())
            .map(|(t, _)| per_row(t.numel() * t.dtype().size_in_bytes(), t))
            .sum();
        let deltas = self.delta_rules.lock().expect("kv cache lock poisoned");
        fixed
            + deltas
                .values()
                .map(|c| per_row(c.bytes(), c.state()))
                .sum::<usize>()
    }

    /// Appends `x` to layer `layer`'s cache `name` along `dim` (starting it when empty);
    /// returns everything cached.
    pub fn append_state(
        &self,
        layer: usize,
        name: &str,
        x: &Tensor,
        dim: usize,
    ) -> anneal_engine::Result<Tensor> {
        let mut states = self.states.lock().expect("kv cache lock poisoned");
        let key = (layer, name.to_string());
        let all = match states.get(&key) {
            Some((old, _)) => anneal_engine::ops::cat(&[old.clone(), x.detach()], dim as isize)?,
            None => x.detach(),
        };
        states.insert(key, (all.clone(), Some(dim)));
        Ok(all)
    }

    /// Bytes of keys and values one cached position of one sequence takes, summed over the
    /// layers, latent caches included (0 when empty).
    pub fn bytes_per_token(&self) -> usize {
        if self.is_per_row() {
            return self.rows.first().map_or(0, |r| r.bytes_per_token());
        }
        let layers = self.layers.lock().expect("kv cache lock poisoned");
        let kv: usize = layers
            .values()
            .map(|l| {
                let row = |t: &Tensor| {
                    let s = t.shape();
                    s[1] * s[3] * t.dtype().size_in_bytes()
                };
                row(&l.k) + row(&l.v)
            })
            .sum();
        // Caches grown along a dim (a latent cache): their bytes per row and position.
        let states = self.states.lock().expect("kv cache lock poisoned");
        let grown: usize = states
            .values()
            .filter_map(|(t, dim)| {
                let s = t.shape();
                let (rows, len) = (s.first().copied()?, s.get((*dim)?).copied()?);
                (rows > 0 && len > 0).then(|| t.numel() * t.dtype().size_in_bytes() / rows / len)
            })
            .sum();
        kv + grown
    }

    /// Bytes one sequence's cache holds now, everything together: keys and values, named
    /// state (grown or replaced) and delta-rule states; for a per-row batch, the first row's.
    pub fn bytes_held(&self) -> usize {
        if self.is_per_row() {
            return self.rows.first().map_or(0, |r| r.bytes_held());
        }
        let per_row = |t: &Tensor| {
            let rows = t.shape().first().copied().unwrap_or(1).max(1);
            t.numel() * t.dtype().size_in_bytes() / rows
        };
        let layers = self.layers.lock().expect("kv cache lock poisoned");
        let kv: usize = layers
            .values()
            .map(|l| {
                let row = |t: &Tensor| {
                    let s = t.shape();
                    s[1] * l.len * s[3] * t.dtype().size_in_bytes()
                };
                row(&l.k) + row(&l.v)
            })
            .sum();
        let states = self.states.lock().expect("kv cache lock poisoned");
        let named: usize = states.values().map(|(t, _)| per_row(t)).sum();
        let deltas = self.delta_rules.lock().expect("kv cache lock poisoned");
        let delta: usize = deltas
            .values()
            .map(|c| c.bytes() / c.state().shape().first().copied().unwrap_or(1).max(1))
            .sum();
        kv + named + delta
    }

    /// The shapes of the named states, by layer and name: rows of a per-row batch can share
    /// a forward only when theirs agree (the state ops stack rows along dim 0).
    pub fn state_shapes(&self) -> Vec<(usize, String, Vec<usize>)> {
        let states = self.states.lock().expect("kv cache lock poisoned");
        let mut out: Vec<_> = states
            .iter()
            .map(|((layer, name), (t, _))| (*layer, name.clone(), t.shape().to_vec()))
            .collect();
        out.sort();
        out
    }

    /// Number of cached positions (0 when empty); for a per-row batch, the longest row's.
    pub fn len(&self) -> usize {
        if self.is_per_row() {
            return self.rows.iter().map(|r| r.len()).max().unwrap_or(0);
        }
        let layers = self.layers.lock().expect("kv cache lock poisoned");
        layers.values().next().map_or(0, |l| l.len)
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Positions a layer's buffers have room for at first, at least.
const MIN_CAPACITY: usize = 256;

/// One layer's keys and values: buffers `[B, H, capacity, D]` of which the first `len`
/// positions are filled. Appending writes after them (the positions before are never rewritten,
/// so views handed out earlier stay valid) and doubles the buffers when full, so a decode step
/// copies its new position only, not the whole cache.
struct Layer {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl Layer {
    /// Empty buffers shaped for `k` and `v` (`[B, H, S, D]`).
    fn for_first(k: &Tensor, v: &Tensor) -> anneal_engine::Result<Layer> {
        let s = |t: &Tensor| -> anneal_engine::Result<Vec<usize>> {
            match t.shape() {
                [b, h, _, d] => Ok(vec![*b, *h, 0, *d]),
                other => Err(anneal_engine::Error::ShapeMismatch {
                    op: "kv_cache.append",
                    lhs: other.to_vec(),
                    rhs: vec![0, 0, 0, 0],
                }),
            }
        };
        Ok(Layer {
            k: Tensor::zeros_on(&s(k)?, k.dtype(), k.device())?,
            v: Tensor::zeros_on(&s(v)?, v.dtype(), v.device())?,
            len: 0,
        })
    }

    /// Appends `k`, `v` `[B, H, S, D]`; returns views of every cached position.
    fn append(&mut self, k: &Tensor, v: &Tensor) -> anneal_engine::Result<(Tensor, Tensor)> {
        for (buf, new) in [(&self.k, k), (&self.v, v)] {
            let (sa, sb) = (buf.shape(), new.shape());
            if sb.len() != 4 || sa[0] != sb[0] || sa[1] != sb[1] || sa[3] != sb[3] {
                return Err(anneal_engine::Error::ShapeMismatch {
                    op: "kv_cache.append",
                    lhs: sa.to_vec(),
                    rhs: sb.to_vec(),
                });
            }
        }
        let (added, len) = (k.shape()[2], self.len + k.shape()[2]);
        if v.shape()[2] != added {
            return Err(anneal_engine::Error::ShapeMismatch {
                op: "kv_cache.append",
                lhs: k.shape().to_vec(),
                rhs: v.shape().to_vec(),
            });
        }
        if len > self.k.shape()[2] {
            let capacity = len.max(MIN_CAPACITY).next_power_of_two();
            self.k = regrow(&self.k, self.len, capacity)?;
            self.v = regrow(&self.v, self.len, capacity)?;
        }
        self.k.narrow(2, self.len, added)?.copy_from(&k.detach())?;
        self.v.narrow(2, self.len, added)?.copy_from(&v.detach())?;
        self.len = len;
        Ok((self.k.narrow(2, 0, len)?, self.v.narrow(2, 0, len)?))
    }
}

/// A zeroed `[B, H, capacity, D]` buffer holding the first `len` positions of `buf`.
fn regrow(buf: &Tensor, len: usize, capacity: usize) -> anneal_engine::Result<Tensor> {
    let s = buf.shape();
    let out = Tensor::zeros_on(&[s[0], s[1], capacity, s[3]], buf.dtype(), buf.device())?;
    if len > 0 {
        out.narrow(2, 0, len)?.copy_from(&buf.narrow(2, 0, len)?)?;
    }
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

    #[test]
    fn bytes_held_counts_what_one_sequence_keeps_and_shapes_tell_rows_apart() {
        let t = |n: usize, s: &[usize]| Tensor::from_vec(vec![1f32; n], s).unwrap();
        let c = KvCache::new();
        // Two rows of 3 positions: keys and values of 2 heads × 4 dims (not the buffers'
        // capacity), a window state of 5 × 2 and a growing cache of 2 × 3 per row.
        c.append(0, &kv(2, 3, 1.0), &kv(2, 3, 1.0)).unwrap();
        c.set_state(1, "window", &t(20, &[2, 5, 2]));
        c.append_state(1, "blocks", &t(12, &[2, 2, 3]), 1).unwrap();
        assert_eq!(c.bytes_held(), 2 * (3 * 2 * 4) * 4 + 10 * 4 + 6 * 4);
        assert_eq!(
            c.state_shapes(),
            [
                (1, "blocks".to_string(), vec![2, 2, 3]),
                (1, "window".to_string(), vec![2, 5, 2])
            ]
        );
        let (a, b) = (Arc::new(KvCache::new()), Arc::new(KvCache::new()));
        a.set_state(0, "s", &t(2, &[1, 2]));
        b.set_state(0, "s", &t(3, &[1, 3]));
        assert_ne!(a.state_shapes(), b.state_shapes());
        assert!(KvCache::new().state_shapes().is_empty());
    }

    #[test]
    fn named_state_is_kept_per_layer_and_grows_along_its_dim() {
        let c = KvCache::new();
        assert!(c.state(0, "s").is_none());
        let t = |v: &[f32], s: &[usize]| Tensor::from_slice(v, s).unwrap();
        c.set_state(0, "s", &t(&[1.0, 2.0], &[1, 2]));
        c.set_state(1, "s", &t(&[3.0], &[1, 1]));
        assert_eq!(c.state(0, "s").unwrap().to_vec_f32(), [1.0, 2.0]);
        c.append_state(2, "latent", &t(&[1.0, 2.0], &[1, 1, 2]), 1)
            .unwrap();
        let all = c
            .append_state(2, "latent", &t(&[3.0, 4.0, 5.0, 6.0], &[1, 2, 2]), 1)
            .unwrap();
        assert_eq!(all.shape(), [1, 3, 2]);
        assert_eq!(all.to_vec_f32(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert!(c
            .append_state(2, "latent", &t(&[0.0; 3], &[1, 1, 3]), 1)
            .is_err());
    }
}
