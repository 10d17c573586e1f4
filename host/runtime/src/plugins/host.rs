//! The host side of a plugin call: a session owning the tensors a plugin holds handles to, and
//! the `HostVTable` functions that serve its op calls.

use super::kv_cache::KvCache;
use super::ops;
use abi_stable::std_types::{RErr, ROk, RSlice, RStr, RString, RVec};
use anneal_engine::{DType, Device, Tensor};
use anneal_plugin_api::abi::{
    Attr, ErrorKind, Handle, HostVTable, OutputKind, PluginError, PluginResult,
};
use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

/// The tensors a plugin may reach during one or more calls: named ones (parameters, gradients,
/// optimizer state) and the handles it holds. Dropping the session drops every tensor a plugin
/// forgot to release.
pub struct HostSession {
    named: std::sync::Arc<HashMap<String, Tensor>>,
    arena: Mutex<Arena>,
    cache: Option<std::sync::Arc<KvCache>>,
    /// Named outputs a model forward emitted; `None` where nothing would read them (optimizer
    /// steps), so an emit there is an error rather than lost.
    emitted: Option<Mutex<Vec<Emitted>>>,
    /// The expert group the MoE op sends rows over (expert parallelism), when there is one.
    experts: Option<anneal_engine::ops::ExpertParallel>,
    /// The context-parallel ring the attention op attends over, when the sequence is split.
    ring: Option<std::sync::Arc<dyn anneal_engine::ops::KvRing>>,
    /// Tensor parallelism: which fetched weights are split, how the linears combine them.
    tp: Option<super::ops_tp::TpSession>,
    /// The rows pack several documents ([`super::ForwardOpts::packed`]).
    packed: bool,
}

/// A named output of a forward besides the logits.
#[derive(Clone)]
pub struct Emitted {
    /// Auxiliary loss or statistic.
    pub kind: OutputKind,
    /// Its name.
    pub name: String,
    /// Its value.
    pub tensor: Tensor,
}

#[derive(Default)]
struct Arena {
    next: u64,
    live: HashMap<u64, Tensor>,
}

impl HostSession {
    /// A session exposing `named` tensors through `host.param(name)`.
    pub fn new(named: HashMap<String, Tensor>) -> Self {
        Self::with_cache(std::sync::Arc::new(named), None)
    }

    /// A session over shared named tensors, with an optional KV cache for attention ops.
    pub fn with_cache(
        named: std::sync::Arc<HashMap<String, Tensor>>,
        cache: Option<std::sync::Arc<KvCache>>,
    ) -> Self {
        HostSession {
            named,
            arena: Mutex::new(Arena {
                next: 1,
                live: HashMap::new(),
            }),
            cache,
            emitted: None,
            experts: None,
            ring: None,
            tp: None,
            packed: false,
        }
    }

    /// Marks the rows as packing several documents each ([`super::ForwardOpts::packed`]).
    pub fn with_packed(mut self, packed: bool) -> Self {
        self.packed = packed;
        self
    }

    /// Fails `op` when the rows pack several documents: an op that carries state along the
    /// sequence without positions would mix them.
    pub(crate) fn refuse_packed(&self, op: &str) -> Result<(), String> {
        match self.packed {
            true => Err(format!(
                "{op}: this model's {op} layers carry state along the sequence and cannot keep \
                 packed conversations apart; set data.pack = false"
            )),
            false => Ok(()),
        }
    }

    /// Runs the MoE op's experts over `experts`' group (expert parallelism): the session's
    /// expert weights are then this rank's share of the experts.
    pub fn with_experts(mut self, experts: Option<anneal_engine::ops::ExpertParallel>) -> Self {
        self.experts = experts;
        self
    }

    /// Runs the `linear` and `embedding` ops tensor-parallel over `tp`'s group: the session's
    /// split parameters are then this rank's slices of them.
    pub fn with_tensor_parallel(mut self, tp: Option<super::TensorParallelism>) -> Self {
        self.tp = tp.map(super::ops_tp::TpSession::new);
        self
    }

