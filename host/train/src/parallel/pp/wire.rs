//! Hidden tensors between pipeline stages. A stage's output travels as a fixed-size header
//! (for each hidden tensor whether it is floating or integer, its dtype and shape), the
//! floating tensors packed as a recomputed block packs them ([`pack_hidden`], f32) and the
//! integer ones (token ids a block passes through) as f32, exact below 2^24. The gradient back
//! is the packed part's gradient alone (its length is known).
//!
//! Two transports, the same on every rank of the pipeline:
//! - **staged** (the CPU, and GPUs without NCCL): every message is a tagged MPI message from
//!   host memory. Sends are non-blocking, so two neighbours sending to each other never both
//!   wait; receives block, in the schedule's order, and match by tag whatever order they came.
//! - **NCCL** (GPU ranks with the pipeline's communicator, [`crate::parallel::nccl_groups`]):
//!   the header and the integers still go over MPI at once (host values, a few hundred
//!   bytes), the packed floats and their gradients move device buffers. NCCL pairs a send with
//!   a receive only when both are posted, in the order posted between two ranks, so a send is
//!   queued and posted with this rank's next receive in one NCCL group (or at the step's end),
//!   once it is due in its receiver's order. [`super::p2p_plan`] says where a schedule
//!   finishes that way (one stage per rank: 1F1B, ZB-H1); the others stay staged.

use crate::parallel::pp::p2p_plan::Plan;
use crate::parallel::{nccl_groups, staged};
use crate::TrainError;
use anneal_dist::nccl::{Nccl, Transfer};
use anneal_dist::{Collective, Pending};
use anneal_engine::{DType, Device, Tensor};
use anneal_runtime::plugins::{pack_hidden, unpack_hidden};
use std::rc::Rc;
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

/// A message's host part (header, integers) and its floats (on the device under NCCL).
struct Message {
    header: Vec<f32>,
    ints: Vec<f32>,
    floats: Tensor,
}

/// The header and the integer values (as f32) of `hidden`.
fn describe(hidden: &[Tensor]) -> Result<(Vec<f32>, Vec<f32>), TrainError> {
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
    Ok((header, ints))
}

/// (is it integer, dtype, shape) of each hidden tensor a header lists.
type Parts = Vec<(bool, DType, Vec<usize>)>;

fn parts_of(header: &[f32]) -> Result<Parts, TrainError> {
    let n = header[0] as usize;
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
    Ok(parts)
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// Values of the floating and of the integer parts.
fn counts(parts: &Parts) -> (usize, usize) {
    let sum = |int: bool| {
        parts
            .iter()
            .filter(|p| p.0 == int)
            .map(|p| numel(&p.2))
            .sum()
    };
    (sum(false), sum(true))
}

/// One step's messages between this rank's stages and its neighbours'.
pub struct Wire<'a> {
    comm: &'a dyn Collective,
    device: Device,
    /// The pipeline's NCCL communicator and the order the neighbours take this rank's sends,
    /// when messages move device buffers.
    nccl: Option<(Rc<Nccl>, Plan)>,
    /// MPI sends in flight.
    in_flight: Vec<Box<dyn Pending>>,
    /// Device sends not posted yet: (tag, floats, destination), in the order made.
    queued: Vec<(u16, Tensor, usize)>,
}

