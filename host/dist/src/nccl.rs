//! `Nccl`: the [`Collective`] trait over an NCCL communicator between GPUs (cudarc, loaded at run
//! time, so a binary built without CUDA runs everywhere).
//!
//! Bootstrap: NCCL needs a unique id shared by every rank. Rank 0 of a bootstrap communicator
//! (MPI's, or [`crate::Single`] at world size 1) creates it and broadcasts its 128 bytes over that
//! communicator; every rank then joins with `ncclCommInitRank`. Sub-communicators split the
//! bootstrap communicator the same way and join a fresh NCCL communicator over it, so the mesh
//! code works unchanged on GPUs.
//!
//! The host-slice [`Collective`] methods copy their send buffer to the GPU, run the NCCL call on
//! the communicator's stream and copy the result back; the non-blocking forms return as soon as
//! the work is queued, and [`Pending::wait`] synchronises it. The device entry points
//! (`*_device`; their stream rules are in [`device`]) take device buffers directly, for callers
//! whose data is already on the GPU. NCCL has no message tags: sends and receives between one pair of ranks match in the
//! order they are posted, and `tag` is ignored.
//!
//! Without a GPU, the CPU emulation in `tools/cuda-emu` provides the driver and an NCCL between
//! processes (docs/cuda.md), so these run under `mpiexec` on any machine.

pub mod device;
mod group;

pub use device::NcclDtype;
pub use group::Transfer;

use crate::{check_all_to_all, check_gather, check_rank, check_reduce_scatter};
use crate::{Collective, DistError, Pending, RecvBuf, SendBuf};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nccl::result;
use device::RawComm;
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

