//! The host-op registry: op names and attributes, as plugins call them, mapped onto engine ops.
//! Adding an op here changes no layout: plugins built earlier keep working.

use super::host::HostSession;
use super::kv_cache::KvCache;
use anneal_engine::{DType, Tensor};
use anneal_plugin_api::abi::Attr;

type R<T> = Result<T, String>;

fn arg<'a>(inputs: &'a [Tensor], i: usize, op: &str) -> R<&'a Tensor> {
    inputs.get(i).ok_or_else(|| format!("{op} needs input {i}"))
}

fn int(attrs: &[Attr], i: usize, op: &str) -> R<i64> {
    match attrs.get(i) {
        Some(Attr::Int(v)) => Ok(*v),
        other => Err(format!(
            "{op}: attribute {i} must be an integer, got {other:?}"
        )),
    }
}

fn float(attrs: &[Attr], i: usize, op: &str) -> R<f64> {
    match attrs.get(i) {
        Some(Attr::Float(v)) => Ok(*v),
        Some(Attr::Int(v)) => Ok(*v as f64),
        other => Err(format!(
            "{op}: attribute {i} must be a number, got {other:?}"
        )),
    }
}

fn ints(attrs: &[Attr], i: usize, op: &str) -> R<Vec<i64>> {
    match attrs.get(i) {
        Some(Attr::Ints(v)) => Ok(v.to_vec()),
        other => Err(format!(
            "{op}: attribute {i} must be a list of integers, got {other:?}"
        )),
    }
}

fn boolean(attrs: &[Attr], i: usize, op: &str) -> R<bool> {
    match attrs.get(i) {
        Some(Attr::Bool(v)) => Ok(*v),
        other => Err(format!("{op}: attribute {i} must be a bool, got {other:?}")),
    }
}

/// Resolves one `-1` in a requested shape against the element count.
fn infer_shape(shape: &[i64], numel: usize) -> R<Vec<usize>> {
    let known: i64 = shape.iter().filter(|&&d| d != -1).product();
    let holes = shape.iter().filter(|&&d| d == -1).count();
    if holes > 1 || shape.iter().any(|&d| d < -1) {
        return Err(format!("bad shape {shape:?}"));
    }
    Ok(shape
        .iter()
        .map(|&d| {
            if d == -1 {
                numel / known.max(1) as usize
            } else {
                d as usize
            }
        })
        .collect())
}

fn e(err: anneal_engine::Error) -> String {
    err.to_string()
}

