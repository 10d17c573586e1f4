//! Linear-attention host ops: the gated delta rule and the short causal convolution in front of
//! it (Gated DeltaNet, Kimi Delta Attention). Without a cache (training, a plain forward) each
//! covers the whole sequence; with one, the host keeps the layer's decode state between the
//! calls of a sequence, as it keeps a KV cache: the delta rule's recurrent state (see
//! `anneal_engine::ops::DeltaRuleCache`, which makes batch-invariant decode agree with the
//! training forward bit for bit) and the convolution's last `K - 1` inputs.
//!
//! The convolution is composed of engine ops (a join with the kept inputs, then `K` shifted
//! products summed in one fixed order), so a decode step computes each output with exactly the
//! arithmetic of the training forward, and the backward comes with them.

use super::host::HostSession;
use super::kv_cache::KvCache;
use super::ops_state::layer_of;
use anneal_engine::ops::DeltaRuleParams;
use anneal_engine::{DType, Tensor};
use anneal_plugin_api::ops as o;

type R<T> = Result<T, String>;

/// The name under which a layer's convolution tail is kept.
const CONV_TAIL: &str = "causal_conv1d.tail";

fn inputs_of<'a, const N: usize>(inputs: &'a [Tensor], op: &str) -> R<[&'a Tensor; N]> {
    if inputs.len() != N {
        return Err(format!("{op} takes {N} inputs, got {}", inputs.len()));
    }
    Ok(std::array::from_fn(|i| &inputs[i]))
}

/// Row `r` of each tensor along dim 0.
fn row<const N: usize>(ts: [&Tensor; N], r: usize) -> R<[Tensor; N]> {
    let rows: Vec<Tensor> = ts
        .iter()
        .map(|t| t.narrow(0, r, 1))
        .collect::<anneal_engine::Result<_>>()
        .map_err(|e| e.to_string())?;
    rows.try_into().map_err(|_| "row count".to_string())
}

/// `gated_delta_rule(q, k, v, g, beta)`: the outputs `[B, T, Hv, Dv]`.
pub fn gated_delta_rule(
    inputs: &[Tensor],
    a: o::GatedDeltaRule,
    session: &HostSession,
) -> R<Tensor> {
    let op = o::GatedDeltaRule::OP;
    let [q, k, v, g, beta] = inputs_of::<5>(inputs, op)?;
    let params = DeltaRuleParams {
        scale: a.scale.map(|s| s as f32),
        qk_l2norm: a.qk_l2norm,
    };
    let cached = match a.cache_layer {
        Some(layer) => session.cache().map(|c| (layer_of(op, layer), c)),
        None => None,
    };
    let Some((layer, cache)) = cached else {
        return anneal_engine::ops::gated_delta_rule(q, k, v, g, beta, None, &params)
            .map(|o| o.out)
            .map_err(|e| e.to_string());
    };
    let layer = layer?;
    let step = |c: &KvCache, [q, k, v, g, beta]: [&Tensor; 5]| {
        c.delta_rule_step(layer, q, k, v, g, beta, params)
            .map_err(|e| format!("{op} of layer {layer}: {e}"))
    };
    if !cache.is_per_row() {
        return step(cache, [q, k, v, g, beta]);
    }
    // Each row of a per-row batch has its own state (a row that joined later starts at zeros).
    let rows = cache.rows();
    if q.shape().first() != Some(&rows.len()) {
        return Err(format!(
            "{op}: the batch has {} rows but q has shape {:?}",
            rows.len(),
            q.shape()
        ));
    }
    let outs = rows
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let [q, k, v, g, beta] = row([q, k, v, g, beta], r)?;
            step(c, [&q, &k, &v, &g, &beta])
        })
        .collect::<R<Vec<_>>>()?;
    anneal_engine::ops::cat(&outs, 0).map_err(|e| format!("{op}: {e}"))
}