    /// The tensor-parallel state of this session's ops, if any.
    pub(crate) fn tp(&self) -> Option<&super::ops_tp::TpSession> {
        self.tp.as_ref()
    }

    /// The expert group of this session's MoE ops, if any.
    pub fn experts(&self) -> Option<&anneal_engine::ops::ExpertParallel> {
        self.experts.as_ref()
    }

    /// Splits the sequence over `ring`'s ranks (context parallelism): this session's tokens
    /// are one rank's part, and its attention ops pass keys and values around the ring.
    pub fn with_ring(
        mut self,
        ring: Option<std::sync::Arc<dyn anneal_engine::ops::KvRing>>,
    ) -> Self {
        self.ring = ring;
        self
    }

    /// The context-parallel ring of this session's attention ops, if any.
    pub fn ring(&self) -> Option<&std::sync::Arc<dyn anneal_engine::ops::KvRing>> {
        self.ring.as_ref()
    }

    /// Accepts named outputs ([`Emitted`]) from the plugin (model forwards).
    pub fn accepting_outputs(mut self) -> Self {
        self.emitted = Some(Mutex::new(Vec::new()));
        self
    }

    /// Takes the named outputs emitted so far.
    pub fn take_emitted(&self) -> Vec<Emitted> {
        self.emitted
            .as_ref()
            .map(|m| std::mem::take(&mut *m.lock().expect("emitted lock poisoned")))
            .unwrap_or_default()
    }

    /// The KV cache attention ops use, if any.
    pub fn cache(&self) -> Option<&KvCache> {
        self.cache.as_deref()
    }

    /// Hands a tensor to the plugin side.
    pub fn insert(&self, t: Tensor) -> Handle {
        let mut a = self.arena.lock().expect("arena lock poisoned");
        let id = a.next;
        a.next += 1;
        a.live.insert(id, t);
        Handle(id)
    }

    /// The tensor behind a handle.
    pub fn get(&self, h: Handle) -> Result<Tensor, String> {
        let a = self.arena.lock().expect("arena lock poisoned");
        a.live
            .get(&h.0)
            .cloned()
            .ok_or_else(|| format!("unknown or released tensor handle {}", h.0))
    }

    /// Takes back a tensor the plugin returned.
    pub fn take(&self, h: Handle) -> Result<Tensor, String> {
        let mut a = self.arena.lock().expect("arena lock poisoned");
        a.live
            .remove(&h.0)
            .ok_or_else(|| format!("plugin returned unknown or released handle {}", h.0))
    }

    /// Number of handles the plugin side holds (for leak checks).
    pub fn live_handles(&self) -> usize {
        self.arena.lock().expect("arena lock poisoned").live.len()
    }

    /// The op table to pass to plugin calls; valid while `self` is.
    pub fn vtable(&self) -> HostVTable {
        HostVTable {
            ctx: self as *const HostSession as *const c_void,
            call: host_call,
            shape: host_shape,
            dtype: host_dtype,
            param: host_param,
            retain: host_retain,
            release: host_release,
            emit: host_emit,
            read_ints: host_read_ints,
        }
    }
}

/// Runs `f` so that neither a panic nor an error unwinds into plugin code: either reaches the
/// plugin as a [`ErrorKind::Host`] error, which it passes back with its kind.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> PluginResult<T> {
    let host = |msg: String| RErr(PluginError::new(ErrorKind::Host, msg));
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => ROk(v),
        Ok(Err(e)) => host(format!("{what}: {e}")),
        Err(_) => host(format!("{what}: internal error in the host (panic)")),
    }
}

/// # Safety
/// `ctx` must come from [`HostSession::vtable`] of a live session.
unsafe fn session<'a>(ctx: *const c_void) -> &'a HostSession {
    // SAFETY: guaranteed by the caller.
    unsafe { &*(ctx as *const HostSession) }
}