/// An NCCL error with NCCL's own last message (which names the call and the cause).
fn nccl_err(c: &Nccl, op: &'static str, e: result::NcclError) -> DistError {
    // SAFETY: the communicator is live; NCCL returns a C string it owns (possibly empty).
    let last = unsafe {
        let p = cudarc::nccl::sys::ncclGetLastError(c.comm.0);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    if last.is_empty() {
        DistError::Backend(format!("NCCL {op}: {:?}", e.0))
    } else {
        DistError::Backend(format!("NCCL {op}: {:?}: {last}", e.0))
    }
}

fn init_err(op: &'static str, e: result::NcclError) -> DistError {
    DistError::Backend(format!("NCCL {op}: {:?}", e.0))
}

fn cuda_err(op: &'static str, e: cudarc::driver::DriverError) -> DistError {
    DistError::Backend(format!("CUDA {op}: {e}"))
}

/// The GPU this rank uses when none is named: its rank among the ranks on this machine (from
/// the launcher) modulo the GPUs there.
fn local_device(rank: usize, gpus: usize) -> usize {
    crate::local_rank().unwrap_or(rank) % gpus.max(1)
}

/// The NCCL element type of a host element type.
trait Element: DeviceRepr + ValidAsZeroBits + Copy {
    const DTYPE: NcclDtype;
}
impl Element for f32 {
    const DTYPE: NcclDtype = NcclDtype::F32;
}
impl Element for u8 {
    const DTYPE: NcclDtype = NcclDtype::U8;
}
impl Element for i64 {
    const DTYPE: NcclDtype = NcclDtype::I64;
}

/// An NCCL communicator and the bootstrap communicator it was built over.
pub struct Nccl {
    comm: RawComm,
    rank: usize,
    size: usize,
    stream: Arc<CudaStream>,
    bootstrap: Box<dyn Collective>,
    device: usize,
    sent: Cell<u64>,
}

impl Nccl {
    /// Joins an NCCL communicator of `bootstrap`'s ranks on GPU `device` (by default the rank's
    /// local index modulo the machine's GPUs), on a stream of its own. Collective over
    /// `bootstrap`: every rank calls it. Fails with [`DistError::Unavailable`] naming what is
    /// missing when there is no GPU or NCCL.
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
        Nccl::new_on_stream(bootstrap, stream)
    }

    /// Joins an NCCL communicator of `bootstrap`'s ranks whose calls are queued on `stream`
    /// (e.g. the CUDA backend's stream, so collectives are ordered with its kernels without
    /// events); the device is the stream's. Collective over `bootstrap`.
    pub fn new_on_stream(
        bootstrap: Box<dyn Collective>,
        stream: Arc<CudaStream>,
    ) -> Result<Nccl, DistError> {
        if let Some(why) = unavailable() {
            return Err(DistError::Unavailable(why));
        }
        let ctx = stream.context().clone();
        // ncclCommInitRank joins on the calling thread's current device.
        ctx.bind_to_thread().map_err(|e| cuda_err("context", e))?;
        let device = ctx.ordinal();
        let mut bytes = [0u8; 128];
        if bootstrap.rank() == 0 {
            let id = result::get_uniqueid().map_err(|e| init_err("unique id", e))?;
            for (b, c) in bytes.iter_mut().zip(id.internal) {
                *b = c as u8;
            }
        }
        bootstrap.broadcast(&mut bytes, 0)?;
        let id = cudarc::nccl::sys::ncclUniqueId {
            internal: bytes.map(|b| b as std::ffi::c_char),
        };
        let (rank, size) = (bootstrap.rank(), bootstrap.size());
        let mut raw = std::mem::MaybeUninit::uninit();
        // SAFETY: `raw` is written by a successful init, and only then read.
        let comm = unsafe {
            result::comm_init_rank(raw.as_mut_ptr(), size as i32, id, rank as i32)
                .map_err(|e| init_err("init", e))?;
            RawComm(raw.assume_init())
        };
        Ok(Nccl {
            comm,
            rank,
            size,
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

    /// The stream every call of this communicator is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for every call queued so far on [`Nccl::stream`].
    pub fn synchronize(&self) -> Result<(), DistError> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("synchronize", e))
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

    /// Runs `call` on device copies of `send` and an output of `out_len` elements (their
    /// addresses), then copies the output into `recv`.
    fn staged<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        call: impl FnOnce(u64, u64) -> Result<(), DistError>,
    ) -> Result<(), DistError> {
        // cudarc refuses empty device buffers; one element stands in and is never read.
        let s = if send.is_empty() {
            self.zeros::<T>(1)?
        } else {
            self.to_device(send)?
        };
        let mut r = self.zeros::<T>(recv.len().max(1))?;
        {
            let (sp, _s) = s.device_ptr(&self.stream);
            let (rp, _r) = r.device_ptr_mut(&self.stream);
            call(sp, rp)?;
        }
        if recv.is_empty() {
            return self
                .stream
                .synchronize()
                .map_err(|e| cuda_err("synchronize", e));
        }
        self.to_host(&r, recv)
    }

    fn gather_typed<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), DistError> {
        if recv.is_empty() {
            return Ok(());
        }
        let n = send.len();
        // SAFETY: staged passes device buffers of send.len() and recv.len() elements.
        self.staged(send, recv, |s, r| unsafe {
            self.all_gather_device(s, r, n, T::DTYPE)
        })
    }

    fn all_to_all_typed<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<(), DistError> {
        // SAFETY: the counts were checked against the buffers' lengths.
        self.staged(send, recv, |s, r| unsafe {
            self.all_to_all_v_device(s, send_counts, r, recv_counts, T::DTYPE)
        })
    }

    fn send_typed<T: Element>(&self, buf: &[T], dest: usize) -> Result<(), DistError> {
        if buf.is_empty() {
            return Ok(());
        }
        let n = buf.len();
        // SAFETY: a device copy of `buf`; nothing is received.
        self.staged(buf, &mut [], |s, _| unsafe {
            self.send_device(s, n, T::DTYPE, dest)
        })
    }

    fn recv_typed<T: Element>(&self, buf: &mut [T], src: usize) -> Result<(), DistError> {
        if buf.is_empty() {
            return Ok(());
        }
        let n = buf.len();
        // SAFETY: a device buffer of buf.len() elements.
        self.staged(&[], buf, |_, r| unsafe {
            self.recv_device(r, n, T::DTYPE, src)
        })
    }

    /// Queues `run` (given the device addresses of a copy of `send` and of an output of
    /// `out_len` elements) on the stream; the handle copies the output back when waited for.
    fn start(
        &self,
        send: Vec<f32>,
        out_len: usize,
        op: &'static str,
        run: impl FnOnce(u64, u64) -> Result<(), DistError>,
    ) -> Result<Box<dyn Pending>, DistError> {
        self.count(send.len() * 4);
        if out_len == 0 {
            return Ok(Box::new(Ready(Vec::new())));
        }
        let s = self.to_device(&send)?;
        let mut out = self.zeros::<f32>(out_len)?;
        {
            let (sp, _s) = s.device_ptr(&self.stream);
            let (op_, _o) = out.device_ptr_mut(&self.stream);
            run(sp, op_)?;
        }
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
        self.rank
    }

    fn size(&self) -> usize {
        self.size
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
        {
            let (p, _p) = dev.device_ptr_mut(&self.stream);
            // SAFETY: in place on a device copy of `buf`.
            unsafe { self.broadcast_device(p, p, buf.len(), NcclDtype::U8, root)? };
        }
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
        // SAFETY: `start` passes device buffers of n elements each.
        self.start(buf, n, "all_reduce", |s, out| unsafe {
            self.all_reduce_sum_device(s, out, n, NcclDtype::F32)
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
        // SAFETY: `start` passes device buffers of size * n and n elements.
        self.start(send, n, "reduce_scatter", |s, out| unsafe {
            self.reduce_scatter_sum_device(s, out, n, NcclDtype::F32)
        })
    }

    fn iall_gather(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        let (k, n) = (send.len(), send.len() * self.size());
        // SAFETY: `start` passes device buffers of k and size * k elements.
        self.start(send, n, "all_gather", |s, out| unsafe {
            self.all_gather_device(s, out, k, NcclDtype::F32)
        })
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Collective>, DistError> {
        // The sub-communicator queues on the same stream (and so the same device).
        let sub = self.bootstrap.split(color, key)?;
        Ok(Box::new(Nccl::new_on_stream(sub, self.stream.clone())?))
    }

    fn comm_bytes(&self) -> u64 {
        self.sent.get()
    }
}
