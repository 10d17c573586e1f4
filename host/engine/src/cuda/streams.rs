//! A device's two streams and the events between them, on the GPU. The device-agnostic API and
//! its rules are in [`crate::streams`]; this is what it calls on a GPU.

use super::device::{gpu, Gpu};
use crate::error::Result;
use crate::streams::Stream;
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::Arc;

impl Gpu {
    /// The communication stream: made on first use, beside the compute stream, in the same
    /// context. Work on it runs concurrently with compute work unless an event orders them.
    pub fn comm_stream(&self) -> Result<&Arc<CudaStream>> {
        self.comm
            .get_or_init(|| self.ctx.new_stream().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| self.err("communication stream", e))
    }

    /// The stream `which` names.
    pub(crate) fn stream_of(&self, which: Stream) -> Result<&Arc<CudaStream>> {
        match which {
            Stream::Compute => Ok(&self.stream),
            Stream::Comm => self.comm_stream(),
        }
    }

    /// An event recorded now on `which`.
    pub(crate) fn record_event(&self, which: Stream) -> Result<CudaEvent> {
        self.stream_of(which)?
            .record_event(None)
            .map_err(|e| self.err("record event", e))
    }

    /// Makes `which` wait (on the device) for `event`.
    pub(crate) fn wait_event(&self, which: Stream, event: &CudaEvent) -> Result<()> {
        self.stream_of(which)?
            .wait(event)
            .map_err(|e| self.err("wait for event", e))
    }

    /// Waits (on the host) for the work queued so far on `which`.
    pub(crate) fn synchronize_stream(&self, which: Stream) -> Result<()> {
        self.stream_of(which)?
            .synchronize()
            .map_err(|e| self.err("synchronize", e))
    }

    /// The raw handle of `which`, as the pool keys streams.
    pub(crate) fn stream_key(&self, which: Stream) -> Result<u64> {
        Ok(self.stream_of(which)?.cu_stream() as u64)
    }
}

/// GPU `ordinal`'s communication stream (for an NCCL communicator whose calls should queue
/// there: `anneal_dist::nccl::Nccl::new_on_stream`).
pub fn comm_stream(ordinal: usize) -> Result<Arc<CudaStream>> {
    gpu(ordinal)?.comm_stream().cloned()
}
