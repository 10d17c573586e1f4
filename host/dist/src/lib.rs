//! Collectives between the processes of one training job, and the device mesh that lays the
//! job's ranks out along its parallel dimensions.
//!
//! ```text
//! lib.rs      the `Collective` trait, its buffers and errors, `init` (MPI only under a launcher)
//! launch.rs   the `mpiexec` command line for N ranks on this machine (`anneal train --nproc`)
//! mpi.rs      `Mpi`: the trait over an MPI communicator (the `mpi` crate; MPICH or Open MPI)
//! nccl.rs     `Nccl`: the trait over an NCCL communicator between GPUs (cudarc, loaded at run
//!             time), bootstrapped over another communicator (feature `nccl`, on by default);
//!             nccl/device.rs: its entry points over raw device buffers
//! single.rs   `Single`: world size 1, so a plain process needs no MPI at run time
//! shard.rs    `Dim0Shard`: a rank's rows of a tensor sharded on dim 0 (FSDP's layout), and
//!             the padded gathers and reduce-scatters that move them
//! mesh.rs     `Mesh`: degrees per dimension (dp_replicate, dp_shard, tp, pp, cp, ep), a rank's
//!             coordinates, and one sub-communicator per dimension
//! ```
//! Reductions are sums in f32 whatever the parameter dtype (gradients are reduced in f32), in
//! one fixed order ([`rank_order_sum`]): pairwise over the ranks, so that summing over a group
//! of `2^k` consecutive ranks and then over the groups gives the same bits as summing over all
//! of them at once (HSDP's two-level gradient sum equals DDP's and FSDP's). The element types are explicit ([`SendBuf`], [`RecvBuf`]: f32, u8, i64) so that a device-buffer
//! implementation (NCCL) can add its own variants without changing the trait's shape.

pub mod launch;
mod mesh;
mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod shard;
mod single;

pub use crate::mpi::Mpi;
pub use mesh::{ExpertComms, Mesh, MeshDim, MeshError, MESH_KEYS};
pub use shard::Dim0Shard;
pub use single::Single;

/// Sums `rows` equal-length rows of `buf` (row `i` is rank `i`'s contribution) into row 0,
/// pairwise in rank order: the sum over ranks `lo..hi` is the sum over `lo..mid` plus the sum
/// over `mid..hi`, where `mid - lo` is the largest power of two below `hi - lo`. Every split
/// falls on a multiple of each power of two that fits, so for a group size `g = 2^k` the
/// sum over `n` ranks equals the sum over `n / g` consecutive groups of their own sums, bit for
/// bit: the reduction's result does not depend on how the mesh nests the ranks. (MPI's own
/// reductions pick an order by message size and communicator, so three ranks' sum of sums and
/// four ranks' one sum would round differently.) The other rows are overwritten.
pub fn rank_order_sum(buf: &mut [f32], rows: usize) {
    if rows <= 1 {
        return;
    }
    let n = buf.len() / rows;
    fn sum(buf: &mut [f32], n: usize, lo: usize, hi: usize) {
        if hi - lo <= 1 {
            return;
        }
        let mid = lo + (hi - lo).next_power_of_two() / 2;
        sum(buf, n, lo, mid);
        sum(buf, n, mid, hi);
        let (head, tail) = buf.split_at_mut(mid * n);
        for (a, b) in head[lo * n..(lo + 1) * n].iter_mut().zip(&tail[..n]) {
            *a += *b;
        }
    }
    sum(buf, n, 0, rows);
}

