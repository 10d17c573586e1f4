//! [`Collective`] over an MPI communicator, through the `mpi` crate (rsmpi). Sums do not use
//! MPI's reductions, whose order depends on the implementation, the message size and the
//! communicator: a reduce-scatter is an all-to-all of the blocks, each rank summing the
//! contributions to its block in [`rank_order_sum`]'s order (the same bytes on the wire as a
//! pairwise-exchange reduce-scatter), and an all-reduce is that plus an all-gather. rsmpi aborts the job
//! on an MPI error (MPI's default handler), so every length and rank is checked here first and
//! returned as a [`DistError`].

use crate::{
    check_all_to_all, check_gather, check_rank, check_reduce_scatter, message_hash, rank_order_sum,
    Collective, DistError, JobFailure, Pending, RecvBuf, SendBuf,
};
use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Count;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An MPI communicator: the world of a job started by `mpiexec`, or a sub-communicator
/// ([`Collective::split`]) of it.
pub struct Mpi {
    // Field order is drop order: the communicator is freed before the last handle on the
    // universe finalizes MPI.
    comm: SimpleCommunicator,
    /// The world's own duplicate, used only to agree on failing ([`Collective::fail_together`]):
    /// on a communicator of its own, the agreement never meets a rank that still waits in a
    /// collective of the job's. `None` on the communicators split from the world.
    failures: Option<SimpleCommunicator>,
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
            failures: Some(universe.world().duplicate()),
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

/// A non-blocking all-to-all of `rows` contributions whose rank-order sum is the result.
struct OrderedSum {
    exchange: MpiPending,
    rows: usize,
    /// The result's length (the rest is padding or other ranks' rows).
    len: usize,
}

impl Pending for OrderedSum {
    fn wait(mut self: Box<Self>) -> Result<Vec<f32>, DistError> {
        let mut all = self.exchange.finish();
        rank_order_sum(&mut all, self.rows);
        all.truncate(self.len);
        Ok(all)
    }
}

impl Mpi {
    /// Block `rank()` of the rank-order sum of `send` (`size()` blocks): every rank sends each
    /// block to its owner, which sums what it received.
    fn ordered_reduce_scatter(&self, send: &[f32], recv: &mut [f32]) {
        let mut all = vec![0f32; send.len()];
        self.comm.all_to_all_into(send, &mut all[..]);
        rank_order_sum(&mut all, self.size());
        recv.copy_from_slice(&all[..recv.len()]);
    }
}

/// The partitioned buffers of a variable all-to-all in flight.
type Parts = (Vec<Count>, Vec<Count>);
type SendPart = Partition<'static, [f32], Vec<Count>, Vec<Count>>;
type RecvPart = PartitionMut<'static, [f32], Vec<Count>, Vec<Count>>;

/// A variable all-to-all in flight (`MPI_Ialltoallv`): like [`MpiPending`], the buffers and
/// the count and displacement arrays MPI reads until completion are boxed and leaked until
/// the request completes, then freed.
struct MpiVPending {
    request: Option<Request<'static, RecvPart, StaticScope>>,
    send: *mut SendPart,
    send_buf: *mut [f32],
    recv: *mut RecvPart,
    recv_buf: *mut [f32],
}

impl MpiVPending {
    /// Starts the exchange of `send` on `comm` (counts and displacements already checked).
    fn start(
        comm: &SimpleCommunicator,
        send: Vec<f32>,
        recv: Vec<f32>,
        sp: Parts,
        rp: Parts,
    ) -> MpiVPending {
        let send_buf = Box::into_raw(send.into_boxed_slice());
        let recv_buf = Box::into_raw(recv.into_boxed_slice());
        // SAFETY: the buffers and partitions live (leaked) until `finish` waits for the request
        // and only then frees them; nothing else touches them meanwhile.
        unsafe {
            let send = Box::into_raw(Box::new(Partition::new(&*send_buf, sp.0, sp.1)));
            let recv = Box::into_raw(Box::new(PartitionMut::new(&mut *recv_buf, rp.0, rp.1)));
            let request = comm.immediate_all_to_all_varcount_into(StaticScope, &*send, &mut *recv);
            MpiVPending {
                request: Some(request),
                send,
                send_buf,
                recv,
                recv_buf,
            }
        }
    }

