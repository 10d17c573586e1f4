//! One CUDA device as the engine uses it: its context, the stream every op is queued on (and
//! the communication stream beside it, [`super::streams`]), the kernel modules compiled for it (NVRTC, once per device and source), cuBLAS, and the caching
//! allocator ([`super::pool`]) over `cuMemAlloc`.

use super::kernels::{self, KernelSource};
use super::pool::{Block, Pool, PoolStats, RawAlloc};
use crate::error::{Error, Result};
use crate::Device;
use cudarc::driver::{result as drv, CudaContext, CudaFunction, CudaModule, CudaStream};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A driver or library failure on `device` during `op`.
pub(crate) fn cuda_error(device: usize, op: &str, e: impl std::fmt::Display) -> Error {
    Error::DeviceUnavailable {
        device: Device::Cuda(device),
        reason: format!("{op}: {e}"),
    }
}

/// `cuMemAlloc` / `cuMemFree` on one context.
struct DriverAlloc {
    ctx: Arc<CudaContext>,
}

impl RawAlloc for DriverAlloc {
    fn alloc(&mut self, bytes: usize) -> Result<u64, String> {
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the context is current on this thread; the block is owned by the pool.
        unsafe { drv::malloc_sync(bytes) }.map_err(|e| e.to_string())
    }

    fn free(&mut self, ptr: u64, _bytes: usize) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `alloc` and the pool synchronised before returning it.
            // A failure leaks the block, which is all that can be done while freeing.
            let _ = unsafe { drv::free_sync(ptr) };
        }
    }

    fn synchronize(&mut self) {
        let _ = self.ctx.synchronize();
    }

    fn record_event(&mut self, stream: u64) -> Result<u64, String> {
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let ev = drv::event::create(flags).map_err(|e| e.to_string())?;
        // SAFETY: `ev` was just created; `stream` is one of this context's live streams (the
        // pool is only told of the device's own streams, which live as long as the device).
        match unsafe { drv::event::record(ev, stream as cudarc::driver::sys::CUstream) } {
            Ok(()) => Ok(ev as u64),
            Err(e) => {
                // SAFETY: created above, recorded nowhere.
                let _ = unsafe { drv::event::destroy(ev) };
                Err(e.to_string())
            }
        }
    }

    fn event_done(&mut self, event: u64) -> bool {
        // SAFETY: `event` came from `record_event` and is destroyed only by `destroy_event`.
        unsafe { drv::event::query(event as cudarc::driver::sys::CUevent) }.is_ok()
    }

    fn destroy_event(&mut self, event: u64) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: as above; destroyed once.
            let _ = unsafe { drv::event::destroy(event as cudarc::driver::sys::CUevent) };
        }
    }
}

/// A CUDA device ready for ops.
pub struct Gpu {
    /// The device ordinal.
    pub ordinal: usize,
    /// Its architecture for NVRTC (`sm_90`).
    pub arch: String,
    pub(crate) ctx: Arc<CudaContext>,
    /// Every op on this device is queued here, in program order (the compute stream).
    pub(crate) stream: Arc<CudaStream>,
    /// The communication stream, made on first use ([`super::streams`]).
    pub(crate) comm: OnceLock<std::result::Result<Arc<CudaStream>, String>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    blas: OnceLock<std::result::Result<cudarc::cublas::CudaBlas, String>>,
    pool: Mutex<Pool<DriverAlloc>>,
    /// Pinned staging for large host <-> device copies, made on first use.
    staging: Mutex<Option<super::staging::Staging>>,
}

static GPUS: Mutex<Vec<(usize, Arc<Gpu>)>> = Mutex::new(Vec::new());

/// Device `ordinal`, set up on first use; an error says why CUDA cannot be used (checked
/// before any CUDA call, so a machine without CUDA never panics here).
pub fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    let mut gpus = GPUS.lock().expect("device table poisoned");
    if let Some((_, g)) = gpus.iter().find(|(o, _)| *o == ordinal) {
        return Ok(g.clone());
    }
    let info = super::probe(ordinal).map_err(|reason| Error::DeviceUnavailable {
        device: Device::Cuda(ordinal),
        reason,
    })?;
    let ctx = CudaContext::new(ordinal).map_err(|e| cuda_error(ordinal, "context", e))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| cuda_error(ordinal, "stream", e))?;
    let g = Arc::new(Gpu {
        ordinal,
        arch: info.arch(),
        ctx: ctx.clone(),
        stream,
        comm: OnceLock::new(),
        modules: Mutex::new(HashMap::new()),
        functions: Mutex::new(HashMap::new()),
        blas: OnceLock::new(),
        pool: Mutex::new(Pool::new(DriverAlloc { ctx })),
        staging: Mutex::new(None),
    });
    gpus.push((ordinal, g.clone()));
    Ok(g)
}

impl Gpu {
    /// A driver failure of `op` on this device.
    pub(crate) fn err(&self, op: &str, e: impl std::fmt::Display) -> Error {
        cuda_error(self.ordinal, op, e)
    }

    /// The kernel `name` of source `module`, compiling and loading the source on first use.
    pub(crate) fn function(&self, module: &'static str, name: &str) -> Result<CudaFunction> {
        let key = format!("{module}::{name}");
        if let Some(f) = self.functions.lock().expect("poisoned").get(&key) {
            return Ok(f.clone());
        }
        let m = self.module(module)?;
        let f = m
            .load_function(name)
            .map_err(|e| self.err(&format!("kernel {key}"), e))?;
        self.functions
            .lock()
            .expect("poisoned")
            .insert(key, f.clone());
        Ok(f)
    }

