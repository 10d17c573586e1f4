//! Hidden tensors between pipeline stages. A stage's output travels as two f32 messages: a
//! fixed-size header (for each hidden tensor whether it is floating or integer, its dtype and
//! shape) and the payload: the floating tensors packed as a recomputed block packs them
//! ([`pack_hidden`]), then the integer ones (token ids a block passes through) as f32, exact
//! below 2^24. The gradient back is the packed part's gradient alone (its length is known).
//! Sends are non-blocking, so two neighbours sending to each other never both wait; receives
//! block, in the schedule's order.

use crate::parallel::staged;
use crate::TrainError;
use anneal_dist::{Collective, Pending};
use anneal_engine::{DType, Device, Tensor};
use anneal_runtime::plugins::{pack_hidden, unpack_hidden};

/// Length of the header message.
const HEADER: usize = 64;
/// Header values per hidden tensor: kind, dtype, rank, four dims.
const PER_TENSOR: usize = 7;
/// Integers travel as f32 below this magnitude (f32's 24-bit mantissa).
const EXACT_INT: i64 = 1 << 24;

/// What a message carries.
#[derive(Clone, Copy)]
pub enum Kind {
    /// A stage's output, forward.
    Activation,
    /// The gradient of a stage's input, backward.
    Gradient,
}

/// The tag of the message into `stage` (activation) or out of it (gradient) for micro-batch
/// `mb`: unique per (kind, stage, micro-batch), so messages match whatever order they arrive
/// in. Stages below 32 and micro-batches below 512; 15 bits, within every MPI's tag bound ([`check_counts`]).
pub fn tag(kind: Kind, stage: usize, mb: usize) -> u16 {
    let k = match kind {
        Kind::Activation => 0,
        Kind::Gradient => 1,
    };
    ((k << 14) | ((stage & 31) << 9) | (mb & 511)) as u16
}

/// Fails when the micro-batches do not fit the tags.
pub fn check_counts(micro_batches: usize) -> Result<(), TrainError> {
    if micro_batches > 512 {
        return Err(TrainError::Config(format!(
            "config: `training.batch_size` / `training.micro_batch_size` = {micro_batches} micro-batches per data-parallel rank; pipeline parallelism supports at most 512"
        )));
    }
    Ok(())
}

fn dtype_code(d: DType) -> f32 {
    match d {
        DType::F32 => 0.0,
        DType::BF16 => 1.0,
        DType::F16 => 2.0,
        DType::I32 => 3.0,
        DType::I64 => 4.0,
    }
}

fn dtype_of(code: f32) -> Result<DType, TrainError> {
    Ok(match code as i32 {
        0 => DType::F32,
        1 => DType::BF16,
        2 => DType::F16,
        3 => DType::I32,
        4 => DType::I64,
        other => return Err(wire_err(format!("unknown dtype code {other} in a header"))),
    })
}

fn wire_err(msg: String) -> TrainError {
    TrainError::Pipeline(msg)
}

/// Sends `hidden` to rank `dest` (non-blocking); returns the packed floating part (whose
/// gradient comes back) and the sends in flight (wait before the step ends).
pub fn send_hidden(
    comm: &dyn Collective,
    hidden: &[Tensor],
    dest: usize,
    tag: u16,
) -> Result<(Tensor, Vec<Box<dyn Pending>>), TrainError> {
    if hidden.len() * PER_TENSOR + 1 > HEADER {
        return Err(wire_err(format!(
            "{} hidden tensors do not fit a header",
            hidden.len()
        )));
    }
    let mut header = vec![0f32; HEADER];
    header[0] = hidden.len() as f32;
    let mut ints: Vec<f32> = Vec::new();
    for (i, t) in hidden.iter().enumerate() {
        let at = 1 + i * PER_TENSOR;
        if t.rank() > 4 {
            return Err(wire_err(format!("a hidden tensor of rank {}", t.rank())));
        }
        header[at] = if t.dtype().is_float() { 0.0 } else { 1.0 };
        header[at + 1] = dtype_code(t.dtype());
        header[at + 2] = t.rank() as f32;
        for (d, &n) in t.shape().iter().enumerate() {
            header[at + 3 + d] = n as f32;
        }
        if !t.dtype().is_float() {
            for v in t.to_vec::<i64>() {
                if v.abs() >= EXACT_INT {
                    return Err(wire_err(format!(
                        "integer {v} in a hidden tensor is too large to send"
                    )));
                }
                ints.push(v as f32);
            }
        }
    }
    let packed = pack_hidden(hidden)?;
    let mut payload = packed.to_vec_f32();
    payload.extend(ints);
    let pending = vec![
        comm.isend(header, dest, tag)?,
        comm.isend(payload, dest, tag)?,
    ];
    Ok((packed, pending))
}

