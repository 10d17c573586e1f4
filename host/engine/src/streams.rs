//! Streams and events, device-agnostic: what a trainer uses to run communication beside
//! compute without knowing of CUDA. On the CPU everything here is a no-op (work runs when it is
//! called, so it is always ordered).
//!
//! On a GPU every device has two queues ([`Stream`]): `Compute`, where every op of the engine is
//! queued in program order, and `Comm`, for collectives (an NCCL communicator built on it,
//! `cuda::comm_stream`). The two run concurrently; nothing orders them but events:
//! - **Before** work on `Comm` reads or writes what compute produced, record a [`StreamEvent`]
//!   on `Compute` after the producing ops and make `Comm` [`StreamEvent::wait`] for it.
//! - **After** it, before compute reads the results (or rewrites the inputs), record an event on
//!   `Comm` after the collectives and make `Compute` wait for it. Host reads (`to_vec`) go
//!   through the compute stream, so this wait also orders them.
//! - **Memory**: tensors are allocated on `Compute`, and the caching allocator reuses a freed
//!   block for later compute work at once. A tensor whose memory `Comm` uses must be marked with
//!   [`record_stream`] (PyTorch's `recordStream`) before it is dropped: the block is then held
//!   back until an event recorded on `Comm` at the drop has completed, so compute never writes
//!   it while the collective still reads or writes it.
//!
//! Waits are on the device: [`StreamEvent::wait`] returns at once and only orders the queues;
//! [`StreamEvent::synchronize`] and [`synchronize_stream`] block the host.

use crate::error::Result;
use crate::{Device, Tensor};

/// One of a device's queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// Where every op of the engine is queued.
    Compute,
    /// Communication beside compute (collectives).
    Comm,
}

/// A point in one stream's work: complete once the work queued there before it is done.
pub struct StreamEvent {
    #[cfg(feature = "cuda")]
    gpu: Option<(std::sync::Arc<crate::cuda::Gpu>, cudarc::driver::CudaEvent)>,
}

impl StreamEvent {
    /// An event recorded now on `stream` of `device` (on the CPU: one already complete).
    pub fn record(device: Device, stream: Stream) -> Result<StreamEvent> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let g = crate::cuda::gpu(n)?;
                let e = g.record_event(stream)?;
                Ok(StreamEvent { gpu: Some((g, e)) })
            }
            _ => Ok(StreamEvent {
                #[cfg(feature = "cuda")]
                gpu: None,
            }),
        }
    }

    /// Makes the work queued on `stream` (of the event's device) from now on wait for this
    /// event. Returns at once: the wait is on the device.
    pub fn wait(&self, stream: Stream) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some((g, e)) = &self.gpu {
            return g.wait_event(stream, e);
        }
        let _ = stream;
        Ok(())
    }

    /// Blocks the host until the event has completed.
    pub fn synchronize(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some((g, e)) = &self.gpu {
            return e
                .synchronize()
                .map_err(|err| g.err("event synchronize", err));
        }
        Ok(())
    }

    /// Whether the event has completed (never waits).
    pub fn is_complete(&self) -> Result<bool> {
        #[cfg(feature = "cuda")]
        if let Some((g, e)) = &self.gpu {
            return e.try_is_complete().map_err(|err| g.err("event query", err));
        }
        Ok(true)
    }
}

/// Makes `to` wait (on the device) for the work queued so far on `from`: an event recorded on
/// `from` and waited on by `to`.
pub fn wait_stream(device: Device, to: Stream, from: Stream) -> Result<()> {
    if to == from {
        return Ok(());
    }
    StreamEvent::record(device, from)?.wait(to)
}

/// Blocks the host until the work queued so far on `stream` of `device` is done.
pub fn synchronize_stream(device: Device, stream: Stream) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => crate::cuda::gpu(n)?.synchronize_stream(stream),
        _ => {
            let _ = stream;
            Ok(())
        }
    }
}

/// Marks `t`'s memory as used by work queued on `stream` (PyTorch's `recordStream`): once the
/// storage is dropped, the allocator keeps its block from reuse until the work queued on
/// `stream` by then is done. Needed for every tensor a collective on `Comm` reads or writes
/// that may be dropped before compute waits for `Comm`. A no-op on the CPU, for `Compute` (the
/// stream tensors are allocated on) and for a tensor without device memory.
pub fn record_stream(t: &Tensor, stream: Stream) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(n), Stream::Comm) = (t.device(), stream) {
        let key = crate::cuda::gpu(n)?.stream_key(stream)?;
        if let Some(mem) = t.storage().device_mem() {
            mem.record_stream(key);
        }
    }
    let _ = (t, stream);
    Ok(())
}
