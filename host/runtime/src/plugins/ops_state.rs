//! Per-layer inference state a plugin keeps in the host between the forward calls of one
//! sequence, the KV cache generalised: `cache_append` grows a cache of any shape along a dim
//! (MLA's latent cache), `state_get` / `state_set` hold a tensor of any shape that each call
//! replaces (a linear-attention recurrent state). They live in the forward's [`KvCache`],
//! addressed by layer and name. Without a cache (training, a plain forward) the forward covers
//! the whole sequence: `cache_append` returns its input, `state_get` nothing, `state_set` drops
//! it.
//!
//! In a per-row batch (continuous batching) each row keeps its own: `state_get` stacks the
//! rows' states along dim 0, `state_set` splits along dim 0, and `cache_append` appends row by
//! row and returns the rows stacked, which needs every row's cache to be as long.

use super::host::HostSession;
use super::kv_cache::KvCache;
use anneal_engine::Tensor;
use anneal_plugin_api::ops as o;

type R<T> = Result<T, String>;

fn e(err: anneal_engine::Error) -> String {
    err.to_string()
}

fn input<'a>(inputs: &'a [Tensor], op: &str) -> R<&'a Tensor> {
    inputs.first().ok_or_else(|| format!("{op} needs an input"))
}

/// A layer attribute as an index, refused when negative.
pub(super) fn layer_of(op: &str, layer: i64) -> R<usize> {
    usize::try_from(layer).map_err(|_| format!("{op}: layer {layer} must not be negative"))
}

/// Row `r` of `x` along dim 0, checked against the batch's `rows`.
fn row_of(op: &str, x: &Tensor, rows: usize, r: usize) -> R<Tensor> {
    if x.shape().first() != Some(&rows) {
        return Err(format!(
            "{op}: the batch has {rows} rows but the tensor has shape {:?}",
            x.shape()
        ));
    }
    x.narrow(0, r, 1).map_err(e)
}

/// `cache_append(x)`: everything cached for `(layer, name)` after appending `x` along `dim`.
pub fn cache_append(inputs: &[Tensor], a: o::CacheAppend, session: &HostSession) -> R<Tensor> {
    let op = o::CacheAppend::OP;
    let x = input(inputs, op)?;
    let layer = layer_of(op, a.layer)?;
    let dim = usize::try_from(a.dim)
        .ok()
        .filter(|&d| d < x.rank())
        .ok_or_else(|| format!("{op}: dim {} of a {}-d tensor", a.dim, x.rank()))?;
    let Some(cache) = session.cache() else {
        return Ok(x.clone());
    };
    let append = |c: &KvCache, x: &Tensor| {
        c.append_state(layer, &a.name, x, dim)
            .map_err(|err| format!("{op} '{}' of layer {layer}: {err}", a.name))
    };
    if !cache.is_per_row() {
        return append(cache, x);
    }
    // The rows' caches stack only if they are as long: checked before any row grows, so a
    // refused call leaves every row as it was.
    let rows = cache.rows();
    let lengths: Vec<usize> = rows
        .iter()
        .map(|c| c.state(layer, &a.name).map_or(0, |t| t.shape()[dim]))
        .collect();
    if lengths.windows(2).any(|w| w[0] != w[1]) {
        return Err(format!(
            "{op} '{}' of layer {layer}: the rows' caches differ in length ({lengths:?}); a \
             per-row batch needs an op that reads each row's cache on its own",
            a.name
        ));
    }
    let all = rows
        .iter()
        .enumerate()
        .map(|(r, c)| append(c, &row_of(op, x, rows.len(), r)?))
        .collect::<R<Vec<_>>>()?;
    anneal_engine::ops::cat(&all, 0).map_err(|err| format!("{op} '{}': {err}", a.name))
}

/// `state_get()`: the state of `(layer, name)`, when set.
pub fn state_get(a: o::StateGet, session: &HostSession) -> R<Vec<Tensor>> {
    let op = o::StateGet::OP;
    let layer = layer_of(op, a.layer)?;
    let Some(cache) = session.cache() else {
        return Ok(vec![]);
    };
    if !cache.is_per_row() {
        return Ok(cache.state(layer, &a.name).into_iter().collect());
    }
    let states: Vec<Option<Tensor>> = cache
        .rows()
        .iter()
        .map(|c| c.state(layer, &a.name))
        .collect();
    if states.iter().all(Option::is_none) {
        return Ok(vec![]);
    }
    let set: Vec<Tensor> = states.into_iter().flatten().collect();
    if set.len() != cache.rows().len() {
        return Err(format!(
            "{op} '{}' of layer {layer}: some rows of the batch have it and some do not",
            a.name
        ));
    }
    Ok(vec![anneal_engine::ops::cat(&set, 0).map_err(e)?])
}

