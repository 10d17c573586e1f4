//! [`Nccl`]'s entry points over device memory: raw `CUdeviceptr`s, an element count and a
//! [`NcclDtype`], with no copy through the host. The host-slice [`Collective`](crate::Collective)
//! methods stage their data on the GPU and call these.
//!
//! # Stream order and synchronisation
//! Every call is queued on [`Nccl::stream`] (the stream given to [`Nccl::new_on_stream`], or one
//! `Nccl::new` made on [`Nccl::device`]) and returns once it is queued, as NCCL does:
//! - the caller orders the work that writes the send buffers before the call: queue it on the
//!   same stream, or make the stream wait for an event recorded after it;
//! - the result may be read by later work on the same stream, or by anything after
//!   `stream.synchronize()` (or an event recorded after the call);
//! - the buffers must stay allocated, and the send buffers unchanged, until then.
//!
//! Every rank of the communicator makes the same calls in the same order (NCCL matches them by
//! order); sends and receives between one pair of ranks match in the order they are posted.
//! Buffers are device memory of [`Nccl::device`]; sums are NCCL's (on the CPU emulation:
//! in the order of [`rank_order_sum`](crate::rank_order_sum), every rank the same bits).

use super::{nccl_err, Nccl};
use crate::DistError;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::nccl::{result, sys};
use std::ffi::c_void;

/// The element types the device entry points move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclDtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// 64-bit float.
    F64,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Byte.
    U8,
}

impl NcclDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            NcclDtype::U8 => 1,
            NcclDtype::Bf16 | NcclDtype::F16 => 2,
            NcclDtype::F32 | NcclDtype::I32 => 4,
            NcclDtype::F64 | NcclDtype::I64 => 8,
        }
    }

    pub(super) fn raw(self) -> sys::ncclDataType_t {
        use sys::ncclDataType_t as T;
        match self {
            NcclDtype::F32 => T::ncclFloat32,
            NcclDtype::Bf16 => T::ncclBfloat16,
            NcclDtype::F16 => T::ncclFloat16,
            NcclDtype::F64 => T::ncclFloat64,
            NcclDtype::I32 => T::ncclInt32,
            NcclDtype::I64 => T::ncclInt64,
            NcclDtype::U8 => T::ncclUint8,
        }
    }
}

/// An NCCL communicator handle, destroyed when dropped (aborted if destroying fails).
pub(super) struct RawComm(pub(super) sys::ncclComm_t);

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInitRank and is dropped once.
        unsafe {
            if result::comm_destroy(self.0).is_err() {
                let _ = result::comm_abort(self.0);
            }
        }
    }
}

fn ptr(p: CUdeviceptr) -> *mut c_void {
    p as usize as *mut c_void
}