/// Why a collective could not run.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A buffer's length does not fit the operation.
    #[error("{op}: {what}: expected {expected} elements, got {got}")]
    Size {
        /// The collective.
        op: &'static str,
        /// Which buffer or count.
        what: &'static str,
        /// What the operation needs.
        expected: usize,
        /// What was passed.
        got: usize,
    },
    /// The send and receive buffers hold different element types.
    #[error("{op}: the send buffer holds {send} and the receive buffer {recv}")]
    TypeMismatch {
        /// The collective.
        op: &'static str,
        /// The send buffer's element type.
        send: &'static str,
        /// The receive buffer's element type.
        recv: &'static str,
    },
    /// A rank outside the communicator.
    #[error("{op}: rank {rank} is outside the communicator of size {size}")]
    Rank {
        /// The operation.
        op: &'static str,
        /// The rank named.
        rank: usize,
        /// The communicator's size.
        size: usize,
    },
    /// A count too large for MPI's 32-bit counts.
    #[error("{op}: {count} elements exceed MPI's 32-bit counts")]
    TooLarge {
        /// The collective.
        op: &'static str,
        /// The count.
        count: usize,
    },
    /// A receive found no matching message (world size 1 queues its sends).
    #[error("recv from rank {src} with tag {tag}: no such message was sent")]
    NoMessage {
        /// The source rank.
        src: usize,
        /// The tag.
        tag: u16,
    },
    /// Replicas that must hold the same values do not.
    #[error("rank {rank}'s replica differs from rank 0's (digest {digest:016x} vs {root:016x})")]
    Diverged {
        /// The rank that differs.
        rank: usize,
        /// Its digest.
        digest: u64,
        /// Rank 0's digest.
        root: u64,
    },
    /// Another rank failed in work it did while this one waited for it (its error is reported
    /// by that rank).
    #[error("rank {rank} failed (its error is reported above)")]
    PeerFailed {
        /// The rank that failed.
        rank: usize,
    },
    /// MPI could not be initialised (or was already).
    #[error("MPI: {0}")]
    Init(String),
    /// The transport's libraries or devices are not on this machine (what is missing).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The transport failed (NCCL or CUDA error).
    #[error("{0}")]
    Backend(String),
}

/// A send buffer of one of the element types the collectives move.
#[derive(Clone, Copy, Debug)]
pub enum SendBuf<'a> {
    /// 32-bit floats (activations, gradients, parameters).
    F32(&'a [f32]),
    /// Bytes (anything serialized; bf16 travels as bytes too).
    U8(&'a [u8]),
    /// 64-bit integers (token ids, counts, sizes).
    I64(&'a [i64]),
}

/// A receive buffer of one of the element types the collectives move.
#[derive(Debug)]
pub enum RecvBuf<'a> {
    /// 32-bit floats.
    F32(&'a mut [f32]),
    /// Bytes.
    U8(&'a mut [u8]),
    /// 64-bit integers.
    I64(&'a mut [i64]),
}

impl SendBuf<'_> {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        match self {
            SendBuf::F32(b) => b.len(),
            SendBuf::U8(b) => b.len(),
            SendBuf::I64(b) => b.len(),
        }
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes in the buffer (what [`Collective::comm_bytes`] counts).
    pub fn bytes(&self) -> usize {
        self.len() * self.elem_size()
    }

    fn elem_size(&self) -> usize {
        match self {
            SendBuf::F32(_) => 4,
            SendBuf::U8(_) => 1,
            SendBuf::I64(_) => 8,
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            SendBuf::F32(_) => "f32",
            SendBuf::U8(_) => "u8",
            SendBuf::I64(_) => "i64",
        }
    }
}

impl RecvBuf<'_> {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        match self {
            RecvBuf::F32(b) => b.len(),
            RecvBuf::U8(b) => b.len(),
            RecvBuf::I64(b) => b.len(),
        }
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn type_name(&self) -> &'static str {
        match self {
            RecvBuf::F32(_) => "f32",
            RecvBuf::U8(_) => "u8",
            RecvBuf::I64(_) => "i64",
        }
    }
}