    fn module(&self, name: &'static str) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().expect("poisoned");
        if let Some(m) = modules.get(name) {
            return Ok(m.clone());
        }
        let src: &KernelSource = kernels::source(name)
            .ok_or_else(|| self.err("kernels", format!("no kernel source named {name}")))?;
        let ptx = kernels::compile_ptx(src, &self.arch).map_err(|e| self.err("NVRTC", e))?;
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| self.err(&format!("loading module {name}"), e))?;
        modules.insert(name, m.clone());
        Ok(m)
    }

    /// cuBLAS on this device's stream (created on first use).
    pub(crate) fn blas(&self) -> Result<&cudarc::cublas::CudaBlas> {
        self.blas
            .get_or_init(|| {
                cudarc::cublas::CudaBlas::new(self.stream.clone()).map_err(|e| format!("{e:?}"))
            })
            .as_ref()
            .map_err(|e| self.err("cuBLAS", e))
    }

    /// `bytes` of device memory for work on this device's stream.
    pub(crate) fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        let block = self
            .pool
            .lock()
            .expect("pool poisoned")
            .alloc(bytes, self.stream.cu_stream() as u64)
            .map_err(|e| self.err("alloc", e))?;
        Ok(DeviceBuffer {
            gpu: self.clone(),
            block,
            len: bytes,
        })
    }

    /// `bytes` of zeroed device memory (zeroed on the stream).
    pub(crate) fn alloc_zeroed(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        let b = self.alloc(bytes)?;
        if bytes > 0 {
            self.bind()?;
            // SAFETY: the block holds at least `bytes`; the stream orders the write.
            unsafe { drv::memset_d8_async(b.ptr(), 0, bytes, self.stream.cu_stream()) }
                .map_err(|e| self.err("memset", e))?;
        }
        Ok(b)
    }

    /// A device copy of `bytes`.
    pub(crate) fn upload(self: &Arc<Self>, bytes: &[u8]) -> Result<DeviceBuffer> {
        let b = self.alloc(bytes.len())?;
        if bytes.len() >= super::staging::MIN_STAGED {
            self.bind()?;
            return self
                .with_staging(|st, g| st.upload(g, b.ptr(), bytes))
                .map(|_| b);
        }
        if !bytes.is_empty() {
            self.bind()?;
            // Queued on the device's stream, so it lands after any earlier work that still uses
            // a reused block. No wait: from pageable memory the driver has copied `bytes` out
            // (into its own staging) before the call returns, so the caller may drop them, and
            // a step's small uploads (positions, masks, index lists) never stall the host.
            // SAFETY: the block holds `bytes.len()` bytes; `bytes` is pageable (not registered).
            unsafe { drv::memcpy_htod_async(b.ptr(), bytes, self.stream.cu_stream()) }
                .map_err(|e| self.err("copy to device", e))?;
        }
        Ok(b)
    }

    /// Copies `out.len()` bytes from device address `src` once the stream's work is done.
    pub(crate) fn download(&self, src: u64, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        self.bind()?;
        if out.len() >= super::staging::MIN_STAGED {
            return self.with_staging(|st, g| st.download(g, src, out));
        }
        // Queued after the kernels that wrote `src`; the wait makes `out` complete.
        // SAFETY: the caller passes an address with at least `out.len()` valid bytes.
        unsafe { drv::memcpy_dtoh_async(out, src, self.stream.cu_stream()) }
            .map_err(|e| self.err("copy to host", e))?;
        self.synchronize()
    }

    /// Runs `f` with this device's pinned staging buffers (allocated on first use).
    fn with_staging(
        &self,
        f: impl FnOnce(&mut super::staging::Staging, &Gpu) -> Result<()>,
    ) -> Result<()> {
        let mut guard = self.staging.lock().expect("staging poisoned");
        if guard.is_none() {
            *guard = Some(super::staging::Staging::new(self)?);
        }
        f(guard.as_mut().expect("just set"), self)
    }

    /// Makes this device's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.err("bind context", e))
    }

    /// Waits for every op queued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| self.err("synchronize", e))
    }

    /// The allocator's counters.
    pub fn memory_stats(&self) -> PoolStats {
        self.pool.lock().expect("pool poisoned").stats()
    }

    /// Restarts the allocator's peak from the current usage.
    pub fn reset_peak(&self) {
        self.pool.lock().expect("pool poisoned").reset_peak()
    }

    /// Returns cached blocks to the driver (after synchronising).
    pub fn empty_cache(&self) {
        self.pool.lock().expect("pool poisoned").empty_cache()
    }
}

/// Device memory from a [`Gpu`]'s pool, returned to it when dropped.
pub struct DeviceBuffer {
    gpu: Arc<Gpu>,
    block: Block,
    len: usize,
}

impl DeviceBuffer {
    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.block.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl DeviceBuffer {
    /// Keeps the block from reuse after it is dropped until the work queued so far (and later,
    /// up to the drop) on `stream` is done: that stream uses it (the pool's `record_stream`).
    pub(crate) fn record_stream(&self, stream: u64) {
        if let Ok(mut pool) = self.gpu.pool.lock() {
            pool.record_stream(&self.block, stream);
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Stream-ordered: kernels already queued may still read the block; only later work on
        // the same stream can be handed it again.
        if let Ok(mut pool) = self.gpu.pool.lock() {
            pool.free(self.block);
        }
    }
}

/// The allocator's counters of `device`, or `None` when it was never used.
pub fn memory_stats(ordinal: usize) -> Option<PoolStats> {
    let gpus = GPUS.lock().expect("device table poisoned");
    gpus.iter()
        .find(|(o, _)| *o == ordinal)
        .map(|(_, g)| g.memory_stats())
}
