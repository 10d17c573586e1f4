//! Every stage's tensors on every rank of a pipeline: what `anneal rl` gathers once per step
//! for its rollouts (which decode with the whole policy) and for a checkpoint written whole.
//! Each rank in turn broadcasts its tensors' names, shapes, dtypes and f32 values; floats
//! travel as their bits, so every copy is exactly the owner's.

use crate::TrainError;
use anneal_dist::Collective;
use anneal_engine::{DType, Device, Tensor};

/// What one rank sends: each tensor's name, shape and dtype, then every value.
#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    tensors: Vec<(String, Vec<usize>, String)>,
}

/// Every rank's `local` tensors (floating point, on the host), on every rank of `comm`: this
/// rank's own as detached views, the others' as new tensors; in rank order, each rank's in the
/// order it listed them. Collective over `comm`.
pub fn gather_whole(
    comm: &dyn Collective,
    local: &[(String, Tensor)],
) -> Result<Vec<(String, Tensor)>, TrainError> {
    let mut out = Vec::new();
    // The others' tensors land on this rank's device (every rank of a job computes on one kind).
    let device = local.first().map_or(Device::Cpu, |(_, t)| t.device());
    for root in 0..comm.size() {
        if root == comm.rank() {
            out.extend(local.iter().map(|(n, t)| (n.clone(), t.detach())));
            let mut bytes = encode(local)?;
            let mut len = (bytes.len() as u64).to_le_bytes();
            comm.broadcast(&mut len, root)?;
            comm.broadcast(&mut bytes, root)?;
        } else {
            let mut len = [0u8; 8];
            comm.broadcast(&mut len, root)?;
            let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
            comm.broadcast(&mut bytes, root)?;
            out.extend(decode(&bytes, device)?);
        }
    }
    Ok(out)
}

fn encode(local: &[(String, Tensor)]) -> Result<Vec<u8>, TrainError> {
    let mut header = Header {
        tensors: Vec::with_capacity(local.len()),
    };
    for (name, t) in local {
        if !t.dtype().is_float() {
            return Err(TrainError::Pipeline(format!(
                "cannot gather {name} over the pipeline: dtype {} is not floating point",
                t.dtype().name()
            )));
        }
        header.tensors.push((
            name.clone(),
            t.shape().to_vec(),
            t.dtype().name().to_string(),
        ));
    }
    let head = serde_json::to_vec(&header)
        .map_err(|e| TrainError::Pipeline(format!("cannot encode tensor names: {e}")))?;
    let mut bytes = (head.len() as u64).to_le_bytes().to_vec();
    bytes.extend(head);
    for (_, t) in local {
        for v in t.to_vec_f32() {
            bytes.extend(v.to_bits().to_le_bytes());
        }
    }
    Ok(bytes)
}

fn decode(bytes: &[u8], device: Device) -> Result<Vec<(String, Tensor)>, TrainError> {
    let bad = |what: &str| TrainError::Pipeline(format!("a pipeline rank sent {what}"));
    let head_len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
        .ok_or_else(|| bad("no header"))?;
    let head = bytes
        .get(8..8 + head_len)
        .ok_or_else(|| bad("a short header"))?;
    let header: Header = serde_json::from_slice(head).map_err(|_| bad("a bad header"))?;
    let mut at = 8 + head_len;
    let mut out = Vec::with_capacity(header.tensors.len());
    for (name, shape, dtype) in header.tensors {
        let n: usize = shape.iter().product();
        let raw = bytes
            .get(at..at + 4 * n)
            .ok_or_else(|| bad("fewer values than its shapes"))?;
        at += 4 * n;
        let values: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect();
        let dtype = DType::parse(&dtype).ok_or_else(|| bad("an unknown dtype"))?;
        let t = Tensor::from_vec(values, &shape)?;
        let t = if dtype == DType::F32 {
            t
        } else {
            t.to_dtype(dtype)?
        };
        out.push((name, super::super::staged::place(t, device)?));
    }
    Ok(out)
}
