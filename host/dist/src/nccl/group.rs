//! Point-to-point transfers grouped into one NCCL call ([`Nccl::exchange_device`]): the sends
//! and receives of a ring pass (context parallelism's key/value blocks), posted together so
//! two neighbours that send to each other never wait on each other (NCCL pairs a send with
//! its receive only when both are posted; inside `ncclGroupStart/End` they are posted at once).

use super::{nccl_err, Nccl, NcclDtype};
use crate::DistError;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::nccl::{result, sys};
use std::ffi::c_void;

/// One transfer of a group: `count` elements of `dtype` at device address `buf`.
#[derive(Clone, Copy, Debug)]
pub struct Transfer {
    /// Device address of the first element.
    pub buf: CUdeviceptr,
    /// Elements moved.
    pub count: usize,
    /// Their type.
    pub dtype: NcclDtype,
    /// The rank sent to (or received from).
    pub peer: usize,
}

impl Nccl {
    /// Posts every send of `sends` and every receive of `recvs` as one NCCL group, queued on
    /// [`Nccl::stream`]. Between one pair of ranks, sends match receives in the order listed.
    ///
    /// # Safety
    /// Every buffer holds its `count` elements of its `dtype` on this communicator's device,
    /// and the stream rules of [`super::device`] hold (send buffers written before the call and
    /// unchanged, receive buffers read only after the stream is synchronised).
    pub unsafe fn exchange_device(
        &self,
        sends: &[Transfer],
        recvs: &[Transfer],
    ) -> Result<(), DistError> {
        for t in sends.iter().chain(recvs) {
            crate::check_rank("exchange", t.peer, self.size)?;
        }
        let (c, s) = (self.comm.0, self.stream.cu_stream() as sys::cudaStream_t);
        let ptr = |p: CUdeviceptr| p as usize as *mut c_void;
        result::group_start().map_err(|e| nccl_err(self, "group start", e))?;
        // Every call is made even after an error so the group is always ended.
        let mut first = Ok(());
        for t in sends.iter().filter(|t| t.count > 0) {
            let r = result::send(ptr(t.buf), t.count, t.dtype.raw(), t.peer as i32, c, s);
            first = first.and(r.map(drop).map_err(|e| nccl_err(self, "exchange send", e)));
        }
        for t in recvs.iter().filter(|t| t.count > 0) {
            let r = result::recv(ptr(t.buf), t.count, t.dtype.raw(), t.peer as i32, c, s);
            first = first.and(r.map(drop).map_err(|e| nccl_err(self, "exchange recv", e)));
        }
        let end = result::group_end()
            .map(drop)
            .map_err(|e| nccl_err(self, "exchange", e));
        first.and(end)
    }
}
