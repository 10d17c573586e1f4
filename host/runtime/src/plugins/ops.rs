//! The host-op registry: op names and attributes, as plugins call them, mapped onto engine ops.
//! Adding an op here changes no layout: plugins built earlier keep working.

use super::host::HostSession;
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
        "assign" => {
            x()?.copy_from(y()?).map_err(e)?;
            Ok(vec![])
        }
        _ => Err(format!("this host has no op named '{op}'")),
    }
}