/// Runs host op `op`.
pub(crate) fn run(
    op: &str,
    inputs: &[Tensor],
    attrs: &[Attr],
    session: &HostSession,
) -> R<Vec<Tensor>> {
    let _ = session;
    let x = || arg(inputs, 0, op);
    let y = || arg(inputs, 1, op);
    let one = |t: anneal_engine::Result<Tensor>| t.map(|t| vec![t]).map_err(e);
    match op {
        "add" => one(x()?.add(y()?)),
        "sub" => one(x()?.sub(y()?)),
        "mul" => one(x()?.mul(y()?)),
        "div" => one(x()?.div(y()?)),
        "maximum" => one(x()?.maximum(y()?)),
        "minimum" => one(x()?.minimum(y()?)),
        "affine" => one(x()?.affine(float(attrs, 0, op)? as f32, float(attrs, 1, op)? as f32)),
        "pow" => one(x()?.powf(float(attrs, 0, op)? as f32)),
        "clamp" => one(x()?.clamp(float(attrs, 0, op)? as f32, float(attrs, 1, op)? as f32)),
        "neg" => one(x()?.neg()),
        "exp" => one(x()?.exp()),
        "log" => one(x()?.log()),
        "sqrt" => one(x()?.sqrt()),
        "rsqrt" => one(x()?.rsqrt()),
        "tanh" => one(x()?.tanh()),
        "sigmoid" => one(x()?.sigmoid()),
        "silu" => one(x()?.silu()),
        "gelu" => one(x()?.gelu()),
        "gelu_erf" => one(x()?.gelu_erf()),
        "relu" => one(x()?.relu()),
        "softplus" => one(x()?.softplus()),
        "abs" => one(x()?.abs()),
        "matmul" => one(x()?.matmul(y()?)),
        "swiglu" => one(x()?.swiglu(y()?)),
        "linear" => {
            let (x, w) = (x()?, y()?);
            one(w.transpose(0, 1).and_then(|wt| x.matmul(&wt)))
        }
        "reshape" => {
            let t = x()?;
            let shape = infer_shape(&ints(attrs, 0, op)?, t.numel())?;
            one(t.reshape(&shape))
        }
        "transpose" => {
            one(x()?.transpose(int(attrs, 0, op)? as isize, int(attrs, 1, op)? as isize))
        }
        "permute" => {
            let p: Vec<usize> = ints(attrs, 0, op)?
                .into_iter()
                .map(|d| d as usize)
                .collect();
            one(x()?.permute(&p))
        }
        "sum" | "mean" => {
            let dims: Vec<isize> = ints(attrs, 0, op)?
                .into_iter()
                .map(|d| d as isize)
                .collect();
            let keep = boolean(attrs, 1, op)?;
            one(if op == "sum" {
                x()?.sum_dims(&dims, keep)
            } else {
                x()?.mean_dims(&dims, keep)
            })
        }
        "to_dtype" => {
            let name = match attrs.first() {
                Some(Attr::Str(s)) => s.to_string(),
                other => {
                    return Err(format!(
                        "{op}: attribute 0 must be a dtype name, got {other:?}"
                    ))
                }
            };
            let dt = DType::parse(&name).ok_or_else(|| format!("{op}: unknown dtype '{name}'"))?;
            one(x()?.to_dtype(dt))
        }
        "adamw" => adamw(inputs, attrs).map(|()| vec![]),
        "assign" => {
            x()?.copy_from(y()?).map_err(e)?;
            Ok(vec![])
        }
        "softmax" => one(x()?.softmax(int(attrs, 0, op)? as isize)),
        "log_softmax" => one(x()?.log_softmax(int(attrs, 0, op)? as isize)),
        "embedding" => one(x()?.embedding(y()?)),
        "rms_norm" => one(x()?.rms_norm(Some(y()?), float(attrs, 0, op)? as f32)),
        "rope" => rope(x()?, y()?, attrs).map(|t| vec![t]),
        "attention" => attention(inputs, attrs, session).map(|t| vec![t]),
        "layer_norm" => {
            let b = match attrs.get(1) {
                Some(Attr::Tensor(h)) => Some(session.get(*h)?),
                _ => None,
            };
            one(x()?.layer_norm(Some(y()?), b.as_ref(), float(attrs, 0, op)? as f32))
        }
        "narrow" => one(x()?.narrow(
            int(attrs, 0, op)? as isize,
            int(attrs, 1, op)? as usize,
            int(attrs, 2, op)? as usize,
        )),
        "cat" => one(anneal_engine::ops::cat(inputs, int(attrs, 0, op)? as isize)),
        "where" => one(anneal_engine::ops::where_(x()?, y()?, arg(inputs, 2, op)?)),
        "index_select" => one(x()?.index_select(int(attrs, 0, op)? as isize, y()?)),
        "gather" => one(x()?.gather(int(attrs, 0, op)? as isize, y()?)),
        "scatter_add" => {
            one(x()?.scatter_add(int(attrs, 0, op)? as isize, y()?, arg(inputs, 2, op)?))
        }
        "topk" => {
            let (v, i) = x()?
                .topk(
                    int(attrs, 0, op)? as usize,
                    int(attrs, 1, op)? as isize,
                    boolean(attrs, 2, op)?,
                    true,
                )
                .map_err(e)?;
            Ok(vec![v, i])
        }
        "sort_by_expert" => {
            let r =
                anneal_engine::ops::sort_by_expert(x()?, int(attrs, 0, op)? as usize).map_err(e)?;
            let counts: Vec<i64> = r.counts.iter().map(|&c| c as i64).collect();
            let n = counts.len();
            Ok(vec![
                r.order,
                r.token,
                r.inverse,
                Tensor::from_vec(counts, &[n]).map_err(e)?,
            ])
        }
        "grouped_matmul" => one(x()?.grouped_matmul(y()?, arg(inputs, 2, op)?)),
        "cross_entropy" => {
            let opts = anneal_engine::ops::CrossEntropy {
                ignore_index: opt_int(attrs, 0),
                ..Default::default()
            };
            one(anneal_engine::ops::cross_entropy(x()?, y()?, &opts))
        }
        "max" => one(x()?.max_dim(int(attrs, 0, op)? as isize, boolean(attrs, 1, op)?)),
        "min" => one(x()?.min_dim(int(attrs, 0, op)? as isize, boolean(attrs, 1, op)?)),
        "argmax" => one(x()?.argmax(int(attrs, 0, op)? as isize, boolean(attrs, 1, op)?)),
        "var" => {
            let dims: Vec<isize> = ints(attrs, 0, op)?
                .into_iter()
                .map(|d| d as isize)
                .collect();
            one(x()?.var_dims(&dims, int(attrs, 1, op)? as usize, boolean(attrs, 2, op)?))
        }
        "masked_fill" => one(x()?.masked_fill(y()?, float(attrs, 0, op)? as f32)),
        "stack" => one(anneal_engine::ops::stack(
            inputs,
            int(attrs, 0, op)? as isize,
        )),
        "dropout" => {
            // The key is derived by the host from (seed, stream name) attrs, so recomputation
            // and resharding draw the same mask.
            let seed = int(attrs, 1, op)? as u64;
            let stream = match attrs.get(2) {
                Some(Attr::Str(s)) => s.to_string(),
                other => {
                    return Err(format!(
                        "{op}: attribute 2 must be a stream name, got {other:?}"
                    ))
                }
            };
            let key = anneal_engine::rng::RngKey::new(seed, &stream);
            one(x()?.dropout(float(attrs, 0, op)? as f32, &key, int(attrs, 3, op)? as u64))
        }
        _ => Err(format!("this host has no op named '{op}'")),
    }
}

