//! [`Collective`] over an MPI communicator, through the `mpi` crate (rsmpi). MPI has no
//! in-place form in rsmpi, so reductions go through a copy of the input. rsmpi aborts the job
//! on an MPI error (MPI's default handler), so every length and rank is checked here first and
//! returned as a [`DistError`].

use crate::{
    check_all_to_all, check_gather, check_rank, check_reduce_scatter, Collective, DistError,
    Pending, RecvBuf, SendBuf,
};
use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Count;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// An MPI communicator: the world of a job started by `mpiexec`, or a sub-communicator
/// ([`Collective::split`]) of it.
pub struct Mpi {
    // Field order is drop order: the communicator is freed before the last handle on the
    // universe finalizes MPI.
    comm: SimpleCommunicator,
    universe: Arc<mpi::environment::Universe>,
    /// Shared with the communicators split from this one, so the world's counter is the rank's total.
    bytes: Arc<AtomicU64>,
}

impl Mpi {
    /// Initialises MPI (once per process) and returns its world communicator. Only the
    /// training thread calls MPI, so "funneled" threading suffices.
    pub fn init() -> Result<Mpi, DistError> {
        let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| DistError::Init("already initialised in this process".into()))?;
        Ok(Mpi {
            comm: universe.world(),
            universe: Arc::new(universe),
            bytes: Arc::new(AtomicU64::new(0)),
        })
    }

    fn count(&self, bytes: usize) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// An MPI count from a length, or [`DistError::TooLarge`].
fn mpi_count(op: &'static str, n: usize) -> Result<Count, DistError> {
    Count::try_from(n).map_err(|_| DistError::TooLarge { op, count: n })
}

/// Counts and displacements (prefix sums) of an all-to-all partition.
fn partition(op: &'static str, counts: &[usize]) -> Result<(Vec<Count>, Vec<Count>), DistError> {
    let counts = counts
        .iter()
        .map(|&c| mpi_count(op, c))
        .collect::<Result<Vec<_>, _>>()?;
    let mut displs = Vec::with_capacity(counts.len());
    let mut at: usize = 0;
    for &c in &counts {
        displs.push(mpi_count(op, at)?);
        at += c as usize;
    }
    Ok((counts, displs))
}

/// A non-blocking collective: owns its buffers until MPI is done with them.
struct MpiPending {
    /// `None` once completed.
    request: Option<Request<'static, [f32], StaticScope>>,
    /// The input, which MPI reads until completion.
    send: *mut [f32],
    /// The output, which MPI writes until completion.
    recv: *mut [f32],
}

impl MpiPending {
    /// Starts `start(send, recv)` on buffers that live (leaked) until [`Pending::wait`] or drop.
    fn start(
        send: Vec<f32>,
        recv_len: usize,
        start: impl FnOnce(&'static [f32], &'static mut [f32]) -> Request<'static, [f32], StaticScope>,
    ) -> MpiPending {
        let send = Box::into_raw(send.into_boxed_slice());
        let recv = Box::into_raw(vec![0f32; recv_len].into_boxed_slice());
        // SAFETY: both allocations are leaked here and reclaimed only in `finish`, after the
        // request completed, so the references handed to MPI stay valid (and `recv` unaliased)
        // for as long as MPI may touch them.
        let request = unsafe { start(&*send, &mut *recv) };
        MpiPending {
            request: Some(request),
            send,
            recv,
        }
    }

    /// Waits for the request (if still pending) and frees the input; returns the output.
    fn finish(&mut self) -> Vec<f32> {
        if let Some(r) = self.request.take() {
            r.wait_without_status();
        }
        // SAFETY: the request completed, so MPI holds neither buffer; each pointer came from
        // `Box::into_raw` and is turned back into a box exactly once (`request` is now None
        // and `finish` is only reached with it Some, see `Drop`).
        unsafe {
            drop(Box::from_raw(self.send));
            let out = Box::from_raw(self.recv).into_vec();
            self.send = std::ptr::slice_from_raw_parts_mut(std::ptr::null_mut(), 0);
            self.recv = std::ptr::slice_from_raw_parts_mut(std::ptr::null_mut(), 0);
            out
        }
    }
}

impl Pending for MpiPending {
    fn wait(mut self: Box<Self>) -> Result<Vec<f32>, DistError> {
        Ok(self.finish())
    }
}