/// `state_set(x)`: `x` becomes the state of `(layer, name)`.
pub fn state_set(inputs: &[Tensor], a: o::StateSet, session: &HostSession) -> R<Vec<Tensor>> {
    let op = o::StateSet::OP;
    let x = input(inputs, op)?;
    let layer = layer_of(op, a.layer)?;
    let Some(cache) = session.cache() else {
        return Ok(vec![]);
    };
    if !cache.is_per_row() {
        cache.set_state(layer, &a.name, x);
        return Ok(vec![]);
    }
    let rows = cache.rows();
    for (r, c) in rows.iter().enumerate() {
        c.set_state(layer, &a.name, &row_of(op, x, rows.len(), r)?);
    }
    Ok(vec![])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Arc;

    fn t(v: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(v, shape).unwrap()
    }

    fn session(cache: Option<Arc<KvCache>>) -> HostSession {
        HostSession::with_cache(Arc::new(HashMap::new()), cache)
    }

    fn append(s: &HostSession, x: &Tensor) -> R<Tensor> {
        let a = o::CacheAppend {
            layer: 1,
            name: "latent".into(),
            dim: 1,
        };
        cache_append(std::slice::from_ref(x), a, s)
    }

    fn get(s: &HostSession) -> Vec<Tensor> {
        let a = o::StateGet {
            layer: 0,
            name: "h".into(),
        };
        state_get(a, s).unwrap()
    }

    fn set(s: &HostSession, x: &Tensor) -> R<Vec<Tensor>> {
        let a = o::StateSet {
            layer: 0,
            name: "h".into(),
        };
        state_set(std::slice::from_ref(x), a, s)
    }

    #[test]
    fn a_sequence_keeps_its_caches_and_states_between_calls() {
        let s = session(Some(Arc::new(KvCache::new())));
        assert!(get(&s).is_empty());
        set(&s, &t(&[1.0, 2.0], &[1, 2])).unwrap();
        assert_eq!(get(&s)[0].to_vec_f32(), [1.0, 2.0]);
        append(&s, &t(&[1.0; 6], &[1, 3, 2])).unwrap();
        let all = append(&s, &t(&[2.0; 2], &[1, 1, 2])).unwrap();
        assert_eq!(all.shape(), [1, 4, 2]);
        assert_eq!(all.to_vec_f32()[6..], [2.0, 2.0]);
        let bad = o::CacheAppend {
            layer: 1,
            name: "latent".into(),
            dim: 3,
        };
        let err = cache_append(&[t(&[1.0], &[1, 1, 1])], bad, &s).unwrap_err();
        assert!(err.contains("dim 3 of a 3-d tensor"), "{err}");
    }

    #[test]
    fn without_a_cache_the_forward_covers_the_sequence() {
        let s = session(None);
        let x = t(&[1.0, 2.0, 3.0, 4.0], &[1, 2, 2]);
        assert_eq!(append(&s, &x).unwrap().to_vec_f32(), x.to_vec_f32());
        set(&s, &x).unwrap();
        assert!(get(&s).is_empty());
    }

    #[test]
    fn rows_of_a_per_row_batch_keep_their_own() {
        let (a, b) = (Arc::new(KvCache::new()), Arc::new(KvCache::new()));
        let s = session(Some(Arc::new(KvCache::per_row(vec![a.clone(), b.clone()]))));
        set(&s, &t(&[1.0, 2.0, 3.0, 4.0], &[2, 2])).unwrap();
        assert_eq!(b.state(0, "h").unwrap().to_vec_f32(), [3.0, 4.0]);
        assert_eq!(get(&s)[0].to_vec_f32(), [1.0, 2.0, 3.0, 4.0]);
        assert!(set(&s, &t(&[1.0; 6], &[3, 2])).is_err());
        // A row that joined later has no state yet: refused rather than stacked wrongly.
        let c = Arc::new(KvCache::new());
        let mixed = session(Some(Arc::new(KvCache::per_row(vec![a, c.clone()]))));
        let err = state_get(
            o::StateGet {
                layer: 0,
                name: "h".into(),
            },
            &mixed,
        )
        .unwrap_err();
        assert!(err.contains("some rows"), "{err}");
        // Caches of equal length stack; unequal ones are refused with the reason.
        append(&s, &t(&[1.0; 4], &[2, 1, 2])).unwrap();
        c.append_state(1, "latent", &t(&[1.0; 4], &[1, 2, 2]), 1)
            .unwrap();
        let err = append(&mixed, &t(&[1.0; 4], &[2, 1, 2])).unwrap_err();
        assert!(err.contains("differ in length"), "{err}");
        // Refused before any row grew.
        let row0_latent =
            |s: &HostSession| s.cache().unwrap().rows()[0].state(1, "latent").unwrap();
        assert_eq!(row0_latent(&mixed).shape(), [1, 1, 2]);
    }
}
