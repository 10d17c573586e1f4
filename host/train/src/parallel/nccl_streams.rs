//! Ordering an NCCL communicator's calls against the engine's compute stream by events (no host
//! synchronisation) when the communicator queues on the engine's communication stream, or by
//! synchronising both sides when it has a stream of its own.

use crate::TrainError;
use anneal_dist::nccl::Nccl;
use anneal_engine::streams::{self, Stream, StreamEvent};
use anneal_engine::{Device, Tensor};

/// Calls on `nccl` ordered after the compute stream's work so far; see [`comm_ordered`].
pub(super) struct CommOrdered<'a> {
    nccl: &'a Nccl,
    device: Device,
    /// Whether `nccl` queues on the engine's communication stream (events order it).
    on_comm: bool,
}

/// Prepares calls on `nccl` over buffers that compute wrote: on the engine's communication
/// stream, that stream waits for an event recorded on the compute stream now; on any other
/// stream, the host waits for the compute stream.
pub(super) fn comm_ordered(nccl: &Nccl, device: Device) -> Result<CommOrdered<'_>, TrainError> {
    let comm = anneal_engine::cuda::comm_stream(nccl.device())?;
    let on_comm = comm.cu_stream() == nccl.stream().cu_stream();
    if on_comm {
        StreamEvent::record(device, Stream::Compute)?.wait(Stream::Comm)?;
    } else {
        anneal_engine::synchronize(device)?;
    }
    Ok(CommOrdered {
        nccl,
        device,
        on_comm,
    })
}

impl CommOrdered<'_> {
    /// Keeps `t`'s block from compute work until the collectives queued so far have run
    /// (nothing to do when the host waits for them in [`CommOrdered::done`]).
    pub(super) fn record(&self, t: &Tensor) -> Result<(), TrainError> {
        if self.on_comm {
            streams::record_stream(t, Stream::Comm)?;
        }
        Ok(())
    }

    /// Makes compute wait for the calls queued on `nccl` so far: an event on the communication
    /// stream, or the host waits for `nccl`'s own stream.
    pub(super) fn done(self) -> Result<(), TrainError> {
        if self.on_comm {
            StreamEvent::record(self.device, Stream::Comm)?.wait(Stream::Compute)?;
        } else {
            self.nccl.synchronize()?;
        }
        Ok(())
    }
}
