//! The units' collectives on device buffers over NCCL ([`crate::parallel::nccl`]): this rank's
//! shard rows stay on the GPU as f32, a unit's all-gather sends them from one device buffer and
//! its members' full parameters are cut from the gathered buffer on the GPU; a unit's
//! reduce-scatter sends its gradients from one device buffer laid out rank block by rank block
//! and this rank's summed rows are added to the step's rows on the GPU. Nothing of a step's
//! parameters or gradients passes through host memory.
//!
//! The buffers are the host path's, element for element (each member's rows padded to its
//! block, the members one after another; f32 gathers only: an encoded gather keeps the host
//! path), and the rows are summed in the same order (zeros, then each micro-batch's rows), so
//! where NCCL sums in rank order as MPI does the bits are the host path's.
//!
//! Streams: NCCL queues on its communicators' own streams. A collective is launched once the
//! engine's stream has finished writing its send buffer (a device synchronisation), and its
//! result is read once the communicator's stream is waited for; both buffers are kept alive in
//! the flight until then.

use super::{Flight, InFlight, Units};
use crate::parallel::nccl::ShardNccl;
use crate::TrainError;
use anneal_dist::nccl::{Nccl, NcclDtype};
use anneal_dist::{Collective, DistError};
use anneal_engine::ops::cat;
use anneal_engine::{DType, Device, Tensor};

/// The shard group's NCCL gather and reduce-scatter communicators.
pub(super) struct DeviceGroup {
    gather: Nccl,
    scatter: Nccl,
}

impl DeviceGroup {
    /// The group over `comms`, when the step's shards live on their GPU (every rank alike).
    pub fn new(comms: ShardNccl) -> DeviceGroup {
        DeviceGroup {
            gather: comms.0,
            scatter: comms.1,
        }
    }

    /// The GPU the communicators run on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.gather.device())
    }

    /// Waits for both communicators' streams.
    pub fn synchronize(&self) -> Result<(), TrainError> {
        self.gather.synchronize()?;
        Ok(self.scatter.synchronize()?)
    }
}

/// A collective's device buffers, kept alive until its communicator's stream is waited for.
pub(super) struct Buffers {
    _send: Tensor,
    out: Tensor,
}

/// `t`'s device address on `nccl`'s GPU.
fn address(nccl: &Nccl, t: &Tensor, what: &str) -> Result<u64, TrainError> {
    match t.cuda_ptr() {
        Some((o, p)) if o == nccl.device() => Ok(p),
        _ => Err(TrainError::Dist(DistError::Backend(format!(
            "FSDP on device buffers: {what} is not a contiguous tensor on the communicator's GPU"
        )))),
    }
}

/// A fresh f32 buffer of `n` zeros on `device`.
fn zeros(n: usize, device: Device) -> Result<Tensor, TrainError> {
    Ok(Tensor::zeros_on(&[n], DType::F32, device)?)
}

/// A tensor of `shape` and `dtype` on `device` in storage of its own, holding `values`.
fn own(
    values: &Tensor,
    shape: &[usize],
    dtype: DType,
    device: Device,
) -> Result<Tensor, TrainError> {
    let t = Tensor::zeros_on(shape, dtype, device)?;
    t.copy_from(&values.reshape(shape)?)?;
    Ok(t)
}

/// Sums `rows` (f32 device tensors, one per parameter) over `nccl`'s ranks in one buffer, by a
/// reduce-scatter then an all-gather, as `sum_identically` does on the host, so every rank holds
/// the same bits. Each sum comes back in storage of its own.
pub(crate) fn sum_rows(nccl: &Nccl, rows: Vec<Tensor>) -> Result<Vec<Tensor>, TrainError> {
    let device = Device::Cuda(nccl.device());
    let ranks = nccl.size();
    let lens: Vec<usize> = rows.iter().map(|r| r.numel()).collect();
    let len: usize = lens.iter().sum();
    let padded = len.div_ceil(ranks).max(1) * ranks;
    let mut parts = rows;
    parts.push(zeros(padded - len, device)?);
    let send = cat(&parts, 0)?.contiguous()?;
    drop(parts);
    let block = zeros(padded / ranks, device)?;
    let out = zeros(padded, device)?;
    let (s, b, o) = (
        address(nccl, &send, "the replica sum's buffer")?,
        address(nccl, &block, "the replica sum's block")?,
        address(nccl, &out, "the replica sum's result")?,
    );
    anneal_engine::synchronize(device)?;
    // SAFETY: three contiguous f32 tensors on the communicator's GPU (`send` and `out` `padded`
    // long, `block` `padded / ranks`), written by the engine before the synchronisation above,
    // alive and untouched but by NCCL until its stream is waited for below.
    unsafe {
        nccl.reduce_scatter_sum_device(s, b, padded / ranks, NcclDtype::F32)?;
        nccl.all_gather_device(b, o, padded / ranks, NcclDtype::F32)?;
    }
    nccl.synchronize()?;
    drop((send, block));
    let mut at = 0;
    lens.iter()
        .map(|&n| {
            at += n;
            own(&out.narrow(0, at - n, n)?, &[n], DType::F32, device)
        })
        .collect()
}