impl Nccl {
    fn stream_raw(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    fn sum() -> sys::ncclRedOp_t {
        sys::ncclRedOp_t::ncclSum
    }

    /// Sums `count` elements over the ranks: `recv` = the sum of every rank's `send` (the same
    /// address for in place).
    ///
    /// # Safety
    /// `send` and `recv` hold `count` elements of `dtype` on this communicator's device, and
    /// the stream rules of the [module](self) hold.
    pub unsafe fn all_reduce_sum_device(
        &self,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        count: usize,
        dtype: NcclDtype,
    ) -> Result<(), DistError> {
        let (c, s) = (self.comm.0, self.stream_raw());
        result::all_reduce(ptr(send), ptr(recv), count, dtype.raw(), Self::sum(), c, s)
            .map(drop)
            .map_err(|e| nccl_err(self, "all_reduce", e))
    }

    /// Reduce-scatter sum: `send` holds `size() * recv_count` elements, `recv` gets this rank's
    /// block (rank r: elements `r * recv_count ..`) summed over the ranks.
    ///
    /// # Safety
    /// As [`Nccl::all_reduce_sum_device`], with those lengths.
    pub unsafe fn reduce_scatter_sum_device(
        &self,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        recv_count: usize,
        dtype: NcclDtype,
    ) -> Result<(), DistError> {
        let (c, s) = (self.comm.0, self.stream_raw());
        result::reduce_scatter(
            ptr(send),
            ptr(recv),
            recv_count,
            dtype.raw(),
            Self::sum(),
            c,
            s,
        )
        .map(drop)
        .map_err(|e| nccl_err(self, "reduce_scatter", e))
    }

    /// All-gather: `recv` (`size() * send_count` elements) gets every rank's `send` in rank
    /// order.
    ///
    /// # Safety
    /// As [`Nccl::all_reduce_sum_device`], with those lengths.
    pub unsafe fn all_gather_device(
        &self,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        send_count: usize,
        dtype: NcclDtype,
    ) -> Result<(), DistError> {
        let (c, s) = (self.comm.0, self.stream_raw());
        result::all_gather(ptr(send), ptr(recv), send_count, dtype.raw(), c, s)
            .map(drop)
            .map_err(|e| nccl_err(self, "all_gather", e))
    }

    /// Broadcast: every rank's `recv` gets `root`'s `send` (read on `root` only; the same
    /// address for in place).
    ///
    /// # Safety
    /// As [`Nccl::all_reduce_sum_device`].
    pub unsafe fn broadcast_device(
        &self,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        count: usize,
        dtype: NcclDtype,
        root: usize,
    ) -> Result<(), DistError> {
        crate::check_rank("broadcast", root, self.size)?;
        let (c, s) = (self.comm.0, self.stream_raw());
        result::broadcast(ptr(send), ptr(recv), count, dtype.raw(), root as i32, c, s)
            .map(drop)
            .map_err(|e| nccl_err(self, "broadcast", e))
    }

    /// Sends `count` elements to rank `peer` (matched by its [`Nccl::recv_device`]).
    ///
    /// # Safety
    /// As [`Nccl::all_reduce_sum_device`].
    pub unsafe fn send_device(
        &self,
        buf: CUdeviceptr,
        count: usize,
        dtype: NcclDtype,
        peer: usize,
    ) -> Result<(), DistError> {
        crate::check_rank("send", peer, self.size)?;
        let (c, s) = (self.comm.0, self.stream_raw());
        result::send(ptr(buf), count, dtype.raw(), peer as i32, c, s)
            .map(drop)
            .map_err(|e| nccl_err(self, "send", e))
    }

    /// Receives `count` elements from rank `peer`.
    ///
    /// # Safety
    /// As [`Nccl::all_reduce_sum_device`].
    pub unsafe fn recv_device(
        &self,
        buf: CUdeviceptr,
        count: usize,
        dtype: NcclDtype,
        peer: usize,
    ) -> Result<(), DistError> {
        crate::check_rank("recv", peer, self.size)?;
        let (c, s) = (self.comm.0, self.stream_raw());
        result::recv(ptr(buf), count, dtype.raw(), peer as i32, c, s)
            .map(drop)
            .map_err(|e| nccl_err(self, "recv", e))
    }

    /// Variable all-to-all as one NCCL group of sends and receives: `send_counts[p]` elements
    /// of `send` (in peer order) go to rank p, `recv_counts[p]` arrive from it into `recv`.
    ///
    /// # Safety
    /// `send` and `recv` hold the counts' sums of `dtype` on this communicator's device, and
    /// the stream rules of the [module](self) hold.
    pub unsafe fn all_to_all_v_device(
        &self,
        send: CUdeviceptr,
        send_counts: &[usize],
        recv: CUdeviceptr,
        recv_counts: &[usize],
        dtype: NcclDtype,
    ) -> Result<(), DistError> {
        let n = self.size;
        if send_counts.len() != n || recv_counts.len() != n {
            return Err(DistError::Size {
                op: "all_to_all_v",
                what: "count lists (one per rank)",
                expected: n,
                got: if send_counts.len() != n {
                    send_counts.len()
                } else {
                    recv_counts.len()
                },
            });
        }
        let (c, s, t, size) = (self.comm.0, self.stream_raw(), dtype.raw(), dtype.size());
        result::group_start().map_err(|e| nccl_err(self, "group start", e))?;
        // Every call is made even after an error so the group is always ended.
        let mut first = Ok(());
        let mut at = 0;
        for (peer, &k) in send_counts.iter().enumerate() {
            if k > 0 {
                let p = ptr(send + (at * size) as CUdeviceptr);
                let r = result::send(p, k, t, peer as i32, c, s);
                first = first.and(
                    r.map(drop)
                        .map_err(|e| nccl_err(self, "all_to_all_v send", e)),
                );
            }
            at += k;
        }
        at = 0;
        for (peer, &k) in recv_counts.iter().enumerate() {
            if k > 0 {
                let p = ptr(recv + (at * size) as CUdeviceptr);
                let r = result::recv(p, k, t, peer as i32, c, s);
                first = first.and(
                    r.map(drop)
                        .map_err(|e| nccl_err(self, "all_to_all_v recv", e)),
                );
            }
            at += k;
        }
        let end = result::group_end()
            .map(drop)
            .map_err(|e| nccl_err(self, "all_to_all_v", e));
        first.and(end)
    }
}