impl<'a> From<&'a [f32]> for SendBuf<'a> {
    fn from(b: &'a [f32]) -> Self {
        SendBuf::F32(b)
    }
}
impl<'a> From<&'a [u8]> for SendBuf<'a> {
    fn from(b: &'a [u8]) -> Self {
        SendBuf::U8(b)
    }
}
impl<'a> From<&'a [i64]> for SendBuf<'a> {
    fn from(b: &'a [i64]) -> Self {
        SendBuf::I64(b)
    }
}
impl<'a> From<&'a mut [f32]> for RecvBuf<'a> {
    fn from(b: &'a mut [f32]) -> Self {
        RecvBuf::F32(b)
    }
}
impl<'a> From<&'a mut [u8]> for RecvBuf<'a> {
    fn from(b: &'a mut [u8]) -> Self {
        RecvBuf::U8(b)
    }
}
impl<'a> From<&'a mut [i64]> for RecvBuf<'a> {
    fn from(b: &'a mut [i64]) -> Self {
        RecvBuf::I64(b)
    }
}

/// A non-blocking collective in flight; [`Pending::wait`] completes it and returns its result
/// (dropping it unwaited also waits, so its buffers are never freed under the transport).
pub trait Pending {
    /// Blocks until the operation completes and returns the received values.
    fn wait(self: Box<Self>) -> Result<Vec<f32>, DistError>;
}

/// A send that completed when it was started.
struct Sent;

impl Pending for Sent {
    fn wait(self: Box<Self>) -> Result<Vec<f32>, DistError> {
        Ok(Vec::new())
    }
}

/// The collectives of one communicator. Every rank of the communicator must call the same
/// collectives in the same order (as with MPI); point-to-point `send`/`recv` pair up by rank
/// and tag.
pub trait Collective {
    /// This process's rank in the communicator, `0..size()`.
    fn rank(&self) -> usize;

    /// Processes in the communicator.
    fn size(&self) -> usize;

    /// Sums `buf` element-wise over all ranks, in place; every rank gets the sum. Over MPI
    /// (and trivially in a single process) the sum is [`rank_order_sum`]'s, so it does not
    /// depend on how the ranks are grouped; NCCL sums in its own order.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), DistError>;

    /// Sums `send` (length `size() × recv.len()`) over all ranks and leaves block `rank()` of
    /// the sum in `recv`, summed in [`rank_order_sum`]'s order as [`Collective::all_reduce_sum`].
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DistError>;

    /// Concatenates every rank's `send` (all the same length) in rank order into `recv`.
    fn all_gather(&self, send: SendBuf<'_>, recv: RecvBuf<'_>) -> Result<(), DistError>;

    /// Sends `send_counts[r]` consecutive elements of `send` to rank `r` and receives
    /// `recv_counts[r]` elements from rank `r`, packed in rank order into `recv`.
    fn all_to_all_v(
        &self,
        send: SendBuf<'_>,
        send_counts: &[usize],
        recv: RecvBuf<'_>,
        recv_counts: &[usize],
    ) -> Result<(), DistError>;