    fn finish(&mut self) -> Vec<f32> {
        if let Some(r) = self.request.take() {
            r.wait_without_status();
        }
        // SAFETY: the request completed (or never started), so MPI no longer reads or writes
        // the buffers; each pointer came from `Box::into_raw` and is freed exactly once.
        unsafe {
            drop(Box::from_raw(self.send));
            drop(Box::from_raw(self.recv));
            drop(Box::from_raw(self.send_buf));
            let out = Box::from_raw(self.recv_buf).into_vec();
            self.send_buf = std::ptr::slice_from_raw_parts_mut(std::ptr::null_mut(), 0);
            self.recv_buf = std::ptr::slice_from_raw_parts_mut(std::ptr::null_mut(), 0);
            self.send = std::ptr::null_mut();
            self.recv = std::ptr::null_mut();
            out
        }
    }
}

impl Pending for MpiVPending {
    fn wait(mut self: Box<Self>) -> Result<Vec<f32>, DistError> {
        Ok(self.finish())
    }
}

impl Drop for MpiVPending {
    fn drop(&mut self) {
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
        let size = self.size();
        let block = buf.len().div_ceil(size);
        mpi_count("all_reduce_sum", block * size)?;
        self.count(buf.len() * 4);
        let mut padded = buf.to_vec();
        padded.resize(block * size, 0.0);
        let mut mine = vec![0f32; block];
        self.ordered_reduce_scatter(&padded, &mut mine);
        self.comm.all_gather_into(&mine[..], &mut padded[..]);
        buf.copy_from_slice(&padded[..buf.len()]);
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DistError> {
        check_reduce_scatter(send.len(), recv.len(), self.size())?;
        mpi_count("reduce_scatter_sum", send.len())?;
        self.count(send.len() * 4);
        self.ordered_reduce_scatter(send, recv);
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

    /// Non-blocking, so it cannot chain a reduce-scatter into an all-gather: every rank gathers
    /// every rank's whole buffer and sums it locally (`size()` times the bytes of
    /// [`Collective::all_reduce_sum`]; for small buffers such as flags and statistics).
    fn iall_reduce_sum(&self, buf: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        let (len, rows) = (buf.len(), self.size());
        mpi_count("iall_reduce_sum", len * rows)?;
        self.count(len * 4);
        let exchange = MpiPending::start(buf, len * rows, |s, r| {
            self.comm.immediate_all_gather_into(StaticScope, s, r)
        });
        Ok(Box::new(OrderedSum {
            exchange,
            rows,
            len,
        }))
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
        let (all, len) = (send.len(), send.len() / size);
        let exchange = MpiPending::start(send, all, |s, r| {
            self.comm.immediate_all_to_all_into(StaticScope, s, r)
        });
        Ok(Box::new(OrderedSum {
            exchange,
            rows: size,
            len,
        }))
    }

    fn iall_gather(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError> {
        let n = send.len() * self.size();
        mpi_count("iall_gather", n)?;
        self.count(send.len() * 4);
        Ok(Box::new(MpiPending::start(send, n, |s, r| {
            self.comm.immediate_all_gather_into(StaticScope, s, r)
        })))
    }

    fn iall_to_all_v(
        &self,
        send: Vec<f32>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Box<dyn Pending>, DistError> {
        const OP: &str = "iall_to_all_v";
        let mut recv = vec![0f32; recv_counts.iter().sum()];
        check_all_to_all(
            &(&send[..]).into(),
            send_counts,
            &(&mut recv[..]).into(),
            recv_counts,
            self.size(),
        )?;
        let sp = partition(OP, send_counts)?;
        let rp = partition(OP, recv_counts)?;
        self.count(send.len() * 4);
        Ok(Box::new(MpiVPending::start(&self.comm, send, recv, sp, rp)))
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
            failures: None,
            universe: self.universe.clone(),
            bytes: self.bytes.clone(),
        }))
    }

    fn fail_together(&self, code: i32, message: &str, wait: Duration) -> Option<JobFailure> {
        let comm = self.failures.as_ref()?;
        // One MAX reduction carries the worst code and both the largest and the smallest
        // message hash (the latter negated): equal extremes mean every rank failed alike.
        let hash = i64::from(message_hash(message));
        let send: &'static [i64] = Box::leak(Box::new([i64::from(code), hash, -hash]));
        let recv: &'static mut [i64] = Box::leak(Box::new([0i64; 3]));
        let recv_ptr: *const [i64] = &*recv;
        let mut request =
            comm.immediate_all_reduce_into(StaticScope, send, recv, SystemOperation::max());
        let deadline = Instant::now() + wait;
        loop {
            match request.test() {
                Ok(_) => break,
                Err(pending) if Instant::now() < deadline => {
                    request = pending;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(pending) => {
                    // Some rank never came: its peers still run or wait. The request (and its
                    // leaked buffers) stay with MPI until the process exits.
                    std::mem::forget(pending);
                    return None;
                }
            }
        }
        // SAFETY: the request completed, so MPI no longer writes the (leaked, never freed) buffer.
        let [worst, max_hash, neg_min_hash]: [i64; 3] = unsafe { &*recv_ptr }.try_into().ok()?;
        // Every rank is here, so finalising completes on all of them; a rank that exits
        // finalised is not taken for a crash, and the launcher reports the code, not a kill.
        // SAFETY: called once, from the thread that initialised MPI; the process exits next
        // without running the universe's destructor (which would finalise a second time).
        unsafe {
            mpi::ffi::MPI_Finalize();
        }
        Some(JobFailure {
            code: i32::try_from(worst).unwrap_or(1),
            same_message: max_hash == -neg_min_hash,
        })
    }

    fn comm_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}