/// The inputs before this call's `[B, T, C]` that the convolution reads: the kept tail of each
/// row, or zeros where there is none (no cache, or the sequence's first call).
fn conv_history(
    x: &Tensor,
    taps: usize,
    layer: Option<usize>,
    cache: Option<&KvCache>,
) -> anneal_engine::Result<Tensor> {
    let (b, c) = (x.shape()[0], x.shape()[2]);
    let zeros = |rows: usize| Tensor::zeros_on(&[rows, taps - 1, c], x.dtype(), x.device());
    let (Some(layer), Some(cache)) = (layer, cache) else {
        return zeros(b);
    };
    if !cache.is_per_row() {
        return match cache.state(layer, CONV_TAIL) {
            Some(t) => Ok(t),
            None => zeros(b),
        };
    }
    let tails: Vec<Tensor> = cache
        .rows()
        .iter()
        .map(|r| match r.state(layer, CONV_TAIL) {
            Some(t) => Ok(t),
            None => zeros(1),
        })
        .collect::<anneal_engine::Result<_>>()?;
    anneal_engine::ops::cat(&tails, 0)
}

/// `causal_conv1d(x, w)`: `y[t, c] = Σ_j w[c, j] · x[t − K + 1 + j, c]`, then SiLU if asked.
pub fn causal_conv1d(inputs: &[Tensor], a: o::CausalConv1d, session: &HostSession) -> R<Tensor> {
    let op = o::CausalConv1d::OP;
    let [x, w] = inputs_of::<2>(inputs, op)?;
    let e = |err: anneal_engine::Error| format!("{op}: {err}");
    let (&[b, t, c], &[wc, taps]) = (x.shape(), w.shape()) else {
        return Err(format!(
            "{op}: x must be [B, T, C] and w [C, K], got {:?} and {:?}",
            x.shape(),
            w.shape()
        ));
    };
    if wc != c || taps == 0 {
        return Err(format!(
            "{op}: w {:?} must be [C, K] with C = {c} and K >= 1",
            w.shape()
        ));
    }
    if !matches!(x.dtype(), DType::F32 | DType::BF16) {
        return Err(format!("{op}: x must be f32 or bf16, got {:?}", x.dtype()));
    }
    let layer = a.cache_layer.map(|l| layer_of(op, l)).transpose()?;
    let cache = session.cache();
    let padded = if taps > 1 {
        let history = conv_history(x, taps, layer, cache).map_err(e)?;
        if history.shape() != [b, taps - 1, c] {
            return Err(format!(
                "{op} of layer {layer:?}: the kept inputs have shape {:?}, this call needs [{b}, {}, {c}]",
                history.shape(),
                taps - 1
            ));
        }
        anneal_engine::ops::cat(&[history, x.clone()], 1).map_err(e)?
    } else {
        x.clone()
    };
    if let (Some(layer), Some(cache)) = (layer, cache) {
        let tail = padded
            .narrow(1, t, taps - 1)
            .and_then(|t| t.contiguous())
            .map_err(e)?;
        if cache.is_per_row() {
            for (r, rc) in cache.rows().iter().enumerate() {
                rc.set_state(layer, CONV_TAIL, &tail.narrow(0, r, 1).map_err(e)?);
            }
        } else {
            cache.set_state(layer, CONV_TAIL, &tail);
        }
    }
    let tap = |j: usize| -> anneal_engine::Result<Tensor> {
        let wj = w.narrow(1, j, 1)?.reshape(&[c])?;
        padded.narrow(1, j, t)?.mul(&wj)
    };
    let mut y = tap(0).map_err(e)?;
    for j in 1..taps {
        y = y.add(&tap(j).map_err(e)?).map_err(e)?;
    }
    if a.silu {
        y = y.silu().map_err(e)?;
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_engine::invariant::set_batch_invariant;
    use std::collections::HashMap;
    use std::sync::Arc;

    /// Deterministic values in about [-1, 1].
    fn wave(shape: &[usize], seed: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.731 + seed) * 1.37).sin())
            .collect();
        Tensor::from_vec(v, shape).unwrap()
    }

    fn session(cache: Option<Arc<KvCache>>) -> HostSession {
        HostSession::with_cache(Arc::new(HashMap::new()), cache)
    }

    fn conv(s: &HostSession, x: &Tensor, w: &Tensor, layer: Option<i64>) -> Tensor {
        let a = o::CausalConv1d {
            silu: true,
            cache_layer: layer,
        };
        causal_conv1d(&[x.clone(), w.clone()], a, s).unwrap()
    }

    /// `q, k, v, g, beta` for `t` tokens of 2 key heads and 4 value heads of 8.
    fn delta_inputs(b: usize, t: usize, seed: f32) -> [Tensor; 5] {
        let g = wave(&[b, t, 4], seed + 3.0).affine(0.4, -0.6).unwrap();
        let beta = wave(&[b, t, 4], seed + 4.0).sigmoid().unwrap();
        [
            wave(&[b, t, 2, 8], seed),
            wave(&[b, t, 2, 8], seed + 1.0),
            wave(&[b, t, 4, 8], seed + 2.0),
            g,
            beta,
        ]
    }

    fn delta(s: &HostSession, x: &[Tensor; 5], layer: Option<i64>) -> Tensor {
        let a = o::GatedDeltaRule {
            scale: None,
            qk_l2norm: true,
            cache_layer: layer,
        };
        gated_delta_rule(x, a, s).unwrap()
    }

    fn pieces(x: &[Tensor; 5], at: usize, n: usize) -> [Tensor; 5] {
        std::array::from_fn(|i| x[i].narrow(1, at, n).unwrap().contiguous().unwrap())
    }

    #[test]
    fn the_convolution_is_causal_and_matches_its_definition() {
        let (x, w) = (wave(&[2, 7, 3], 0.0), wave(&[3, 4], 5.0));
        let y = conv(&session(None), &x, &w, None).to_vec_f32();
        let (xv, wv) = (x.to_vec_f32(), w.to_vec_f32());
        for b in 0..2 {
            for t in 0..7 {
                for c in 0..3 {
                    let mut acc = 0.0f32;
                    for j in 0..4usize {
                        if let Some(src) = (t + j).checked_sub(3) {
                            acc += wv[c * 4 + j] * xv[(b * 7 + src) * 3 + c];
                        }
                    }
                    let want = acc / (1.0 + (-acc).exp());
                    let got = y[(b * 7 + t) * 3 + c];
                    assert!((got - want).abs() < 1e-6, "{b} {t} {c}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn the_convolution_and_the_delta_rule_decode_step_by_step_as_the_whole_forward() {
        let _inv = set_batch_invariant(true);
        let (x, w) = (wave(&[2, 70, 6], 0.0), wave(&[6, 4], 5.0));
        let d = delta_inputs(2, 70, 0.5);
        let whole_conv = conv(&session(None), &x, &w, Some(0)).to_vec_f32();
        let whole_delta = delta(&session(None), &d, Some(1)).to_vec_f32();
        let cache = Arc::new(KvCache::new());
        let s = session(Some(cache.clone()));
        let (mut got_conv, mut got_delta) = (vec![], vec![]);
        // A prompt, single steps across the 64-token chunk boundary, then a few at once.
        let mut at = 0;
        for n in [5, 1, 1, 58, 1, 1, 3] {
            let xs = x.narrow(1, at, n).unwrap().contiguous().unwrap();
            got_conv.push(conv(&s, &xs, &w, Some(0)));
            got_delta.push(delta(&s, &pieces(&d, at, n), Some(1)));
            at += n;
        }
        assert_eq!(at, 70);
        let join = |parts: &[Tensor]| anneal_engine::ops::cat(parts, 1).unwrap().to_vec_f32();
        assert_eq!(join(&got_conv), whole_conv, "convolution");
        assert_eq!(join(&got_delta), whole_delta, "delta rule");
        // The conv tail (3 of 6 channels, f32) and the delta rule's state per sequence.
        let tail = 3 * 6 * 4;
        let state = 4 * 8 * 8 * 4;
        let held = cache.state_bytes_per_sequence();
        assert!(held >= tail + 2 * state, "{held}");
        assert_eq!(cache.bytes_per_token(), 0);
    }

    #[test]
    fn rows_of_a_per_row_batch_keep_their_own_linear_state() {
        let _inv = set_batch_invariant(true);
        let (x, w) = (wave(&[2, 9, 6], 0.0), wave(&[6, 4], 5.0));
        let d = delta_inputs(2, 9, 0.5);
        // Each row alone, in two calls.
        let alone: Vec<(Vec<f32>, Vec<f32>)> = (0..2)
            .map(|r| {
                let s = session(Some(Arc::new(KvCache::new())));
                let xr = x.narrow(0, r, 1).unwrap();
                let dr: [Tensor; 5] = std::array::from_fn(|i| d[i].narrow(0, r, 1).unwrap());
                conv(&s, &xr.narrow(1, 0, 8).unwrap(), &w, Some(0));
                delta(&s, &pieces(&dr, 0, 8), Some(0));
                (
                    conv(&s, &xr.narrow(1, 8, 1).unwrap(), &w, Some(0)).to_vec_f32(),
                    delta(&s, &pieces(&dr, 8, 1), Some(0)).to_vec_f32(),
                )
            })
            .collect();
        // Row 0 ran its prompt alone; row 1 joins the batch for its first call.
        let (r0, r1) = (Arc::new(KvCache::new()), Arc::new(KvCache::new()));
        let s0 = session(Some(Arc::new(KvCache::per_row(vec![r0.clone()]))));
        let x0 = x.narrow(0, 0, 1).unwrap();
        let d0: [Tensor; 5] = std::array::from_fn(|i| d[i].narrow(0, 0, 1).unwrap());
        conv(&s0, &x0.narrow(1, 0, 8).unwrap(), &w, Some(0));
        delta(&s0, &pieces(&d0, 0, 8), Some(0));
        let s1 = session(Some(Arc::new(KvCache::per_row(vec![r1.clone()]))));
        let x1 = x.narrow(0, 1, 1).unwrap();
        let d1: [Tensor; 5] = std::array::from_fn(|i| d[i].narrow(0, 1, 1).unwrap());
        conv(&s1, &x1.narrow(1, 0, 8).unwrap(), &w, Some(0));
        delta(&s1, &pieces(&d1, 0, 8), Some(0));
        let both = session(Some(Arc::new(KvCache::per_row(vec![r0, r1]))));
        let c = conv(&both, &x.narrow(1, 8, 1).unwrap(), &w, Some(0));
        let o = delta(&both, &pieces(&d, 8, 1), Some(0));
        for (r, (want_c, want_d)) in alone.iter().enumerate() {
            assert_eq!(&c.narrow(0, r, 1).unwrap().to_vec_f32(), want_c, "row {r}");
            assert_eq!(&o.narrow(0, r, 1).unwrap().to_vec_f32(), want_d, "row {r}");
        }
    }

    #[test]
    fn the_convolution_has_gradients_for_input_and_kernel() {
        let (x, w) = (wave(&[1, 5, 2], 0.0), wave(&[2, 3], 5.0));
        let (x, w) = (x.requires_grad_(), w.requires_grad_());
        let r = wave(&[1, 5, 2], 9.0);
        let loss = |x: &Tensor, w: &Tensor| -> Tensor {
            conv(&session(None), x, w, None)
                .mul(&r)
                .unwrap()
                .sum_all()
                .unwrap()
        };
        loss(&x, &w).backward().unwrap();
        for (t, name) in [(&x, "x"), (&w, "w")] {
            let g = t.grad().unwrap().to_vec_f32();
            let base = t.detach().to_vec_f32();
            for i in 0..base.len() {
                let at = |d: f32| {
                    let mut v = base.clone();
                    v[i] += d;
                    let moved = Tensor::from_vec(v, t.shape()).unwrap();
                    let l = if name == "x" {
                        loss(&moved, &w.detach())
                    } else {
                        loss(&x.detach(), &moved)
                    };
                    l.to_vec_f32()[0] as f64
                };
                let fd = (at(1e-2) - at(-1e-2)) / 2e-2;
                assert!(
                    (g[i] as f64 - fd).abs() < 2e-3,
                    "{name}[{i}]: {} vs {fd}",
                    g[i]
                );
            }
        }
    }

    #[test]
    fn bad_shapes_are_named() {
        let s = session(None);
        let a = o::CausalConv1d {
            silu: false,
            cache_layer: None,
        };
        let err =
            causal_conv1d(&[wave(&[1, 4, 3], 0.0), wave(&[2, 4], 0.0)], a.clone(), &s).unwrap_err();
        assert!(err.contains("must be [C, K] with C = 3"), "{err}");
        let err = causal_conv1d(&[wave(&[4, 3], 0.0), wave(&[3, 4], 0.0)], a, &s).unwrap_err();
        assert!(err.contains("x must be [B, T, C]"), "{err}");
        let a = o::GatedDeltaRule {
            scale: None,
            qk_l2norm: false,
            cache_layer: None,
        };
        let err = gated_delta_rule(&[wave(&[1, 2, 1, 4], 0.0)], a, &s).unwrap_err();
        assert!(err.contains("takes 5 inputs"), "{err}");
    }
}