unsafe extern "C" fn host_call(
    ctx: *const c_void,
    op: RStr<'_>,
    inputs: RSlice<'_, Handle>,
    attrs: RSlice<'_, Attr>,
) -> PluginResult<RVec<Handle>> {
    // SAFETY: plugins only receive ctx inside a vtable from a live session.
    let s = unsafe { session(ctx) };
    guarded(&format!("host op {}", op.as_str()), || {
        let ins = inputs
            .iter()
            .map(|h| s.get(*h))
            .collect::<Result<Vec<_>, _>>()?;
        let outs = ops::run(op.as_str(), &ins, &attrs, s)?;
        Ok(outs.into_iter().map(|t| s.insert(t)).collect())
    })
}

unsafe extern "C" fn host_shape(ctx: *const c_void, h: Handle) -> PluginResult<RVec<u64>> {
    // SAFETY: as in host_call.
    let s = unsafe { session(ctx) };
    guarded("shape", || {
        Ok(s.get(h)?.shape().iter().map(|&d| d as u64).collect())
    })
}

unsafe extern "C" fn host_read_ints(ctx: *const c_void, h: Handle) -> PluginResult<RVec<i64>> {
    // SAFETY: as in host_call.
    let s = unsafe { session(ctx) };
    guarded("read_ints", || {
        let t = s.get(h)?;
        if !matches!(t.dtype(), DType::I64 | DType::I32) {
            return Err(format!(
                "only integer tensors can be read, this one is {}",
                t.dtype().name()
            ));
        }
        let t = t.to_device(Device::Cpu).map_err(|e| e.to_string())?;
        Ok(t.to_vec::<i64>().into())
    })
}

unsafe extern "C" fn host_dtype(ctx: *const c_void, h: Handle) -> PluginResult<RString> {
    // SAFETY: as in host_call.
    let s = unsafe { session(ctx) };
    guarded("dtype", || Ok(s.get(h)?.dtype().name().into()))
}

unsafe extern "C" fn host_param(ctx: *const c_void, name: RStr<'_>) -> PluginResult<Handle> {
    // SAFETY: as in host_call.
    let s = unsafe { session(ctx) };
    guarded("param", || {
        let t = s
            .named
            .get(name.as_str())
            .cloned()
            .ok_or_else(|| format!("no tensor named '{}'", name.as_str()))?;
        if let Some(tp) = &s.tp {
            tp.note_param(name.as_str(), &t);
        }
        Ok(s.insert(t))
    })
}

unsafe extern "C" fn host_retain(ctx: *const c_void, h: Handle) -> Handle {
    // SAFETY: as in host_call.
    let s = unsafe { session(ctx) };
    match s.get(h) {
        Ok(t) => s.insert(t),
        // An unknown handle retained gives an unknown handle; using it reports the error.
        Err(_) => Handle(0),
    }
}

unsafe extern "C" fn host_release(ctx: *const c_void, h: Handle) {
    // SAFETY: as in host_call.
    let s = unsafe { session(ctx) };
    let _ = s.take(h);
}

unsafe extern "C" fn host_emit(
    ctx: *const c_void,
    kind: OutputKind,
    name: RStr<'_>,
    h: Handle,
) -> PluginResult<()> {
    // SAFETY: as in host_call.
    let s = unsafe { session(ctx) };
    guarded(&format!("emit {}", name.as_str()), || {
        let sink = s
            .emitted
            .as_ref()
            .ok_or("named outputs are only accepted from a model forward")?;
        let tensor = s.get(h)?;
        if kind == OutputKind::AuxLoss && tensor.numel() != 1 {
            return Err(format!(
                "an auxiliary loss must be a scalar, got shape {:?}",
                tensor.shape()
            ));
        }
        sink.lock().expect("emitted lock poisoned").push(Emitted {
            kind,
            name: name.as_str().to_string(),
            tensor,
        });
        Ok(())
    })
}