/// [`super::super::Fsdp::set_shard_grads`] for rows on the GPU: each shard's gradient from the
/// step's device rows, first summed over the replicas on `replicate` (HSDP's NCCL communicator)
/// when `replicate_ranks` is given. A parameter no data-parallel rank got a gradient for keeps
/// none.
pub(crate) fn set_shard_grads_device(
    dp: &dyn Collective,
    replicate_ranks: Option<&dyn Collective>,
    replicate: Option<&Nccl>,
    shards: &[(String, Tensor)],
    rows: Vec<Tensor>,
    got: &[bool],
) -> Result<(), TrainError> {
    let mut flags: Vec<f32> = got.iter().map(|&g| if g { 1.0 } else { 0.0 }).collect();
    if dp.size() > 1 {
        dp.all_reduce_sum(&mut flags)?;
    }
    let rows = match (replicate_ranks, replicate) {
        (None, _) => rows,
        (Some(_), Some(nccl)) => sum_rows(nccl, rows)?,
        (Some(_), None) => {
            return Err(TrainError::Dist(DistError::Backend(
                "FSDP on device buffers under HSDP without the replicas' NCCL communicator".into(),
            )))
        }
    };
    for (((_, shard), rows), flag) in shards.iter().zip(rows).zip(flags) {
        if flag > 0.0 {
            let g = own(&rows, shard.shape(), shard.dtype(), shard.device())?;
            shard.set_grad(Some(g))?;
        }
    }
    Ok(())
}

impl Units {
    fn device_group(&self) -> Result<&DeviceGroup, TrainError> {
        self.dev.as_ref().ok_or_else(|| {
            TrainError::Dist(DistError::Backend(
                "FSDP on device buffers without its communicators".into(),
            ))
        })
    }

    /// This step's f32 shard rows on the GPU (views of the shards when they are f32) and zero
    /// gradient rows.
    pub(super) fn begin_step_device(
        &mut self,
        shards: &[(String, Tensor)],
    ) -> Result<(), TrainError> {
        self.local_dev = shards
            .iter()
            .map(|(_, p)| {
                Ok(p.detach()
                    .to_dtype(DType::F32)?
                    .contiguous()?
                    .reshape(&[p.numel()])?)
            })
            .collect::<Result<_, TrainError>>()?;
        self.grad_dev = shards
            .iter()
            .map(|(_, p)| zeros(p.numel(), self.device))
            .collect::<Result<_, _>>()?;
        Ok(())
    }

    /// [`Units::start_gather`] on device buffers: the members' padded rows in one buffer, an
    /// NCCL all-gather into a fresh one.
    pub(super) fn start_gather_device(&mut self, u: usize) -> Result<(), TrainError> {
        let device = self.device;
        let mut flights = InFlight::new();
        if !self.units[u].is_empty() {
            let mut parts = Vec::new();
            let mut stride = 0;
            for m in &self.units[u] {
                parts.push(self.local_dev[m.index].clone());
                let pad = m.shard.block_len() - m.shard.len();
                if pad > 0 {
                    parts.push(zeros(pad, device)?);
                }
                stride += m.shard.block_len();
            }
            let dev = self.device_group()?;
            let send = cat(&parts, 0)?.contiguous()?;
            let out = zeros(stride * dev.gather.size(), device)?;
            let (s, o) = (
                address(&dev.gather, &send, "a gather's rows")?,
                address(&dev.gather, &out, "a gather's result")?,
            );
            anneal_engine::synchronize(device)?;
            // SAFETY: `send` (`stride` f32) and `out` (`stride * ranks` f32) are contiguous on
            // the communicator's GPU, written by the engine before the synchronisation above,
            // and kept in the flight (untouched but by NCCL) until its stream is waited for.
            unsafe { dev.gather.all_gather_device(s, o, stride, NcclDtype::F32)? };
            self.gather_bytes += 4 * stride as u64;
            flights.push((0, Flight::Device(Buffers { _send: send, out })));
        }
        let bytes = self.unit_bytes(u);
        self.hold(bytes);
        self.mb()?.gathers.insert(u, flights);
        Ok(())
    }

