//! `Nccl`: the [`Collective`] trait over an NCCL communicator between GPUs (cudarc, loaded at run
//! time, so a binary built without CUDA runs everywhere).
//!
//! Bootstrap: NCCL needs a unique id shared by every rank. Rank 0 of a bootstrap communicator
//! (MPI's, or [`crate::Single`] at world size 1) creates it and broadcasts its 128 bytes over that
//! communicator; every rank then joins with `ncclCommInitRank`. Sub-communicators split the
//! bootstrap communicator the same way and join a fresh NCCL communicator over it, so the mesh
//! code works unchanged on GPUs.
//!
//! Until the CUDA backend keeps tensors on the device, this implementation moves host slices:
//! each call copies its send buffer to the GPU, runs the NCCL collective on the communicator's
//! stream and copies the result back. The non-blocking forms return as soon as the work is queued
//! on the stream; [`Pending::wait`] synchronises it. NCCL has no message tags: sends and receives
//! between one pair of ranks match in the order they are posted, and `tag` is ignored.

use crate::{check_all_to_all, check_gather, check_rank, check_reduce_scatter};
use crate::{Collective, DistError, Pending, RecvBuf, SendBuf};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
use std::cell::Cell;
use std::sync::Arc;

/// Why NCCL cannot run on this machine, or `None` when its libraries and a GPU are there. Checked
/// before any CUDA call: cudarc panics when a library it needs is missing.
pub fn unavailable() -> Option<String> {
    // SAFETY: these only try to open the shared libraries by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("the CUDA driver library (libcuda.so) was not found: no NVIDIA driver".into());
    }
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Some(
            "the NCCL library (libnccl.so) was not found: install it (e.g. the nvidia-nccl-cu13 wheel), put its lib folder on LD_LIBRARY_PATH and add a libnccl.so link to libnccl.so.2 if only that exists"
                .into(),
        );
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("the CUDA driver reports no GPU".into()),
        Err(e) => Some(format!("the CUDA driver could not count GPUs: {e}")),
    }
}

fn nccl_err(op: &'static str, e: cudarc::nccl::result::NcclError) -> DistError {
    DistError::Backend(format!("NCCL {op}: {:?}", e.0))
}

fn cuda_err(op: &'static str, e: cudarc::driver::DriverError) -> DistError {
    DistError::Backend(format!("CUDA {op}: {e}"))
}

/// The GPU this rank uses when none is named: its rank among the ranks on this machine (from
/// the launcher) modulo the GPUs there.
fn local_device(rank: usize, gpus: usize) -> usize {
    let local = [
        "MPI_LOCALRANKID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.parse::<usize>().ok())
    .unwrap_or(rank);
    local % gpus.max(1)
}

/// An NCCL communicator and the bootstrap communicator it was built over.
pub struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
    bootstrap: Box<dyn Collective>,
    device: usize,
    sent: Cell<u64>,
}

impl Nccl {
    /// Joins an NCCL communicator of `bootstrap`'s ranks on GPU `device` (by default the rank's
    /// local index modulo the machine's GPUs). Collective over `bootstrap`: every rank calls it.
    /// Fails with [`DistError::Unavailable`] naming what is missing when there is no GPU or NCCL.
    pub fn new(bootstrap: Box<dyn Collective>, device: Option<usize>) -> Result<Nccl, DistError> {
        if let Some(why) = unavailable() {
            return Err(DistError::Unavailable(why));
        }
        let gpus = CudaContext::device_count().map_err(|e| cuda_err("device count", e))? as usize;
        let device = device.unwrap_or_else(|| local_device(bootstrap.rank(), gpus));
        if device >= gpus {
            return Err(DistError::Unavailable(format!(
                "GPU {device} asked for, but this machine has {gpus}"
            )));
        }
        let ctx = CudaContext::new(device).map_err(|e| cuda_err("context", e))?;
        let stream = ctx.new_stream().map_err(|e| cuda_err("stream", e))?;
        let mut bytes = [0u8; 128];
        if bootstrap.rank() == 0 {
            let id = Id::new().map_err(|e| nccl_err("unique id", e))?;
            for (b, c) in bytes.iter_mut().zip(id.internal()) {
                *b = *c as u8;
            }
        }
        bootstrap.broadcast(&mut bytes, 0)?;
        let id = Id::uninit(bytes.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(stream.clone(), bootstrap.rank(), bootstrap.size(), id)
            .map_err(|e| nccl_err("init", e))?;
        Ok(Nccl {
            comm,
            stream,
            bootstrap,
            device,
            sent: Cell::new(0),
        })
    }

    /// The GPU this rank's communicator runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    fn count(&self, bytes: usize) {
        self.sent.set(self.sent.get() + bytes as u64);
    }