impl<'a> Wire<'a> {
    /// The staged transport over `comm` (the `pp` communicator), landing what arrives on
    /// `device`.
    pub fn staged(comm: &'a dyn Collective, device: Device) -> Wire<'a> {
        Wire {
            comm,
            device,
            nccl: None,
            in_flight: Vec::new(),
            queued: Vec::new(),
        }
    }

    /// The NCCL transport when the pipeline's communicator is installed on this thread for
    /// `device` and `plan` says the schedule finishes over it ([`super::p2p_plan::plan`]),
    /// else the staged one. Every rank of the pipeline chooses alike: the communicator is built on all
    /// of them or none, and the plan is the same schedule's.
    pub fn new(comm: &'a dyn Collective, device: Device, plan: Option<Plan>) -> Wire<'a> {
        let mut wire = Wire::staged(comm, device);
        wire.nccl = nccl_groups::pipeline_comm(device).zip(plan);
        wire
    }

    fn isend(&mut self, values: Vec<f32>, dest: usize, tag: u16) -> Result<(), TrainError> {
        self.in_flight.push(self.comm.isend(values, dest, tag)?);
        Ok(())
    }

    fn recv_host(&self, len: usize, src: usize, tag: u16) -> Result<Vec<f32>, TrainError> {
        let mut values = vec![0f32; len];
        self.comm.recv((&mut values[..]).into(), src, tag)?;
        Ok(values)
    }

    /// Sends `msg` to rank `dest`: all of it over MPI (staged), or the header and the integers
    /// over MPI at once and the floats queued for NCCL.
    fn send(&mut self, msg: Message, dest: usize, tag: u16) -> Result<(), TrainError> {
        if self.nccl.is_none() {
            let mut payload = msg.floats.to_vec_f32();
            payload.extend(msg.ints);
            if !msg.header.is_empty() {
                self.isend(msg.header, dest, tag)?;
            }
            return self.isend(payload, dest, tag);
        }
        let floats = msg.floats.to_device(self.device)?.contiguous()?;
        // The host part leaves now (its receiver waits for it before its group).
        if !msg.header.is_empty() {
            self.isend(msg.header, dest, tag)?;
        }
        if !msg.ints.is_empty() {
            self.isend(msg.ints, dest, tag)?;
        }
        self.queued.push((tag, floats, dest));
        Ok(())
    }

    /// `len` floats from rank `src` into a fresh tensor on this rank's GPU, posted in one NCCL
    /// group with the queued sends that are due.
    fn recv_device(&mut self, len: usize, src: usize) -> Result<Tensor, TrainError> {
        let out = Tensor::zeros_on(&[len], DType::F32, self.device)?;
        self.post(&[(&out, src)])?;
        Ok(out)
    }

    /// Posts the due queued sends ([`Plan`]: each once every earlier message its
    /// receiver takes from this rank is posted) and `recvs` as one NCCL group, and waits for
    /// it.
    fn post(&mut self, recvs: &[(&Tensor, usize)]) -> Result<(), TrainError> {
        const OP: &str = "pipeline send/recv";
        let Some((nccl, plan)) = self.nccl.as_mut() else {
            return Err(wire_err("a device transfer without NCCL".into()));
        };
        let mut posting: Vec<(Tensor, usize)> = Vec::new();
        while let Some(i) = self
            .queued
            .iter()
            .position(|&(tag, _, dest)| plan.due.get(&dest).and_then(|d| d.front()) == Some(&tag))
        {
            let (_, floats, dest) = self.queued.remove(i);
            if let Some(d) = plan.due.get_mut(&dest) {
                d.pop_front();
            }
            posting.push((floats, dest));
        }
        let nccl = nccl.clone();
        let sends = posting
            .iter()
            .map(|(t, dest)| transfer(&nccl, t, *dest))
            .collect::<Result<Vec<_>, _>>()?;
        let recvs = recvs
            .iter()
            .map(|(t, src)| transfer(&nccl, t, *src))
            .collect::<Result<Vec<_>, _>>()?;
        // SAFETY: every transfer names a contiguous f32 tensor of its count on the
        // communicator's GPU (`transfer`); the sends live in `posting` and the receive buffers
        // with the caller until `ordered` synchronised the stream, and the receive buffers are
        // fresh, written by NCCL alone.
        nccl_groups::ordered(&nccl, OP, || unsafe {
            nccl.exchange_device(&sends, &recvs)
        })?;
        drop(posting);
        Ok(())
    }

    /// Receives the message rank `src` sent with `tag`: a header and what it lists (`len` is
    /// `None`), or `len` floats alone (a gradient).
    fn recv(&mut self, src: usize, tag: u16, len: Option<usize>) -> Result<Message, TrainError> {
        let (header, floats, ints) = match len {
            Some(n) => (Vec::new(), n, 0),
            None => {
                let header = self.recv_host(HEADER, src, tag)?;
                let (floats, ints) = counts(&parts_of(&header)?);
                (header, floats, ints)
            }
        };
        if self.nccl.is_some() {
            let ints = match ints {
                0 => Vec::new(),
                n => self.recv_host(n, src, tag)?,
            };
            let floats = self.recv_device(floats, src)?;
            return Ok(Message {
                header,
                ints,
                floats,
            });
        }
        let mut payload = self.recv_host(floats + ints, src, tag)?;
        let ints = payload.split_off(floats);
        // What arrives lands on this stage's device (staged through host memory).
        let floats = staged::place(Tensor::from_vec(payload, &[floats])?, self.device)?;
        Ok(Message {
            header,
            ints,
            floats,
        })
    }

    /// Sends `hidden` to rank `dest`; returns the packed floating part, whose gradient comes
    /// back.
    pub fn send_hidden(
        &mut self,
        hidden: &[Tensor],
        dest: usize,
        tag: u16,
    ) -> Result<Tensor, TrainError> {
        let (header, ints) = describe(hidden)?;
        let packed = pack_hidden(hidden)?;
        let msg = Message {
            header,
            ints,
            floats: packed.clone(),
        };
        self.send(msg, dest, tag)?;
        Ok(packed)
    }

    /// Receives the hidden tensors rank `src` sent with `tag`: the floating ones as views of
    /// one leaf (returned first) whose gradient is what goes back.
    pub fn recv_hidden(
        &mut self,
        src: usize,
        tag: u16,
    ) -> Result<(Tensor, Vec<Tensor>), TrainError> {
        let msg = self.recv(src, tag, None)?;
        let parts = parts_of(&msg.header)?;
        let leaf = msg.floats.detach().requires_grad_();
        let float_parts: Vec<(Vec<usize>, DType)> = parts
            .iter()
            .filter(|p| !p.0)
            .map(|p| (p.2.clone(), p.1))
            .collect();
        let mut float_views = unpack_hidden(&leaf, &float_parts)?.into_iter();
        let mut at = 0;
        let mut hidden = Vec::with_capacity(parts.len());
        for (int, dtype, shape) in parts {
            if int {
                let k = numel(&shape);
                let values: Vec<i64> = msg.ints[at..at + k].iter().map(|&v| v as i64).collect();
                at += k;
                hidden.push(staged::place(
                    Tensor::from_vec(values, &shape)?.to_dtype(dtype)?,
                    self.device,
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

    /// Sends the gradient of a received leaf back to rank `dest` (zeros when nothing reached
    /// it).
    pub fn send_grad(&mut self, leaf: &Tensor, dest: usize, tag: u16) -> Result<(), TrainError> {
        let floats = match leaf.grad() {
            Some(g) => g.detach(),
            None => Tensor::zeros_on(&[leaf.numel()], DType::F32, leaf.device())?,
        };
        let msg = Message {
            header: Vec::new(),
            ints: Vec::new(),
            floats,
        };
        self.send(msg, dest, tag)
    }

    /// Receives the gradient of a packed output of `len` values from rank `src`.
    pub fn recv_grad(&mut self, len: usize, src: usize, tag: u16) -> Result<Tensor, TrainError> {
        Ok(self.recv(src, tag, Some(len))?.floats)
    }

    /// Posts what is still queued and waits for every send: call before the step ends.
    pub fn finish(mut self) -> Result<(), TrainError> {
        if !self.queued.is_empty() {
            self.post(&[])?;
        }
        if !self.queued.is_empty() {
            return Err(wire_err(format!(
                "{} message(s) made that no neighbour takes",
                self.queued.len()
            )));
        }
        for s in std::mem::take(&mut self.in_flight) {
            s.wait()?;
        }
        Ok(())
    }
}

/// The NCCL transfer of all of `t` (contiguous f32 on `nccl`'s GPU) with rank `peer`.
fn transfer(nccl: &Nccl, t: &Tensor, peer: usize) -> Result<Transfer, TrainError> {
    let buf = match t.numel() {
        0 => 0,
        _ => nccl_groups::address(nccl, t, "pipeline send/recv")?,
    };
    Ok(Transfer {
        buf,
        count: t.numel(),
        dtype: anneal_dist::nccl::NcclDtype::F32,
        peer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_dist::Single;

    #[test]
    fn hidden_tensors_and_their_gradient_round_trip() {
        // One process sends to itself: what a stage sends is what the next one receives.
        let comm = Single::new();
        let mut wire = Wire::staged(&comm, Device::Cpu);
        let h = Tensor::from_vec(vec![1.5f32, -2.0, 3.25, 0.5, 7.0, -1.0], &[1, 2, 3])
            .unwrap()
            .requires_grad_();
        let y = h.mul_scalar(2.0).unwrap();
        let ids = Tensor::from_vec(vec![5i64, 70_000], &[1, 2]).unwrap();
        let fwd = tag(Kind::Activation, 1, 3);
        let packed = wire.send_hidden(&[y.clone(), ids], 0, fwd).unwrap();
        assert_eq!(packed.numel(), 6);
        let (leaf, got) = wire.recv_hidden(0, fwd).unwrap();
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
        wire.send_grad(&leaf, 0, back).unwrap();
        let g = wire.recv_grad(packed.numel(), 0, back).unwrap();
        assert_eq!(g.to_vec_f32(), vec![3.0; 6]);
        wire.finish().unwrap();
        packed.backward_with(g).unwrap();
        assert_eq!(h.grad().unwrap().to_vec_f32(), vec![6.0; 6]);
        // Tags stay within 15 bits and apart per kind, stage and micro-batch.
        assert!(tag(Kind::Gradient, 31, 511) < 1 << 15);
        assert_ne!(fwd, back);
    }
}
