//! Host ops vision-language models need besides the others: `constant` (a tensor the plugin
//! computed, such as a vision tower's interpolation weights or rotary tables) and
//! `masked_scatter` (image features into their placeholder tokens), both composed from engine
//! ops so they run on any backend and `masked_scatter` gets its gradients from them.

use super::host::HostSession;
use anneal_engine::{Device, Tensor};
use anneal_plugin_api::ops as o;

type R<T> = Result<T, String>;

fn e(err: anneal_engine::Error) -> String {
    err.to_string()
}

/// `constant`: `values` as an i64 tensor, or as f32 bit patterns, of `shape`.
pub(crate) fn constant(a: o::Constant, session: &HostSession) -> R<Vec<Tensor>> {
    let op = o::Constant::OP;
    let shape = a
        .shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("{op}: negative dim in {:?}", a.shape)))
        .collect::<R<Vec<usize>>>()?;
    let n: usize = shape.iter().product();
    if n != a.values.len() {
        return Err(format!(
            "{op}: shape {:?} holds {n} values, got {}",
            a.shape,
            a.values.len()
        ));
    }
    let t = match a.dtype.as_str() {
        "i64" => Tensor::from_vec(a.values, &shape),
        "f32" => {
            let vals = a
                .values
                .iter()
                .map(|&b| {
                    u32::try_from(b)
                        .map(f32::from_bits)
                        .map_err(|_| format!("{op}: {b} is not an f32 bit pattern"))
                })
                .collect::<R<Vec<f32>>>()?;
            Tensor::from_vec(vals, &shape)
        }
        other => return Err(format!("{op}: dtype must be i64 or f32, got '{other}'")),
    }
    .map_err(e)?;
    let device = match a.like {
        Some(h) => session.get(h)?.device(),
        None => Device::Cpu,
    };
    Ok(vec![t.to_device(device).map_err(e)?])
}

/// `masked_scatter(x [.., D], mask [..], src [N, D])`: the masked rows of `x` replaced, in
/// order, by the rows of `src`, as `where(mask, src[index], x)` with the index counted from
/// the mask (read on the host), so gradients reach `x` and `src` through those two ops.
pub(crate) fn masked_scatter(inputs: &[Tensor]) -> R<Vec<Tensor>> {
    let op = o::MaskedScatter::OP;
    let [x, mask, src] = inputs else {
        return Err(format!(
            "{op}: needs x, mask and src, got {} inputs",
            inputs.len()
        ));
    };
    let xs = x.shape();
    let d = *xs
        .last()
        .ok_or_else(|| format!("{op}: x must have a row dim"))?;
    if mask.shape() != &xs[..xs.len() - 1] {
        return Err(format!(
            "{op}: mask {:?} must be x's shape {xs:?} without the last dim",
            mask.shape()
        ));
    }
    let ss = src.shape();
    if ss.len() != 2 || ss[1] != d {
        return Err(format!("{op}: src must be [N, {d}], got {ss:?}"));
    }
    let flags = mask
        .to_dtype(anneal_engine::DType::F32)
        .map_err(e)?
        .to_vec_f32();
    let mut index = Vec::with_capacity(flags.len());
    let mut taken = 0usize;
    for &f in &flags {
        if f != 0.0 {
            index.push(taken as i64);
            taken += 1;
        } else {
            index.push(0);
        }
    }
    if taken != ss[0] {
        return Err(format!(
            "{op}: the mask selects {taken} rows but src has {} (image features and \
             placeholder tokens must agree)",
            ss[0]
        ));
    }
    let rows = flags.len();
    let x2 = x.reshape(&[rows, d]).map_err(e)?;
    if taken == 0 {
        return Ok(vec![x.clone()]);
    }
    let idx = Tensor::from_vec(index, &[rows])
        .and_then(|t| t.to_device(x.device()))
        .map_err(e)?;
    let cond = Tensor::from_vec(flags, &[rows, 1])
        .and_then(|t| t.to_device(x.device()))
        .map_err(e)?;
    let picked = src.index_select(0, &idx).map_err(e)?;
    let out = anneal_engine::ops::where_(&cond, &picked, &x2)
        .and_then(|t| t.reshape(xs))
        .map_err(e)?;
    Ok(vec![out])
}