    /// [`Units::take_gather`] on device buffers: each member's full parameter cut from the
    /// gathered buffer (its block of every rank, in rank order, truncated to its elements).
    pub(super) fn take_gather_device(
        &mut self,
        u: usize,
        flights: InFlight,
    ) -> Result<Vec<Tensor>, TrainError> {
        let dev = self.device_group()?;
        let ranks = dev.gather.size();
        let mut out = Vec::with_capacity(self.units[u].len());
        for (_, flight) in flights {
            let Flight::Device(b) = flight else {
                return Err(TrainError::Dist(DistError::Backend(
                    "FSDP on device buffers: a host collective in flight".into(),
                )));
            };
            dev.gather.synchronize()?;
            let stride = b.out.numel() / ranks;
            let all = b.out.reshape(&[ranks, stride])?;
            let mut at = 0;
            for m in &self.units[u] {
                let block = m.shard.block_len();
                let rows = all
                    .narrow(1, at, block)?
                    .contiguous()?
                    .reshape(&[ranks * block])?
                    .narrow(0, 0, m.shard.full_len())?;
                out.push(own(&rows, &m.shape, m.dtype, self.device)?);
                at += block;
            }
        }
        Ok(out)
    }

    /// [`Units::start_scatter`] on device buffers: the members' gradients (zeros for none), each
    /// padded to its blocks, laid out rank block by rank block in one buffer; an NCCL
    /// reduce-scatter into this rank's block.
    pub(super) fn start_scatter_device(&mut self, u: usize) -> Result<(), TrainError> {
        let live = std::mem::take(&mut self.mb()?.live[u]);
        let device = self.device;
        let ranks = self.device_group()?.scatter.size();
        let mut flights = InFlight::new();
        if !self.units[u].is_empty() {
            let mut cols = Vec::new();
            let mut stride = 0;
            for (k, m) in self.units[u].iter().enumerate() {
                let block = m.shard.block_len();
                let col = match live.leaves.get(k).and_then(|l| l.grad()) {
                    Some(g) => {
                        let flat = g
                            .to_dtype(DType::F32)?
                            .contiguous()?
                            .reshape(&[g.numel()])?;
                        let pad = ranks * block - flat.numel();
                        match pad {
                            0 => flat,
                            _ => cat(&[flat, zeros(pad, device)?], 0)?,
                        }
                    }
                    None => zeros(ranks * block, device)?,
                };
                cols.push(col.reshape(&[ranks, block])?);
                stride += block;
            }
            let send = cat(&cols, 1)?.contiguous()?;
            drop(cols);
            let out = zeros(stride, device)?;
            let dev = self.device_group()?;
            let (s, o) = (
                address(&dev.scatter, &send, "a reduce-scatter's gradients")?,
                address(&dev.scatter, &out, "a reduce-scatter's result")?,
            );
            anneal_engine::synchronize(device)?;
            // SAFETY: `send` (`stride * ranks` f32) and `out` (`stride` f32) are contiguous on
            // the communicator's GPU, written by the engine before the synchronisation above,
            // and kept in the flight (untouched but by NCCL) until its stream is waited for.
            unsafe {
                dev.scatter
                    .reduce_scatter_sum_device(s, o, stride, NcclDtype::F32)?
            };
            flights.push((0, Flight::Device(Buffers { _send: send, out })));
        }
        for (k, m) in self.units[u].iter().enumerate() {
            if live.leaves.get(k).and_then(|l| l.grad()).is_some() {
                self.got_grad[m.index] = true;
            }
        }
        if !live.leaves.is_empty() && !live.released {
            let bytes = self.unit_bytes(u);
            self.let_go(bytes);
        }
        drop(live);
        self.mb()?.scatters.push_back((u, flights));
        Ok(())
    }

    /// [`Units::finish_oldest_scatter`] on device buffers: waits for unit `u`'s reduce-scatter
    /// and adds this rank's rows to the step's, on the GPU.
    pub(super) fn finish_scatter_device(
        &mut self,
        u: usize,
        flights: InFlight,
    ) -> Result<(), TrainError> {
        for (_, flight) in flights {
            let Flight::Device(b) = flight else {
                return Err(TrainError::Dist(DistError::Backend(
                    "FSDP on device buffers: a host collective in flight".into(),
                )));
            };
            self.device_group()?.scatter.synchronize()?;
            let mut at = 0;
            for m in &self.units[u] {
                let rows = b.out.narrow(0, at, m.shard.len())?;
                let acc = &mut self.grad_dev[m.index];
                *acc = acc.add(&rows)?;
                at += m.shard.block_len();
            }
        }
        Ok(())
    }
}
