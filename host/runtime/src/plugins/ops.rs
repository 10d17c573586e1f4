//! The host-op registry: the ops declared in `anneal_plugin_api::ops` (name and typed
//! attributes, shared with the SDK), each mapped onto engine ops by one arm of [`run`]. Adding an
//! op changes no layout: plugins built earlier keep working.

use super::host::HostSession;
use super::kv_cache::KvCache;
use anneal_engine::{DType, Tensor};
use anneal_plugin_api::abi::Attr;
use anneal_plugin_api::ops::{self as o, OpAttrs};

type R<T> = Result<T, String>;

fn arg<'a>(inputs: &'a [Tensor], i: usize, op: &str) -> R<&'a Tensor> {
    inputs.get(i).ok_or_else(|| format!("{op} needs input {i}"))
}

/// The typed attributes of op `A` (the struct both sides share, see
/// [`anneal_plugin_api::ops`]); a mismatch names the op, the attribute and the type.
fn parse<A: OpAttrs>(attrs: &[Attr]) -> R<A> {
    A::from_attrs(attrs)
}

fn dims(v: &[i64]) -> Vec<isize> {
    v.iter().map(|&d| d as isize).collect()
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

/// Runs host op `op`: one arm per op, its attributes read as the struct the SDK sent.
pub(crate) fn run(
    op: &str,
    inputs: &[Tensor],
    attrs: &[Attr],
    session: &HostSession,
) -> R<Vec<Tensor>> {
    let x = || arg(inputs, 0, op);
    let y = || arg(inputs, 1, op);
    let one = |t: anneal_engine::Result<Tensor>| t.map(|t| vec![t]).map_err(e);
    super::ops_context::check(op, session)?;
    match op {
        o::Add::OP => one(x()?.add(y()?)),
        o::Sub::OP => one(x()?.sub(y()?)),
        o::Mul::OP => one(x()?.mul(y()?)),
        o::Div::OP => one(x()?.div(y()?)),
        o::Maximum::OP => one(x()?.maximum(y()?)),
        o::Minimum::OP => one(x()?.minimum(y()?)),
        o::Affine::OP => {
            let a: o::Affine = parse(attrs)?;
            one(x()?.affine(a.mul as f32, a.add as f32))
        }
        o::Pow::OP => one(x()?.powf(parse::<o::Pow>(attrs)?.exponent as f32)),
        o::Clamp::OP => {
            let a: o::Clamp = parse(attrs)?;
            one(x()?.clamp(a.min as f32, a.max as f32))
        }
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
        o::Matmul::OP => one(x()?.matmul(y()?)),
        o::Swiglu::OP => one(x()?.swiglu(y()?)),
        o::Linear::OP => {
            let (x, w) = (x()?, y()?);
            if let Some(out) = session
                .tp()
                .map(|tp| tp.linear(x, w))
                .transpose()?
                .flatten()
            {
                return Ok(vec![out]);
            }
            one(w.transpose(0, 1).and_then(|wt| x.matmul(&wt)))
        }
        o::Reshape::OP => {
            let t = x()?;
            let shape = infer_shape(&parse::<o::Reshape>(attrs)?.shape, t.numel())?;
            one(t.reshape(&shape))
        }
        o::Transpose::OP => {
            let a: o::Transpose = parse(attrs)?;
            one(x()?.transpose(a.a as isize, a.b as isize))
        }
        o::Permute::OP => {
            let p: Vec<usize> = parse::<o::Permute>(attrs)?
                .perm
                .into_iter()
                .map(|d| d as usize)
                .collect();
            one(x()?.permute(&p))
        }
        o::Sum::OP => {
            let a: o::Sum = parse(attrs)?;
            one(x()?.sum_dims(&dims(&a.dims), a.keepdim))
        }
        o::Mean::OP => {
            let a: o::Mean = parse(attrs)?;
            one(x()?.mean_dims(&dims(&a.dims), a.keepdim))
        }
        o::ToDtype::OP => {
            let name = parse::<o::ToDtype>(attrs)?.dtype;
            let dt = DType::parse(&name).ok_or_else(|| format!("{op}: unknown dtype '{name}'"))?;
            one(x()?.to_dtype(dt))
        }
        o::AdamW::OP => adamw(inputs, parse(attrs)?).map(|()| vec![]),
        o::Assign::OP => {
            x()?.copy_from(y()?).map_err(e)?;
            Ok(vec![])
        }
        o::Softmax::OP => one(x()?.softmax(parse::<o::Softmax>(attrs)?.dim as isize)),
        o::LogSoftmax::OP => one(x()?.log_softmax(parse::<o::LogSoftmax>(attrs)?.dim as isize)),
        o::Embedding::OP => {
            let (w, ids) = (x()?, y()?);
            if let Some(out) = session
                .tp()
                .map(|tp| tp.embedding(w, ids))
                .transpose()?
                .flatten()
            {
                return Ok(vec![out]);
            }
            one(w.embedding(ids))
        }
        o::RmsNorm::OP => one(x()?.rms_norm(Some(y()?), parse::<o::RmsNorm>(attrs)?.eps as f32)),
        o::Rope::OP => rope(x()?, y()?, parse(attrs)?).map(|t| vec![t]),
        o::Attention::OP => attention(inputs, parse(attrs)?, session).map(|t| vec![t]),
        o::LayerNorm::OP => {
            let a: o::LayerNorm = parse(attrs)?;
            let b = a.bias.map(|h| session.get(h)).transpose()?;
            one(x()?.layer_norm(Some(y()?), b.as_ref(), a.eps as f32))
        }
        o::Narrow::OP => {
            let a: o::Narrow = parse(attrs)?;
            one(x()?.narrow(a.dim as isize, a.start as usize, a.len as usize))
        }
        o::Cat::OP => one(anneal_engine::ops::cat(
            inputs,
            parse::<o::Cat>(attrs)?.dim as isize,
        )),
        o::Where::OP => one(anneal_engine::ops::where_(x()?, y()?, arg(inputs, 2, op)?)),
        o::IndexSelect::OP => {
            one(x()?.index_select(parse::<o::IndexSelect>(attrs)?.dim as isize, y()?))
        }
        o::Gather::OP => one(x()?.gather(parse::<o::Gather>(attrs)?.dim as isize, y()?)),
        o::ScatterAdd::OP => {
            let dim = parse::<o::ScatterAdd>(attrs)?.dim as isize;
            one(x()?.scatter_add(dim, y()?, arg(inputs, 2, op)?))
        }
        o::TopK::OP => {
            let a: o::TopK = parse(attrs)?;
            let (v, i) = x()?
                .topk(a.k as usize, a.dim as isize, a.largest, true)
                .map_err(e)?;
            Ok(vec![v, i])
        }
        o::SortByExpert::OP => {
            let n = parse::<o::SortByExpert>(attrs)?.num_experts as usize;
            let r = anneal_engine::ops::sort_by_expert(x()?, n).map_err(e)?;
            Ok(vec![r.order, r.token, r.inverse, r.counts])
        }
        o::GroupedMatmul::OP => one(x()?.grouped_matmul(y()?, arg(inputs, 2, op)?)),
        o::GroupedMatmulNt::OP => super::ops_moe::grouped_matmul_nt(inputs),
        o::MoeRoute::OP => super::ops_moe::route(inputs, parse(attrs)?),
        o::MoeDispatch::OP => super::ops_moe::dispatch(inputs, parse(attrs)?),
        o::MoeCombine::OP => super::ops_moe::combine(inputs, parse(attrs)?),
        o::MoeFfn::OP => super::ops_moe::ffn(inputs, parse(attrs)?, session),
        o::CompressedMask::OP => {
            session.refuse_packed("compressed attention")?;
            super::ops_compressed::compressed_mask(inputs, parse(attrs)?)
        }
        o::GatheredAttention::OP => {
            session.refuse_packed("compressed attention")?;
            super::ops_compressed::gathered_attention(inputs, parse(attrs)?)
        }
        o::CacheAppend::OP => {
            super::ops_state::cache_append(inputs, parse(attrs)?, session).map(|t| vec![t])
        }
        o::StateGet::OP => super::ops_state::state_get(parse(attrs)?, session),
        o::GatedDeltaRule::OP => {
            session.refuse_packed("linear attention")?;
            super::ops_linear::gated_delta_rule(inputs, parse(attrs)?, session).map(|t| vec![t])
        }
        o::CausalConv1d::OP => {
            session.refuse_packed("short convolution")?;
            super::ops_linear::causal_conv1d(inputs, parse(attrs)?, session).map(|t| vec![t])
        }
        o::StateSet::OP => super::ops_state::state_set(inputs, parse(attrs)?, session),
        o::CrossEntropy::OP => {
            let opts = anneal_engine::ops::CrossEntropy {
                ignore_index: parse::<o::CrossEntropy>(attrs)?.ignore_index,
                ..Default::default()
            };
            one(anneal_engine::ops::cross_entropy(x()?, y()?, &opts))
        }
        o::Max::OP => {
            let a: o::Max = parse(attrs)?;
            one(x()?.max_dim(a.dim as isize, a.keepdim))
        }
        o::Min::OP => {
            let a: o::Min = parse(attrs)?;
            one(x()?.min_dim(a.dim as isize, a.keepdim))
        }
        o::Argmax::OP => {
            let a: o::Argmax = parse(attrs)?;
            one(x()?.argmax(a.dim as isize, a.keepdim))
        }
        o::Var::OP => {
            let a: o::Var = parse(attrs)?;
            one(x()?.var_dims(&dims(&a.dims), a.correction as usize, a.keepdim))
        }
        o::MaskedFill::OP => {
            one(x()?.masked_fill(y()?, parse::<o::MaskedFill>(attrs)?.value as f32))
        }
        o::Stack::OP => one(anneal_engine::ops::stack(
            inputs,
            parse::<o::Stack>(attrs)?.dim as isize,
        )),
        o::Dropout::OP => {
            // The key is derived by the host from (seed, stream name), so recomputation and
            // resharding draw the same mask.
            let a: o::Dropout = parse(attrs)?;
            let key = anneal_engine::rng::RngKey::new(a.seed as u64, &a.stream);
            one(x()?.dropout(a.p as f32, &key, a.offset as u64))
        }
        o::Constant::OP => super::ops_vision::constant(parse(attrs)?, session),
        o::MaskedScatter::OP => super::ops_vision::masked_scatter(inputs),
        _ => Err(format!("this host has no op named '{op}'")),
    }
}

/// `adamw([param, grad, exp_avg, exp_avg_sq] per parameter)`. Updates in place, one fused
/// pass over every parameter.
fn adamw(inputs: &[Tensor], a: o::AdamW) -> R<()> {
    let op = "adamw";
    if inputs.is_empty() || !inputs.len().is_multiple_of(4) {
        return Err(format!(
            "{op}: needs [param, grad, exp_avg, exp_avg_sq] per parameter, got {} tensors",
            inputs.len()
        ));
    }
    let hp = anneal_engine::ops::AdamW {
        lr: a.lr,
        beta1: a.beta1,
        beta2: a.beta2,
        eps: a.eps,
        weight_decay: a.weight_decay,
        step: u64::try_from(a.step).map_err(|_| format!("{op}: negative step"))?,
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

/// `rope(x [B, H, T, D], positions [T])`, with Llama-3 scaling when all four of its values are
/// given, or YaRN scaling when its factor and original context are.
fn rope(x: &Tensor, positions: &Tensor, a: o::Rope) -> R<Tensor> {
    use anneal_engine::ops::{rope_tables, RopeLayout, RopeSpec, RopeStyle};
    let scaling = rope_scaling(&a)?;
    let (rot_dim, theta, interleaved) = (a.rot_dim as usize, a.theta, a.interleaved);
    // Positions are read on the host; the tables go where `x` lives.
    let (cos, sin) = rope_tables(positions, rot_dim, theta, scaling).map_err(e)?;
    let (cos, sin) = (
        cos.to_device(x.device()).map_err(e)?,
        sin.to_device(x.device()).map_err(e)?,
    );
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

/// The frequency scaling a rope call asks for: Llama 3's, YaRN's or none; a partial set of
/// values is an error rather than a silently plain RoPE.
fn rope_scaling(a: &o::Rope) -> R<Option<anneal_engine::ops::RopeScaling>> {
    use anneal_engine::ops::{Llama3Scaling, YarnScaling};
    let llama3 = match (
        a.llama3_factor,
        a.llama3_low_freq_factor,
        a.llama3_high_freq_factor,
        a.llama3_original_max_positions,
    ) {
        (Some(factor), Some(low), Some(high), Some(orig)) => Some(Llama3Scaling {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: orig.max(1) as usize,
        }),
        (None, None, None, None) => None,
        _ => return Err("rope: llama3 scaling needs all four values".into()),
    };
    let yarn = match (a.yarn_factor, a.yarn_original_max_positions) {
        (Some(factor), Some(orig)) => {
            if !(factor.is_finite() && factor > 0.0) || orig < 1 {
                return Err(format!(
                    "rope: yarn needs a factor > 0 and an original context of at least 1, got {factor} and {orig}"
                ));
            }
            Some(YarnScaling {
                factor,
                beta_fast: a.yarn_beta_fast.unwrap_or(32.0),
                beta_slow: a.yarn_beta_slow.unwrap_or(1.0),
                original_max_position_embeddings: orig as usize,
                truncate: a.yarn_truncate.unwrap_or(true),
                attention_factor: a.yarn_attention_factor,
                mscale: a.yarn_mscale,
                mscale_all_dim: a.yarn_mscale_all_dim,
            })
        }
        (None, None) => None,
        _ => return Err("rope: yarn scaling needs its factor and original context".into()),
    };
    match (llama3, yarn) {
        (Some(_), Some(_)) => Err("rope: llama3 and yarn scaling are exclusive".into()),
        (Some(l), None) => Ok(Some(l.into())),
        (None, y) => Ok(y.map(Into::into)),
    }
}

/// `attention(q, k, v, positions)`. With a cache layer, `k`/`v` are appended to the session's KV cache and the queries attend over all
/// cached positions. Positions are `[T]` (every row at the same place) or `[B, T]` (each row at
/// its own, as in continuous batching; see [`attention_rows`]).
fn attention(inputs: &[Tensor], a: o::Attention, session: &HostSession) -> R<Tensor> {
    use anneal_engine::ops::AttentionParams;
    let op = "attention";
    let (q, k, v, positions) = (
        arg(inputs, 0, op)?,
        arg(inputs, 1, op)?,
        arg(inputs, 2, op)?,
        arg(inputs, 3, op)?,
    );
    let causal = a.causal;
    let window = a.sliding_window.map(|w| w as usize);
    let scale = a.scale.map(|s| s as f32);
    let softcap = a.softcap.map(|s| s as f32);
    let sinks = a.sinks.map(|h| session.get(h)).transpose()?;
    let cache = match (a.cache_layer, session.cache()) {
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
        sinks: sinks.clone(),
        q_pos: Some(q_pos),
        k_pos: Some(k_pos),
    };
    let value_from_key = a
        .value_from_key
        .map(|n| usize::try_from(n).map_err(|_| format!("attention: value_from_key = {n}")))
        .transpose()?;
    if let Some(ring) = session.ring() {
        let cached = cache.is_some() || session.cache().is_some();
        return super::ops_context::attention(q, k, v, positions, cached, params, ring);
    }
    if positions.rank() == 2 || cache.is_some_and(|(_, c)| c.is_per_row()) {
        return attention_rows(q, k, v, positions, cache, value_from_key, params);
    }
    let (k, v, k_pos) = match cache {
        Some((layer, cache)) => {
            let (k, v) = append_kv(cache, layer, k, v, value_from_key)?;
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
    value_from_key: Option<usize>,
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
            match cache {
                Some((layer, c)) => {
                    let (k, v) =
                        append_kv(&c.rows()[r], layer, &row(k)?, &row(v)?, value_from_key)?;
                    let s = k.shape()[2];
                    row(q)?
                        .attention(&k, &v, &params(q_pos, arange(s)?))
                        .map_err(e)
                }
                None => documents(&row(q)?, &row(k)?, &row(v)?, &q_pos, &params),
            }
        })
        .collect::<R<Vec<_>>>()?;
    anneal_engine::ops::cat(&outs, 0).map_err(e)
}

/// Self-attention of one row that may pack several documents: each run of consecutive
/// positions (a document, its positions restarting at 0) attends only within itself, as its
/// own attention call with the shapes it would have alone, so a packed document computes what
/// it would unpacked. A row that is one run is one call.
fn documents(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &Tensor,
    params: &impl Fn(Tensor, Tensor) -> anneal_engine::ops::AttentionParams,
) -> R<Tensor> {
    let pos = positions.to_dtype(DType::I64).map_err(e)?.to_vec::<i64>();
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=pos.len() {
        if i == pos.len() || pos[i] != pos[i - 1] + 1 {
            runs.push((start, i - start));
            start = i;
        }
    }
    if runs.len() <= 1 {
        return q
            .attention(k, v, &params(positions.clone(), positions.clone()))
            .map_err(e);
    }
    let outs = runs
        .into_iter()
        .map(|(start, len)| {
            let part = |x: &Tensor| x.narrow(2, start, len).map_err(e);
            let p = positions.narrow(0, start, len).map_err(e)?;
            part(q)?
                .attention(&part(k)?, &part(v)?, &params(p.clone(), p))
                .map_err(e)
        })
        .collect::<R<Vec<_>>>()?;
    anneal_engine::ops::cat(&outs, 2).map_err(e)
}

/// Appends `k`, `v` to `layer` of `cache` and returns everything cached. With
/// `value_from_key = n` the values are the keys' first `n` features (MLA's latent): only the
/// keys are kept, and the values are read back from them, bit for bit what was given.
fn append_kv(
    cache: &KvCache,
    layer: usize,
    k: &Tensor,
    v: &Tensor,
    value_from_key: Option<usize>,
) -> R<(Tensor, Tensor)> {
    let Some(n) = value_from_key else {
        return cache.append(layer, k, v).map_err(e);
    };
    let s = k.shape();
    if s.len() != 4 || n == 0 || n > s[3] || v.shape() != [s[0], s[1], s[2], n] {
        return Err(format!(
            "attention: value_from_key = {n} needs values [B, H, T, {n}] that are the keys' first {n} features; keys {s:?}, values {:?}",
            v.shape()
        ));
    }
    let none = Tensor::zeros_on(&[s[0], s[1], s[2], 0], v.dtype(), v.device()).map_err(e)?;
    let (keys, _) = cache.append(layer, k, &none).map_err(e)?;
    let values = keys.narrow(3, 0, n).map_err(e)?;
    Ok((keys, values))
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
        assert!(
            err.contains("narrow: attribute 0 (dim) must be an integer"),
            "{err}"
        );
        let err = run("add", &[x], &[], &s).unwrap_err();
        assert!(err.contains("add needs input 1"), "{err}");
    }
}