    fn to_device<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, DistError> {
        self.stream
            .clone_htod(host)
            .map_err(|e| cuda_err("copy to GPU", e))
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, DistError> {
        self.stream
            .alloc_zeros(n)
            .map_err(|e| cuda_err("allocate", e))
    }

    /// Copies `dev` back into `host` (synchronising the stream).
    fn to_host<T: DeviceRepr>(&self, dev: &CudaSlice<T>, host: &mut [T]) -> Result<(), DistError> {
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| cuda_err("copy to host", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("synchronize", e))
    }

    fn gather_typed<T: DeviceRepr + ValidAsZeroBits + NcclType>(
        &self,
        send: &[T],
        recv: &mut [T],
    ) -> Result<(), DistError> {
        if recv.is_empty() {
            return Ok(());
        }
        let s = self.to_device(send)?;
        let mut r = self.zeros::<T>(recv.len())?;
        self.comm
            .all_gather(&s, &mut r)
            .map_err(|e| nccl_err("all_gather", e))?;
        self.to_host(&r, recv)
    }

    fn all_to_all_typed<T: DeviceRepr + ValidAsZeroBits + NcclType>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<(), DistError> {
        let s = if send.is_empty() {
            None
        } else {
            Some(self.to_device(send)?)
        };
        // One receive buffer per peer, so each gets its own mutable view inside the group.
        let mut bufs = recv_counts
            .iter()
            .map(|&n| {
                if n == 0 {
                    Ok(None)
                } else {
                    self.zeros::<T>(n).map(Some)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        {
            let mut offsets = Vec::with_capacity(send_counts.len());
            let mut at = 0;
            for &n in send_counts {
                offsets.push(at..at + n);
                at += n;
            }
            let sends: Vec<_> = offsets
                .into_iter()
                .enumerate()
                .filter(|(_, r)| !r.is_empty())
                .filter_map(|(peer, r)| Some((peer, s.as_ref()?.slice(r))))
                .collect();
            let recvs: Vec<_> = bufs
                .iter_mut()
                .enumerate()
                .filter_map(|(peer, b)| Some((peer, b.as_mut()?.as_view_mut())))
                .collect();
            let mut group = self.comm.group();
            for (peer, view) in sends {
                group
                    .send(view, peer as i32)
                    .map_err(|e| nccl_err("all_to_all_v send", e))?;
            }
            for (peer, view) in recvs {
                group
                    .recv(view, peer as i32)
                    .map_err(|e| nccl_err("all_to_all_v recv", e))?;
            }
        }
        let mut at = 0;
        for (b, &n) in bufs.iter().zip(recv_counts) {
            if let Some(b) = b {
                self.to_host(b, &mut recv[at..at + n])?;
            }
            at += n;
        }
        Ok(())
    }

    fn send_typed<T: DeviceRepr + NcclType>(
        &self,
        buf: &[T],
        dest: usize,
    ) -> Result<(), DistError> {
        if buf.is_empty() {
            return Ok(());
        }
        let s = self.to_device(buf)?;
        self.comm
            .send(&s, dest as i32)
            .map_err(|e| nccl_err("send", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("synchronize", e))
    }

    fn recv_typed<T: DeviceRepr + ValidAsZeroBits + NcclType>(
        &self,
        buf: &mut [T],
        src: usize,
    ) -> Result<(), DistError> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut r = self.zeros::<T>(buf.len())?;
        self.comm
            .recv(&mut r, src as i32)
            .map_err(|e| nccl_err("recv", e))?;
        self.to_host(&r, buf)
    }

    /// Queues `run` on the stream over a device copy of `send` and an output of `out_len`
    /// elements; the handle copies the output back when waited for.
    fn start(
        &self,
        send: Vec<f32>,
        out_len: usize,
        op: &'static str,
        run: impl FnOnce(&Comm, &CudaSlice<f32>, &mut CudaSlice<f32>) -> Result<(), DistError>,
    ) -> Result<Box<dyn Pending>, DistError> {
        self.count(send.len() * 4);
        if out_len == 0 {
            return Ok(Box::new(Ready(Vec::new())));
        }
        let s = self.to_device(&send)?;
        let mut out = self.zeros::<f32>(out_len)?;
        run(&self.comm, &s, &mut out)?;
        Ok(Box::new(InFlight {
            stream: self.stream.clone(),
            _send: s,
            out,
            op,
        }))
    }
}

/// A result already there (an empty operation).
struct Ready(Vec<f32>);

impl Pending for Ready {
    fn wait(self: Box<Self>) -> Result<Vec<f32>, DistError> {
        Ok(self.0)
    }
}

/// A collective queued on a stream; its device buffers live until it is waited for (dropping
/// them earlier would free memory the GPU may still read: cudarc's slices free in stream order).
struct InFlight {
    stream: Arc<CudaStream>,
    _send: CudaSlice<f32>,
    out: CudaSlice<f32>,
    op: &'static str,
}

impl Pending for InFlight {
    fn wait(self: Box<Self>) -> Result<Vec<f32>, DistError> {
        let mut host = vec![0f32; self.out.len()];
        self.stream
            .memcpy_dtoh(&self.out, &mut host)
            .map_err(|e| cuda_err(self.op, e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_err(self.op, e))?;
        Ok(host)
    }
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), DistError> {
        let out = self.iall_reduce_sum(buf.to_vec())?.wait()?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DistError> {
        check_reduce_scatter(send.len(), recv.len(), self.size())?;
        let out = self.ireduce_scatter_sum(send.to_vec())?.wait()?;
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn all_gather(&self, send: SendBuf<'_>, recv: RecvBuf<'_>) -> Result<(), DistError> {
        check_gather(&send, &recv, self.size())?;
        self.count(send.bytes());
        match (send, recv) {
            (SendBuf::F32(s), RecvBuf::F32(r)) => self.gather_typed(s, r),
            (SendBuf::U8(s), RecvBuf::U8(r)) => self.gather_typed(s, r),
            (SendBuf::I64(s), RecvBuf::I64(r)) => self.gather_typed(s, r),
            _ => unreachable!("check_gather compared the element types"),
        }
    }

    fn all_to_all_v(
        &self,
        send: SendBuf<'_>,
        send_counts: &[usize],
        recv: RecvBuf<'_>,
        recv_counts: &[usize],
    ) -> Result<(), DistError> {
        check_all_to_all(&send, send_counts, &recv, recv_counts, self.size())?;
        self.count(send.bytes());
        match (send, recv) {
            (SendBuf::F32(s), RecvBuf::F32(r)) => {
                self.all_to_all_typed(s, send_counts, r, recv_counts)
            }
            (SendBuf::U8(s), RecvBuf::U8(r)) => {
                self.all_to_all_typed(s, send_counts, r, recv_counts)
            }
            (SendBuf::I64(s), RecvBuf::I64(r)) => {
                self.all_to_all_typed(s, send_counts, r, recv_counts)
            }
            _ => unreachable!("check_all_to_all compared the element types"),
        }
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError> {
        check_rank("broadcast", root, self.size())?;
        if buf.is_empty() {
            return Ok(());
        }
        self.count(buf.len());
        let mut dev = self.to_device(buf)?;
        self.comm
            .broadcast_in_place(&mut dev, root as i32)
            .map_err(|e| nccl_err("broadcast", e))?;
        self.to_host(&dev, buf)
    }

    fn barrier(&self) -> Result<(), DistError> {
        // A one-element all-reduce returns on a rank only once every rank has joined it.
        self.all_reduce_sum(&mut [0.0])
    }

    fn send(&self, buf: SendBuf<'_>, dest: usize, _tag: u16) -> Result<(), DistError> {
        check_rank("send", dest, self.size())?;
        self.count(buf.bytes());
        match buf {
            SendBuf::F32(b) => self.send_typed(b, dest),
            SendBuf::U8(b) => self.send_typed(b, dest),
            SendBuf::I64(b) => self.send_typed(b, dest),
        }
    }

    fn recv(&self, buf: RecvBuf<'_>, src: usize, _tag: u16) -> Result<(), DistError> {
        check_rank("recv", src, self.size())?;
        match buf {
            RecvBuf::F32(b) => self.recv_typed(b, src),
            RecvBuf::U8(b) => self.recv_typed(b, src),
            RecvBuf::I64(b) => self.recv_typed(b, src),
        }
    }

    fn iall_reduce_sum(&self, buf: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        let n = buf.len();
        self.start(buf, n, "all_reduce", |comm, s, out| {
            comm.all_reduce(s, out, &ReduceOp::Sum)
                .map(drop)
                .map_err(|e| nccl_err("all_reduce", e))
        })
    }

    fn ireduce_scatter_sum(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        let size = self.size();
        if !send.len().is_multiple_of(size) {
            return Err(DistError::Size {
                op: "reduce_scatter_sum",
                what: "send buffer (a multiple of the communicator size)",
                expected: send.len().div_ceil(size) * size,
                got: send.len(),
            });
        }
        let n = send.len() / size;
        self.start(send, n, "reduce_scatter", |comm, s, out| {
            comm.reduce_scatter(s, out, &ReduceOp::Sum)
                .map(drop)
                .map_err(|e| nccl_err("reduce_scatter", e))
        })
    }

    fn iall_gather(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        let n = send.len() * self.size();
        self.start(send, n, "all_gather", |comm, s, out| {
            comm.all_gather(s, out)
                .map(drop)
                .map_err(|e| nccl_err("all_gather", e))
        })
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Collective>, DistError> {
        let sub = self.bootstrap.split(color, key)?;
        Ok(Box::new(Nccl::new(sub, Some(self.device))?))
    }

    fn comm_bytes(&self) -> u64 {
        self.sent.get()
    }
}
