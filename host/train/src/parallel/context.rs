//! Context parallelism's ring: the [`KvRing`] that ring attention passes key/value blocks
//! around, over the `cp` communicator of the mesh.

use super::nccl_groups;
use anneal_dist::{Collective, RecvBuf, SendBuf};
use anneal_engine::ops::KvRing;
use anneal_engine::{Error, Result, Tensor};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

/// The tag of ring passes (point-to-point messages between the ranks of one `cp` group).
const RING_TAG: u16 = 0x5243;

thread_local! {
    /// The `cp` communicator of the step running on this thread (MPI is called from the
    /// training thread only, so the communicator stays here; the ring handle the autograd
    /// graph keeps only names it).
    static RING: RefCell<Option<Rc<dyn Collective>>> = const { RefCell::new(None) };
    /// Bytes this thread's ring passes have sent since [`take_ring_bytes`] last ran.
    static SENT: Cell<u64> = const { Cell::new(0) };
}

/// Bytes the ring passes of this thread sent since the last call (the `cp_ring_bytes` metric:
/// context parallelism's traffic, to set beside its theory).
pub(crate) fn take_ring_bytes() -> u64 {
    SENT.with(|s| s.replace(0))
}

/// Rank `r` of a `cp` group sends to `r + 1` and receives from `r − 1` (mod the group size),
/// over the communicator [`RankRing::activate`] installed on this thread.
pub struct RankRing {
    size: usize,
}

/// Keeps a ring's communicator installed on this thread until dropped.
pub struct ActiveRing(());

impl Drop for ActiveRing {
    fn drop(&mut self) {
        RING.with(|r| r.borrow_mut().take());
    }
}

impl RankRing {
    /// Installs `comm` (the `cp` group, in rank order) on this thread and returns the guard
    /// that removes it and the ring handle for [`anneal_engine::ops::ring_attention`].
    pub fn activate(comm: Box<dyn Collective>) -> (ActiveRing, Arc<dyn KvRing>) {
        let size = comm.size();
        RING.with(|r| *r.borrow_mut() = Some(Rc::from(comm)));
        (ActiveRing(()), Arc::new(RankRing { size }))
    }
}

fn ring_err(what: impl std::fmt::Display) -> Error {
    Error::Invalid {
        op: "ring_attention",
        msg: format!("context-parallel ring: {what}"),
    }
}

impl KvRing for RankRing {
    fn size(&self) -> usize {
        self.size
    }

    /// Blocking sends and receives, even ranks sending first and odd ranks receiving first,
    /// so the ring never waits on itself (for an odd size, the two neighbouring even ranks
    /// serialise: one finishes sending before it receives). MPI keeps the messages between
    /// two ranks in order, so the tensors arrive in the order they were sent.
    fn pass(&self, blocks: &[Tensor]) -> Result<Vec<Tensor>> {
        let comm = RING
            .with(|r| r.borrow().clone())
            .ok_or_else(|| ring_err("no ring is active on this thread"))?;
        let (r, n) = (comm.rank(), comm.size());
        if n != self.size {
            return Err(ring_err(format!(
                "the active ring has {n} ranks, this handle {}",
                self.size
            )));
        }
        if n == 1 {
            return Ok(blocks.to_vec());
        }
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        // Blocks on the GPU of an installed `cp` NCCL communicator pass device to device, in
        // one group; the rest (positions on the host) over MPI below. Every rank holds the same
        // kinds of blocks, so both sides split them alike.
        let mut got: Vec<Option<Tensor>> = vec![None; blocks.len()];
        let nccl = blocks
            .iter()
            .find_map(|t| nccl_groups::comm_for(nccl_groups::Group::Cp, t));
        let on_device: Vec<usize> = match nccl {
            Some(nccl) => {
                let idx: Vec<usize> = (0..blocks.len())
                    .filter(|&i| {
                        nccl_groups::comm_for(nccl_groups::Group::Cp, &blocks[i]).is_some()
                    })
                    .collect();
                let moved: Vec<Tensor> = idx.iter().map(|&i| blocks[i].clone()).collect();
                let arrived = nccl_groups::ring_pass(&nccl, &moved, next, prev)?;
                for (&i, t) in idx.iter().zip(arrived) {
                    SENT.with(|s| s.set(s.get() + (t.numel() * t.dtype().size_in_bytes()) as u64));
                    got[i] = Some(t);
                }
                idx
            }
            None => Vec::new(),
        };
        let blocks: Vec<Tensor> = (0..blocks.len())
            .filter(|i| !on_device.contains(i))
            .map(|i| blocks[i].clone())
            .collect();
        let blocks = &blocks[..];
        let send = || -> Result<()> {
            for t in blocks {
                let bytes = anneal_engine::staged::to_host_bytes(t);
                comm.send(SendBuf::U8(&bytes), next, RING_TAG)
                    .map_err(ring_err)?;
                SENT.with(|s| s.set(s.get() + bytes.len() as u64));
            }
            Ok(())
        };
        let recv = || -> Result<Vec<Tensor>> {
            blocks
                .iter()
                .map(|t| {
                    let mut bytes = vec![0u8; t.numel() * t.dtype().size_in_bytes()];
                    comm.recv(RecvBuf::U8(&mut bytes), prev, RING_TAG)
                        .map_err(ring_err)?;
                    // Each block lands where the one it stands for lives (keys on the GPU,
                    // positions on the host).
                    anneal_engine::staged::from_host_bytes(&bytes, t.dtype(), t.shape(), t.device())
                })
                .collect()
        };
        let host = if r % 2 == 0 {
            send()?;
            recv()?
        } else {
            let got = recv()?;
            send()?;
            got
        };
        // Back in the blocks' order.
        let mut host = host.into_iter();
        got.into_iter()
            .map(|t| match t {
                Some(t) => Ok(t),
                None => host
                    .next()
                    .ok_or_else(|| ring_err("fewer blocks came back than were sent")),
            })
            .collect()
    }
}