fn opt_float(attrs: &[Attr], i: usize) -> Option<f64> {
    match attrs.get(i) {
        Some(Attr::Float(v)) => Some(*v),
        Some(Attr::Int(v)) => Some(*v as f64),
        _ => None,
    }
}

fn opt_int(attrs: &[Attr], i: usize) -> Option<i64> {
    match attrs.get(i) {
        Some(Attr::Int(v)) => Some(*v),
        _ => None,
    }
}

/// `adamw([param, grad, exp_avg, exp_avg_sq] per parameter)`, attrs: lr, beta1, beta2, eps,
/// weight decay, step. Updates in place, one fused pass over every parameter.
fn adamw(inputs: &[Tensor], attrs: &[Attr]) -> R<()> {
    let op = "adamw";
    if inputs.is_empty() || !inputs.len().is_multiple_of(4) {
        return Err(format!(
            "{op}: needs [param, grad, exp_avg, exp_avg_sq] per parameter, got {} tensors",
            inputs.len()
        ));
    }
    let hp = anneal_engine::ops::AdamW {
        lr: float(attrs, 0, op)?,
        beta1: float(attrs, 1, op)?,
        beta2: float(attrs, 2, op)?,
        eps: float(attrs, 3, op)?,
        weight_decay: float(attrs, 4, op)?,
        step: u64::try_from(int(attrs, 5, op)?).map_err(|_| format!("{op}: negative step"))?,
    };
    let groups: Vec<_> = inputs
        .chunks_exact(4)
        .map(|c| anneal_engine::ops::AdamWTensors {
            param: &c[0],
            grad: &c[1],
            exp_avg: &c[2],
            exp_avg_sq: &c[3],
        })
        .collect();
    anneal_engine::ops::adamw_step(&groups, &hp).map_err(e)
}