impl Drop for MpiPending {
    fn drop(&mut self) {
        // Dropping unwaited must not free buffers MPI is still using.
        if self.request.is_some() {
            self.finish();
        }
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), DistError> {
        mpi_count("all_reduce_sum", buf.len())?;
        self.count(buf.len() * 4);
        let send = buf.to_vec();
        self.comm
            .all_reduce_into(&send[..], buf, SystemOperation::sum());
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DistError> {
        check_reduce_scatter(send.len(), recv.len(), self.size())?;
        mpi_count("reduce_scatter_sum", send.len())?;
        self.count(send.len() * 4);
        self.comm
            .reduce_scatter_block_into(send, recv, SystemOperation::sum());
        Ok(())
    }

    fn all_gather(&self, send: SendBuf<'_>, recv: RecvBuf<'_>) -> Result<(), DistError> {
        check_gather(&send, &recv, self.size())?;
        mpi_count("all_gather", recv.len())?;
        self.count(send.bytes());
        match (send, recv) {
            (SendBuf::F32(s), RecvBuf::F32(r)) => self.comm.all_gather_into(s, r),
            (SendBuf::U8(s), RecvBuf::U8(r)) => self.comm.all_gather_into(s, r),
            (SendBuf::I64(s), RecvBuf::I64(r)) => self.comm.all_gather_into(s, r),
            _ => unreachable!("check_gather compared the element types"),
        }
        Ok(())
    }

    fn all_to_all_v(
        &self,
        send: SendBuf<'_>,
        send_counts: &[usize],
        recv: RecvBuf<'_>,
        recv_counts: &[usize],
    ) -> Result<(), DistError> {
        const OP: &str = "all_to_all_v";
        check_all_to_all(&send, send_counts, &recv, recv_counts, self.size())?;
        let (sc, sd) = partition(OP, send_counts)?;
        let (rc, rd) = partition(OP, recv_counts)?;
        self.count(send.bytes());
        match (send, recv) {
            (SendBuf::F32(s), RecvBuf::F32(r)) => self.comm.all_to_all_varcount_into(
                &Partition::new(s, &sc[..], &sd[..]),
                &mut PartitionMut::new(r, &rc[..], &rd[..]),
            ),
            (SendBuf::U8(s), RecvBuf::U8(r)) => self.comm.all_to_all_varcount_into(
                &Partition::new(s, &sc[..], &sd[..]),
                &mut PartitionMut::new(r, &rc[..], &rd[..]),
            ),
            (SendBuf::I64(s), RecvBuf::I64(r)) => self.comm.all_to_all_varcount_into(
                &Partition::new(s, &sc[..], &sd[..]),
                &mut PartitionMut::new(r, &rc[..], &rd[..]),
            ),
            _ => unreachable!("check_all_to_all compared the element types"),
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError> {
        check_rank("broadcast", root, self.size())?;
        mpi_count("broadcast", buf.len())?;
        if self.rank() == root {
            self.count(buf.len());
        }
        self.comm
            .process_at_rank(root as mpi::Rank)
            .broadcast_into(buf);
        Ok(())
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.comm.barrier();
        Ok(())
    }

    fn send(&self, buf: SendBuf<'_>, dest: usize, tag: u16) -> Result<(), DistError> {
        check_rank("send", dest, self.size())?;
        mpi_count("send", buf.len())?;
        self.count(buf.bytes());
        let p = self.comm.process_at_rank(dest as mpi::Rank);
        let tag = mpi::Tag::from(tag);
        match buf {
            SendBuf::F32(b) => p.send_with_tag(b, tag),
            SendBuf::U8(b) => p.send_with_tag(b, tag),
            SendBuf::I64(b) => p.send_with_tag(b, tag),
        }
        Ok(())
    }

    fn recv(&self, buf: RecvBuf<'_>, src: usize, tag: u16) -> Result<(), DistError> {
        check_rank("recv", src, self.size())?;
        let want = mpi_count("recv", buf.len())?;
        let p = self.comm.process_at_rank(src as mpi::Rank);
        let tag = mpi::Tag::from(tag);
        let got = match buf {
            RecvBuf::F32(b) => p
                .receive_into_with_tag(b, tag)
                .count(f32::equivalent_datatype()),
            RecvBuf::U8(b) => p
                .receive_into_with_tag(b, tag)
                .count(u8::equivalent_datatype()),
            RecvBuf::I64(b) => p
                .receive_into_with_tag(b, tag)
                .count(i64::equivalent_datatype()),
        };
        if got != want {
            return Err(DistError::Size {
                op: "recv",
                what: "message",
                expected: want as usize,
                got: got.max(0) as usize,
            });
        }
        Ok(())
    }

    fn isend(&self, buf: Vec<f32>, dest: usize, tag: u16) -> Result<Box<dyn Pending>, DistError> {
        check_rank("isend", dest, self.size())?;
        mpi_count("isend", buf.len())?;
        self.count(buf.len() * 4);
        let p = self.comm.process_at_rank(dest as mpi::Rank);
        let tag = mpi::Tag::from(tag);
        Ok(Box::new(MpiPending::start(buf, 0, |s, _| {
            p.immediate_send_with_tag(StaticScope, s, tag)
        })))
    }

    fn iall_reduce_sum(&self, buf: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        mpi_count("iall_reduce_sum", buf.len())?;
        self.count(buf.len() * 4);
        let n = buf.len();
        Ok(Box::new(MpiPending::start(buf, n, |s, r| {
            self.comm
                .immediate_all_reduce_into(StaticScope, s, r, SystemOperation::sum())
        })))
    }

    fn ireduce_scatter_sum(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        let size = self.size();
        if !send.len().is_multiple_of(size) {
            return Err(DistError::Size {
                op: "ireduce_scatter_sum",
                what: "send buffer (a multiple of the communicator size)",
                expected: send.len().div_ceil(size) * size,
                got: send.len(),
            });
        }
        mpi_count("ireduce_scatter_sum", send.len())?;
        self.count(send.len() * 4);
        let n = send.len() / size;
        Ok(Box::new(MpiPending::start(send, n, |s, r| {
            self.comm
                .immediate_reduce_scatter_block_into(StaticScope, s, r, SystemOperation::sum())
        })))
    }

    fn iall_gather(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        let n = send.len() * self.size();
        mpi_count("iall_gather", n)?;
        self.count(send.len() * 4);
        Ok(Box::new(MpiPending::start(send, n, |s, r| {
            self.comm.immediate_all_gather_into(StaticScope, s, r)
        })))
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Collective>, DistError> {
        let color = i32::try_from(color)
            .map_err(|_| DistError::TooLarge {
                op: "split (color)",
                count: color as usize,
            })
            .map(Color::with_value)?;
        let key = i32::try_from(key).map_err(|_| DistError::TooLarge {
            op: "split (key)",
            count: key as usize,
        })?;
        let comm = self
            .comm
            .split_by_color_with_key(color, key)
            .ok_or_else(|| DistError::Init("split returned no communicator".into()))?;
        Ok(Box::new(Mpi {
            comm,
            universe: self.universe.clone(),
            bytes: self.bytes.clone(),
        }))
    }

    fn comm_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}