/// Receives the hidden tensors rank `src` sent with `tag`: the floating ones as views of one
/// leaf (returned first) whose gradient is what goes back.
pub fn recv_hidden(
    comm: &dyn Collective,
    src: usize,
    tag: u16,
    device: Device,
) -> Result<(Tensor, Vec<Tensor>), TrainError> {
    let mut header = vec![0f32; HEADER];
    comm.recv((&mut header[..]).into(), src, tag)?;
    let n = header[0] as usize;
    // (is it integer, dtype, shape) of each hidden tensor.
    let mut parts = Vec::with_capacity(n);
    for i in 0..n {
        let at = 1 + i * PER_TENSOR;
        let rank = header[at + 2] as usize;
        let shape: Vec<usize> = header[at + 3..at + 3 + rank.min(4)]
            .iter()
            .map(|&d| d as usize)
            .collect();
        parts.push((header[at] != 0.0, dtype_of(header[at + 1])?, shape));
    }
    let numel = |s: &[usize]| s.iter().product::<usize>();
    let floats: usize = parts.iter().filter(|p| !p.0).map(|p| numel(&p.2)).sum();
    let ints: usize = parts.iter().filter(|p| p.0).map(|p| numel(&p.2)).sum();
    let mut payload = vec![0f32; floats + ints];
    comm.recv((&mut payload[..]).into(), src, tag)?;
    // What arrives lands on this stage's device (staged through host memory).
    let leaf =
        staged::place(Tensor::from_slice(&payload[..floats], &[floats])?, device)?.requires_grad_();
    let float_parts: Vec<(Vec<usize>, DType)> = parts
        .iter()
        .filter(|p| !p.0)
        .map(|p| (p.2.clone(), p.1))
        .collect();
    let mut float_views = unpack_hidden(&leaf, &float_parts)?.into_iter();
    let mut at = floats;
    let mut hidden = Vec::with_capacity(n);
    for (int, dtype, shape) in parts {
        if int {
            let k = numel(&shape);
            let values: Vec<i64> = payload[at..at + k].iter().map(|&v| v as i64).collect();
            at += k;
            hidden.push(staged::place(
                Tensor::from_vec(values, &shape)?.to_dtype(dtype)?,
                device,
            )?);
        } else {
            let view = float_views
                .next()
                .ok_or_else(|| wire_err("fewer floating parts than the header lists".into()))?;
            hidden.push(view);
        }
    }
    Ok((leaf, hidden))
}

/// Sends the gradient of a received leaf back to rank `dest` (zeros when nothing reached it).
pub fn send_grad(
    comm: &dyn Collective,
    leaf: &Tensor,
    dest: usize,
    tag: u16,
) -> Result<Box<dyn Pending>, TrainError> {
    let g = match leaf.grad() {
        Some(g) => g.to_vec_f32(),
        None => vec![0.0; leaf.numel()],
    };
    Ok(comm.isend(g, dest, tag)?)
}

/// Receives the gradient of a packed output of `len` values from rank `src`.
pub fn recv_grad(
    comm: &dyn Collective,
    len: usize,
    src: usize,
    tag: u16,
    device: Device,
) -> Result<Tensor, TrainError> {
    let mut g = vec![0f32; len];
    comm.recv((&mut g[..]).into(), src, tag)?;
    staged::place(Tensor::from_vec(g, &[len])?, device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_dist::Single;

    #[test]
    fn hidden_tensors_and_their_gradient_round_trip() {
        // One process sends to itself: what a stage sends is what the next one receives.
        let comm = Single::new();
        let h = Tensor::from_vec(vec![1.5f32, -2.0, 3.25, 0.5, 7.0, -1.0], &[1, 2, 3])
            .unwrap()
            .requires_grad_();
        let y = h.mul_scalar(2.0).unwrap();
        let ids = Tensor::from_vec(vec![5i64, 70_000], &[1, 2]).unwrap();
        let fwd = tag(Kind::Activation, 1, 3);
        let (packed, sends) = send_hidden(&comm, &[y.clone(), ids], 0, fwd).unwrap();
        assert_eq!(packed.numel(), 6);
        for s in sends {
            s.wait().unwrap();
        }
        let (leaf, got) = recv_hidden(&comm, 0, fwd, Device::Cpu).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].shape(), &[1, 2, 3]);
        assert_eq!(got[0].to_vec_f32(), y.to_vec_f32());
        assert_eq!(
            (got[1].dtype(), got[1].to_vec::<i64>()),
            (DType::I64, vec![5, 70_000])
        );
        // The receiver's backward reaches its leaf; that gradient, sent back, continues the
        // sender's backward from its packed output.
        got[0]
            .mul_scalar(3.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let back = tag(Kind::Gradient, 1, 3);
        send_grad(&comm, &leaf, 0, back).unwrap().wait().unwrap();
        let g = recv_grad(&comm, packed.numel(), 0, back, Device::Cpu).unwrap();
        assert_eq!(g.to_vec_f32(), vec![3.0; 6]);
        packed.backward_with(g).unwrap();
        assert_eq!(h.grad().unwrap().to_vec_f32(), vec![6.0; 6]);
        // Tags stay within 15 bits and apart per kind, stage and micro-batch.
        assert!(tag(Kind::Gradient, 31, 511) < 1 << 15);
        assert_ne!(fwd, back);
    }
}