/// `rope(x [B, H, T, D], positions [T])`, attrs: theta, rot_dim, interleaved, then the four
/// Llama-3 scaling values (or None).
fn rope(x: &Tensor, positions: &Tensor, attrs: &[Attr]) -> R<Tensor> {
    use anneal_engine::ops::{rope_tables, Llama3Scaling, RopeLayout, RopeSpec, RopeStyle};
    let op = "rope";
    let theta = float(attrs, 0, op)?;
    let rot_dim = int(attrs, 1, op)? as usize;
    let interleaved = boolean(attrs, 2, op)?;
    let scaling = match (
        opt_float(attrs, 3),
        opt_float(attrs, 4),
        opt_float(attrs, 5),
        opt_int(attrs, 6),
    ) {
        (Some(factor), Some(low), Some(high), Some(orig)) => Some(Llama3Scaling {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: orig as usize,
        }),
        (None, None, None, None) => None,
        _ => return Err("rope: llama3 scaling needs all four values".into()),
    };
    let (cos, sin) = rope_tables(positions, rot_dim, theta, scaling).map_err(e)?;
    let style = if interleaved {
        RopeStyle::Interleaved
    } else {
        RopeStyle::HalfSplit
    };
    x.rope(
        &cos,
        &sin,
        RopeSpec {
            style,
            layout: RopeLayout::Bhtd,
        },
    )
    .map_err(e)
}

/// `attention(q, k, v, positions)`, attrs: causal, window, scale, softcap, cache layer. With a
/// cache layer, `k`/`v` are appended to the session's KV cache and the queries attend over all
/// cached positions. Positions are `[T]` (every row at the same place) or `[B, T]` (each row at
/// its own, as in continuous batching; see [`attention_rows`]).
fn attention(inputs: &[Tensor], attrs: &[Attr], session: &HostSession) -> R<Tensor> {
    use anneal_engine::ops::AttentionParams;
    let op = "attention";
    let (q, k, v, positions) = (
        arg(inputs, 0, op)?,
        arg(inputs, 1, op)?,
        arg(inputs, 2, op)?,
        arg(inputs, 3, op)?,
    );
    let causal = boolean(attrs, 0, op)?;
    let window = opt_int(attrs, 1).map(|w| w as usize);
    let scale = opt_float(attrs, 2).map(|s| s as f32);
    let softcap = opt_float(attrs, 3).map(|s| s as f32);
    let cache = match (opt_int(attrs, 4), session.cache()) {
        (Some(layer), Some(cache)) => Some((layer as usize, cache)),
        (Some(_), None) => {
            return Err(
                "attention: a cache layer was given but this forward has no KV cache".into(),
            )
        }
        (None, _) => None,
    };
    let params = |q_pos: Tensor, k_pos: Tensor| AttentionParams {
        scale,
        causal,
        sliding_window: window,
        softcap,
        sinks: None,
        q_pos: Some(q_pos),
        k_pos: Some(k_pos),
    };
    if positions.rank() == 2 || cache.is_some_and(|(_, c)| c.is_per_row()) {
        return attention_rows(q, k, v, positions, cache, params);
    }
    let (k, v, k_pos) = match cache {
        Some((layer, cache)) => {
            let (k, v) = cache.append(layer, k, v).map_err(e)?;
            let s = k.shape()[2];
            (k, v, arange(s)?)
        }
        None => (k.clone(), v.clone(), positions.clone()),
    };
    q.attention(&k, &v, &params(positions.clone(), k_pos))
        .map_err(e)
}

/// Attention for a batch whose rows are separate sequences: row `r` sits at `positions[r]` and
/// extends its own cache (`KvCache::per_row`), of its own length. Each row runs as its own
/// attention call over its own keys, with exactly the shapes it would have alone, so (with the
/// batch-invariant matrix products around it) a row's results do not depend on its neighbours.
fn attention_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &Tensor,
    cache: Option<(usize, &KvCache)>,
    params: impl Fn(Tensor, Tensor) -> anneal_engine::ops::AttentionParams,
) -> R<Tensor> {
    let b = q.shape().first().copied().unwrap_or(0);
    let t = positions.shape().last().copied().unwrap_or(0);
    if positions.rank() == 2 && positions.shape()[0] != b {
        return Err(format!(
            "attention: positions {:?} do not match a batch of {b} rows",
            positions.shape()
        ));
    }
    if let Some((_, c)) = cache {
        if !c.is_per_row() {
            return Err("attention: per-row positions [B, T] need a per-row KV cache".into());
        }
        if c.rows().len() != b {
            return Err(format!(
                "attention: the batch has {b} rows but the per-row KV cache {}",
                c.rows().len()
            ));
        }
    }
    let outs = (0..b)
        .map(|r| {
            let row = |x: &Tensor| x.narrow(0, r, 1).map_err(e);
            let q_pos = if positions.rank() == 2 {
                row(positions)?.reshape(&[t]).map_err(e)?
            } else {
                positions.clone()
            };
            let (k, v, k_pos) = match cache {
                Some((layer, c)) => {
                    let (k, v) = c.rows()[r].append(layer, &row(k)?, &row(v)?).map_err(e)?;
                    let s = k.shape()[2];
                    (k, v, arange(s)?)
                }
                None => (row(k)?, row(v)?, q_pos.clone()),
            };
            row(q)?.attention(&k, &v, &params(q_pos, k_pos)).map_err(e)
        })
        .collect::<R<Vec<_>>>()?;
    anneal_engine::ops::cat(&outs, 0).map_err(e)
}