    /// Copies `root`'s `buf` into every rank's `buf` (all the same length).
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), DistError>;

    /// Sends `buf` to rank `dest` with `tag` (blocking until the buffer may be reused).
    fn send(&self, buf: SendBuf<'_>, dest: usize, tag: u16) -> Result<(), DistError>;

    /// Receives exactly `buf.len()` elements from rank `src` with `tag`.
    fn recv(&self, buf: RecvBuf<'_>, src: usize, tag: u16) -> Result<(), DistError>;

    /// Starts sending `buf` to rank `dest` with `tag`; the handle's wait returns nothing once
    /// `buf` was handed over. A pipeline stage sends this way so that two neighbours sending to
    /// each other at once never both block. The default sends at once (blocking): transports
    /// whose sends never wait for the receiver (one process) need nothing more.
    fn isend(&self, buf: Vec<f32>, dest: usize, tag: u16) -> Result<Box<dyn Pending>, DistError> {
        self.send((&buf[..]).into(), dest, tag)?;
        Ok(Box::new(Sent))
    }

    /// Starts [`Collective::all_reduce_sum`] of `buf`; the handle returns the sum.
    fn iall_reduce_sum(&self, buf: Vec<f32>) -> Result<Box<dyn Pending>, DistError>;

    /// Starts [`Collective::reduce_scatter_sum`] of `send`; the handle returns this rank's
    /// block of the sum.
    fn ireduce_scatter_sum(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError>;

    /// Starts [`Collective::all_gather`] of `send`; the handle returns the concatenation.
    fn iall_gather(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, DistError>;

    /// Starts [`Collective::all_to_all_v`] of f32 `send`; the handle returns what arrived,
    /// packed in rank order (`recv_counts` elements from each rank). The default completes it
    /// before returning: a transport without a non-blocking form still gives the right values.
    fn iall_to_all_v(
        &self,
        send: Vec<f32>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Box<dyn Pending>, DistError> {
        let mut recv = vec![0f32; recv_counts.iter().sum()];
        self.all_to_all_v(
            (&send[..]).into(),
            send_counts,
            (&mut recv[..]).into(),
            recv_counts,
        )?;
        Ok(Box::new(single::Done(recv)))
    }

    /// A new communicator of the ranks that pass the same `color`, ordered by `key` (then by
    /// rank): how the mesh builds one communicator per dimension. Collective: every rank calls it.
    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Collective>, DistError>;

    /// Bytes of the send buffers this rank has handed to collectives and sends so far (an
    /// all-reduce counts its buffer once): a counter to take differences of, per step.
    fn comm_bytes(&self) -> u64;

    /// Called by a rank whose job failed with exit `code` and `message`, on the world. When
    /// every rank calls it within `wait` (a failure they all met, as a bad layout), shuts the
    /// transport down cleanly and returns what they agreed on, so that all can exit with one
    /// code (a launcher stops the other ranks of a rank that exits unannounced, and reports the
    /// kill instead of the code). `None` when some rank did not come in time (the failure is
    /// this rank's alone) or the transport cannot agree: the rank then exits unannounced, which
    /// stops the others.
    fn fail_together(
        &self,
        code: i32,
        message: &str,
        wait: std::time::Duration,
    ) -> Option<JobFailure> {
        let _ = (code, message, wait);
        None
    }
}

/// Shares the outcome of work rank 0 of `comm` did while the others waited for it (building
/// caches, checking a checkpoint): rank 0 passes its `result`, the others theirs (usually
/// `Ok` of nothing done). On the others a failure of rank 0 becomes
/// [`DistError::PeerFailed`], so every rank fails at once and the job can end with rank 0's
/// error and code (see [`Collective::fail_together`]) instead of leaving them waiting in a
/// collective until they are killed. Collective: every rank of `comm` calls it.
pub fn led_by_rank0<T, E: From<DistError>>(
    comm: &dyn Collective,
    result: Result<T, E>,
) -> Result<T, E> {
    if comm.size() == 1 {
        return result;
    }
    let mut ok = [u8::from(comm.rank() != 0 || result.is_ok())];
    comm.broadcast(&mut ok, 0)?;
    match (comm.rank(), ok[0]) {
        (0, _) | (_, 1) => result,
        _ => Err(DistError::PeerFailed { rank: 0 }.into()),
    }
}

/// What the ranks of a failed job agreed on ([`Collective::fail_together`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobFailure {
    /// The largest exit code of any rank.
    pub code: i32,
    /// Whether every rank failed with the same message (then one rank's report says it all).
    pub same_message: bool,
}

/// FNV-1a of `message`: equal on every rank for equal messages, whatever the platform.
fn message_hash(message: &str) -> u32 {
    message.bytes().fold(0x811c_9dc5, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// Whether an MPI launcher started this process: MPICH's Hydra sets `PMI_RANK`/`PMI_SIZE`,
/// Open MPI's `mpirun` sets `OMPI_COMM_WORLD_SIZE`, Slurm's `srun --mpi=pmix` sets
/// `PMIX_RANK`.
pub fn launched_by_mpi() -> bool {
    ["PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
}

/// The number of processes the launcher started, from its environment (`PMI_SIZE`,
/// `OMPI_COMM_WORLD_SIZE`, Slurm's `SLURM_STEP_NUM_TASKS`), without initialising MPI; `None`
/// outside a launcher.
pub fn launcher_world_size() -> Option<usize> {
    ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// The job's world: MPI's world communicator when a launcher started this process
/// ([`launched_by_mpi`]), otherwise [`Single`] (MPI is then never touched).
///
/// Under Slurm, `srun` tells each task how many tasks the step has; a step of several tasks in
/// which MPI does not see them (no `--mpi=pmi2`/`--mpi=pmix`) would otherwise train as that many
/// independent single-process runs over one run directory, so it is refused.
pub fn init() -> Result<Box<dyn Collective>, DistError> {
    let world: Box<dyn Collective> = if launched_by_mpi() {
        Box::new(Mpi::init()?)
    } else {
        Box::new(Single::new())
    };
    check_slurm_step(slurm_step_tasks(), world.size())?;
    Ok(world)
}

/// Tasks of the Slurm job step this process belongs to (`srun` sets `SLURM_STEP_NUM_TASKS`).
fn slurm_step_tasks() -> Option<usize> {
    std::env::var("SLURM_STEP_NUM_TASKS").ok()?.parse().ok()
}

/// Fails when `srun` started `tasks` > 1 tasks but the world holds fewer.
fn check_slurm_step(tasks: Option<usize>, world: usize) -> Result<(), DistError> {
    match tasks {
        Some(n) if n > 1 && world != n => Err(DistError::Init(format!(
            "srun started {n} tasks but MPI sees {world}: launch with `srun --mpi=pmi2` (MPICH) or `srun --mpi=pmix` (Open MPI) so the tasks join one job"
        ))),
        _ => Ok(()),
    }
}

/// Ends this process with `code` without finalising MPI. A launcher treats a rank that exits
/// without finalising (or with a non-zero code) as failed and stops every other rank, so a
/// failed rank never leaves the others waiting in a collective; unlike `MPI_Abort`, whatever
/// the rank printed reaches the launcher first (its pipes close only at exit).
pub fn abort_job(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::process::exit(code)
}

/// How many ranks of this job share this machine, from the launcher's environment (MPICH:
/// `MPI_LOCALNRANKS`, Open MPI: `OMPI_COMM_WORLD_LOCAL_SIZE`), or `None` when it does not say:
/// what divides the machine's cores between ranks.
pub fn local_ranks() -> Option<usize> {
    ["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
        .filter(|&n: &usize| n > 0)
}

/// This rank's index among the ranks of this job on this machine, from the launcher's
/// environment (MPICH: `MPI_LOCALRANKID`, Open MPI: `OMPI_COMM_WORLD_LOCAL_RANK`, Slurm:
/// `SLURM_LOCALID`), or `None` when it does not say: which GPU of the machine the rank takes.
pub fn local_rank() -> Option<usize> {
    [
        "MPI_LOCALRANKID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// Checks the lengths of an all-gather: `recv` holds `size` copies of `send`'s length, and
/// both have the same element type.
fn check_gather(send: &SendBuf<'_>, recv: &RecvBuf<'_>, size: usize) -> Result<(), DistError> {
    if send.type_name() != recv.type_name() {
        return Err(DistError::TypeMismatch {
            op: "all_gather",
            send: send.type_name(),
            recv: recv.type_name(),
        });
    }
    if recv.len() != send.len() * size {
        return Err(DistError::Size {
            op: "all_gather",
            what: "receive buffer",
            expected: send.len() * size,
            got: recv.len(),
        });
    }
    Ok(())
}

/// Checks an all-to-all's counts against the communicator size and the buffers.
fn check_all_to_all(
    send: &SendBuf<'_>,
    send_counts: &[usize],
    recv: &RecvBuf<'_>,
    recv_counts: &[usize],
    size: usize,
) -> Result<(), DistError> {
    const OP: &str = "all_to_all_v";
    if send.type_name() != recv.type_name() {
        return Err(DistError::TypeMismatch {
            op: OP,
            send: send.type_name(),
            recv: recv.type_name(),
        });
    }
    for (what, counts) in [
        ("send counts", send_counts),
        ("receive counts", recv_counts),
    ] {
        if counts.len() != size {
            return Err(DistError::Size {
                op: OP,
                what,
                expected: size,
                got: counts.len(),
            });
        }
    }
    for (what, counts, len) in [
        ("send buffer", send_counts, send.len()),
        ("receive buffer", recv_counts, recv.len()),
    ] {
        let total: usize = counts.iter().sum();
        if total != len {
            return Err(DistError::Size {
                op: OP,
                what,
                expected: total,
                got: len,
            });
        }
    }
    Ok(())
}

/// Checks that a reduce-scatter's input holds `size` blocks of the output's length.
fn check_reduce_scatter(send: usize, recv: usize, size: usize) -> Result<(), DistError> {
    if send != recv * size {
        return Err(DistError::Size {
            op: "reduce_scatter_sum",
            what: "send buffer",
            expected: recv * size,
            got: send,
        });
    }
    Ok(())
}

/// Checks that `rank` is in a communicator of `size`.
fn check_rank(op: &'static str, rank: usize, size: usize) -> Result<(), DistError> {
    if rank >= size {
        return Err(DistError::Rank { op, rank, size });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{check_slurm_step, rank_order_sum};

    /// Values whose f32 sum depends on the order they are added in.
    fn contributions(rows: usize, n: usize) -> Vec<f32> {
        (0..rows * n)
            .map(|i| {
                let x = (i as f32 * 0.618_034).fract() - 0.5;
                x * 10f32.powi((i % 9) as i32)
            })
            .collect()
    }

    #[test]
    fn the_rank_order_sum_is_pairwise() {
        let mut b = vec![1.0e8f32, 1.0, -1.0e8, 1.0];
        rank_order_sum(&mut b, 4);
        // (1e8 + 1) + (-1e8 + 1): each bracket rounds its 1 away.
        assert_eq!(b[0], 0.0);
        let mut b = vec![1.0e8f32, -1.0e8, 1.0];
        rank_order_sum(&mut b, 3);
        assert_eq!(b[0], 1.0, "(r0 + r1) + r2");
        let mut one = vec![3.5f32, 4.5];
        rank_order_sum(&mut one, 1);
        assert_eq!(one, [3.5, 4.5]);
    }

    #[test]
    fn summing_groups_of_a_power_of_two_then_the_groups_is_the_same_sum() {
        let n = 7;
        for (groups, g) in [(2, 2), (3, 2), (2, 4), (3, 4), (5, 2), (1, 8)] {
            let rows = groups * g;
            let all = contributions(rows, n);
            let mut flat = all.clone();
            rank_order_sum(&mut flat, rows);
            let mut partial = Vec::new();
            for grp in all.chunks(g * n) {
                let mut grp = grp.to_vec();
                rank_order_sum(&mut grp, g);
                partial.extend_from_slice(&grp[..n]);
            }
            rank_order_sum(&mut partial, groups);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&flat[..n]), bits(&partial[..n]), "{groups} x {g}");
        }
        // A sequential sum rounds otherwise: the order matters for these values.
        let all = contributions(8, n);
        let mut flat = all.clone();
        rank_order_sum(&mut flat, 8);
        let seq: Vec<f32> = (0..n)
            .map(|j| (0..8).fold(0.0f32, |acc, r| acc + all[r * n + j]))
            .collect();
        assert_ne!(flat[..n], seq[..]);
    }

    #[test]
    fn an_srun_step_that_mpi_does_not_see_is_refused() {
        assert!(check_slurm_step(None, 1).is_ok());
        assert!(check_slurm_step(Some(1), 1).is_ok());
        assert!(check_slurm_step(Some(4), 4).is_ok());
        let err = check_slurm_step(Some(4), 1).unwrap_err().to_string();
        assert!(err.contains("srun started 4 tasks but MPI sees 1"), "{err}");
        assert!(err.contains("--mpi=pmix"), "{err}");
    }
}