/// Positions `0..n` (i64 `[n]`).
fn arange(n: usize) -> R<Tensor> {
    Tensor::from_vec((0..n as i64).collect::<Vec<_>>(), &[n]).map_err(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn t(v: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(v, shape).unwrap()
    }

    #[test]
    fn ops_by_name_match_the_engine() {
        let s = HostSession::new(HashMap::new());
        let x = t(&[1.0, 5.0, 3.0, 2.0, 0.5, 4.0], &[2, 3]);
        let out = run(
            "topk",
            &[x.clone()],
            &[Attr::Int(2), Attr::Int(1), Attr::Bool(true)],
            &s,
        )
        .unwrap();
        assert_eq!(out[0].to_vec_f32(), vec![5.0, 3.0, 4.0, 2.0]);
        assert_eq!(out[1].to_vec::<i64>(), vec![1, 2, 2, 0]);
        // MoE: route each token to its top expert, run the expert products, compare with per-row matmuls.
        let ids = Tensor::from_slice(&[1i64, 0], &[2, 1]).unwrap();
        let r = run("sort_by_expert", &[ids], &[Attr::Int(2)], &s).unwrap();
        assert_eq!(r[3].to_vec::<i64>(), vec![1, 1]);
        let w = t(&(0..12).map(|i| i as f32).collect::<Vec<_>>(), &[2, 3, 2]);
        let xs = run(
            "index_select",
            &[x.clone(), r[1].clone()],
            &[Attr::Int(0)],
            &s,
        )
        .unwrap();
        let y = run(
            "grouped_matmul",
            &[xs[0].clone(), w.clone(), r[3].clone()],
            &[],
            &s,
        )
        .unwrap();
        let want0 = x
            .narrow(0, 1, 1)
            .unwrap()
            .matmul(&w.narrow(0, 0, 1).unwrap().reshape(&[3, 2]).unwrap())
            .unwrap();
        assert_eq!(
            y[0].narrow(0, 0, 1).unwrap().to_vec_f32(),
            want0.to_vec_f32()
        );
        let cat = run("cat", &[x.clone(), x.clone()], &[Attr::Int(0)], &s).unwrap();
        assert_eq!(cat[0].shape(), &[4, 3]);
        let ce = run(
            "cross_entropy",
            &[x.clone(), Tensor::from_slice(&[1i64, 2], &[2]).unwrap()],
            &[Attr::None],
            &s,
        )
        .unwrap();
        assert!(ce[0].item().unwrap() > 0.0);
        let ln = run(
            "layer_norm",
            &[x.clone(), t(&[1.0, 1.0, 1.0], &[3])],
            &[Attr::Float(1e-5), Attr::None],
            &s,
        )
        .unwrap();
        assert!(ln[0].sum_all().unwrap().item().unwrap().abs() < 1e-4);
    }

    #[test]
    fn unknown_ops_and_bad_attributes_are_named() {
        let s = HostSession::new(HashMap::new());
        let x = t(&[1.0, 2.0], &[2]);
        let err = run("frobnicate", &[x.clone()], &[], &s).unwrap_err();
        assert!(err.contains("no op named 'frobnicate'"), "{err}");
        let err = run("narrow", &[x.clone()], &[Attr::Str("0".into())], &s).unwrap_err();
        assert!(err.contains("narrow") && err.contains("integer"), "{err}");
        let err = run("add", &[x], &[], &s).unwrap_err();
        assert!(err.contains("add needs input 1"), "{err}");
    }
}
