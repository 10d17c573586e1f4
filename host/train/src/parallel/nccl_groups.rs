//! NCCL on device buffers for the collectives inside a forward and backward: tensor (and
//! sequence) parallelism's all-reduce, all-gather and reduce-scatter, context parallelism's
//! ring pass, expert parallelism's variable all-to-all of token rows, and the pipeline's
//! point-to-point messages ([`super::pp::wire`]). One NCCL communicator per mesh group (`tp`,
//! `cp`, `ep`, `pp`), each bootstrapped over that group's MPI
//! communicator at job start ([`crate::Dist::start_device_collectives`]).
//!
//! The engine's group traits (`TpGroup`, `KvRing`, `ExpertExchange`) take tensors; the
//! trainer's implementations ([`super::tp`], [`super::context`], [`super::ep`]) ask here first
//! and fall back to the staged path (host memory over MPI) when no communicator is installed
//! or a tensor is not on the communicator's GPU. That fallback is the same on every rank of a
//! group: they hold the same kind of tensors at each call.
//!
//! The communicators live in a thread-local, like the MPI groups they stand beside (the
//! engine's group objects must be `Send + Sync`, the communicators are not, and both run on the
//! training thread only), from [`DeviceGroups::install`] until the guard drops.
//!
//! Bits: sums run in f32 as the staged path's do (bf16 and f16 cast on the device first, the
//! result cast back); on the CPU emulation NCCL sums in rank order, as MPI does, so both paths
//! give the same bits there. Gathers, ring passes and the all-to-all move each tensor in its
//! own dtype: copies, the same bits as the staged path's f32 round trip. Compute and NCCL run
//! on different streams, ordered by waiting on each (the engine's stream before a call,
//! NCCL's after it).

use crate::TrainError;
use anneal_dist::nccl::{Nccl, NcclDtype, Transfer};
use anneal_dist::Collective;
use anneal_engine::{DType, Device, Tensor};
use std::cell::RefCell;
use std::rc::Rc;

/// The mesh groups whose collectives take NCCL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Group {
    /// Tensor (and sequence) parallelism.
    Tp,
    /// Context parallelism's ring.
    Cp,
    /// Expert parallelism's exchange.
    Ep,
}

#[derive(Default)]
struct Installed {
    tp: Option<Rc<Nccl>>,
    cp: Option<Rc<Nccl>>,
    ep: Option<Rc<Nccl>>,
    pp: Option<Rc<Nccl>>,
}

thread_local! {
    static INSTALLED: RefCell<Installed> = RefCell::new(Installed::default());
}

/// Keeps the groups' communicators installed on this thread until dropped.
pub(crate) struct DeviceGroups {
    names: Vec<&'static str>,
}

impl Drop for DeviceGroups {
    fn drop(&mut self) {
        INSTALLED.with(|i| *i.borrow_mut() = Installed::default());
    }
}

/// An NCCL communicator over `comm`'s ranks (in its rank order) on GPU `ordinal`, bootstrapped
/// over a split of `comm`. Collective over `comm`.
fn over(comm: &dyn Collective, ordinal: usize) -> Result<Rc<Nccl>, TrainError> {
    let boot = comm.split(0, comm.rank() as u32)?;
    Ok(Rc::new(Nccl::new(boot, Some(ordinal))?))
}

impl DeviceGroups {
    /// Builds a communicator on GPU `ordinal` over each group given (`None`: the layout has no
    /// such group) and installs them on this thread. Collective over each group.
    pub fn install(
        tp: Option<&dyn Collective>,
        cp: Option<&dyn Collective>,
        ep: Option<&dyn Collective>,
        pp: Option<&dyn Collective>,
        ordinal: usize,
    ) -> Result<DeviceGroups, TrainError> {
        let mut installed = Installed::default();
        let mut names = Vec::new();
        let groups = [(tp, "tp"), (cp, "cp"), (ep, "ep"), (pp, "pp")];
        for (i, (comm, name)) in groups.into_iter().enumerate() {
            let Some(comm) = comm.filter(|c| c.size() > 1) else {
                continue;
            };
            let nccl = Some(over(comm, ordinal)?);
            match i {
                0 => installed.tp = nccl,
                1 => installed.cp = nccl,
                2 => installed.ep = nccl,
                _ => installed.pp = nccl,
            }
            names.push(name);
        }
        INSTALLED.with(|i| *i.borrow_mut() = installed);
        Ok(DeviceGroups { names })
    }

    /// What runs on device buffers, for the console note (empty when no group has one).
    pub fn describe(&self) -> String {
        let what: Vec<&str> = self
            .names
            .iter()
            .map(|&n| match n {
                "tp" => "tensor parallelism's all-reduce / all-gather / reduce-scatter",
                "cp" => "context parallelism's ring pass",
                "ep" => "expert parallelism's all-to-all",
                _ => "pipeline stages' activations and gradients (one stage per rank; interleaved and zbv schedules keep theirs staged)",
            })
            .collect();
        what.join(", ")
    }
}

/// The communicator of `group` installed on this thread, when `t` lives on its GPU.
pub(crate) fn comm_for(group: Group, t: &Tensor) -> Option<Rc<Nccl>> {
    let nccl = INSTALLED.with(|i| {
        let i = i.borrow();
        match group {
            Group::Tp => i.tp.clone(),
            Group::Cp => i.cp.clone(),
            Group::Ep => i.ep.clone(),
        }
    })?;
    (t.device() == Device::Cuda(nccl.device())).then_some(nccl)
}

/// The pipeline's communicator installed on this thread, when `device` is its GPU.
pub(crate) fn pipeline_comm(device: Device) -> Option<Rc<Nccl>> {
    let nccl = INSTALLED.with(|i| i.borrow().pp.clone())?;
    (device == Device::Cuda(nccl.device())).then_some(nccl)
}

fn err(op: &'static str, msg: impl std::fmt::Display) -> anneal_engine::Error {
    anneal_engine::Error::Invalid {
        op,
        msg: format!("NCCL: {msg}"),
    }
}

/// The NCCL element type of `d`.
pub(crate) fn dtype_of(d: DType) -> NcclDtype {
    match d {
        DType::F32 => NcclDtype::F32,
        DType::BF16 => NcclDtype::Bf16,
        DType::F16 => NcclDtype::F16,
        DType::I32 => NcclDtype::I32,
        DType::I64 => NcclDtype::I64,
    }
}

/// The device address of contiguous `t` on `nccl`'s GPU.
pub(crate) fn address(nccl: &Nccl, t: &Tensor, op: &'static str) -> anneal_engine::Result<u64> {
    match t.cuda_ptr() {
        Some((o, p)) if o == nccl.device() => Ok(p),
        _ => Err(err(
            op,
            "a buffer is not a contiguous tensor on the communicator's GPU",
        )),
    }
}

/// Runs `call` (NCCL work queued on `nccl`'s stream) after the engine's queued work on the
/// GPU, and waits for it: the buffers it reads are written, what it writes is there after.
pub(crate) fn ordered(
    nccl: &Nccl,
    op: &'static str,
    call: impl FnOnce() -> Result<(), anneal_dist::DistError>,
) -> anneal_engine::Result<()> {
    anneal_engine::synchronize(Device::Cuda(nccl.device()))?;
    call().map_err(|e| err(op, e))?;
    nccl.synchronize().map_err(|e| err(op, e))
}

/// `x` in f32, contiguous, for a sum (a fresh copy unless it already is).
fn f32_buffer(x: &Tensor) -> anneal_engine::Result<Tensor> {
    x.to_dtype(DType::F32)?.contiguous()
}

/// `x` summed over `nccl`'s ranks in f32, cast back to its dtype.
pub(crate) fn all_reduce(nccl: &Nccl, x: &Tensor) -> anneal_engine::Result<Tensor> {
    const OP: &str = "tensor-parallel all-reduce";
    let send = f32_buffer(x)?;
    let out = Tensor::zeros_on(x.shape(), DType::F32, x.device())?;
    let (s, o) = (address(nccl, &send, OP)?, address(nccl, &out, OP)?);
    // SAFETY: `send` and `out` are contiguous f32 tensors of `x.numel()` elements on the
    // communicator's GPU, alive until `ordered` has synchronised NCCL's stream; `out` is fresh,
    // written by NCCL alone.
    ordered(nccl, OP, || unsafe {
        nccl.all_reduce_sum_device(s, o, x.numel(), NcclDtype::F32)
    })?;
    drop(send);
    out.to_dtype(x.dtype())
}

/// Every rank's `x` joined along dim 0 in rank order, in `x`'s dtype.
pub(crate) fn all_gather(nccl: &Nccl, x: &Tensor) -> anneal_engine::Result<Tensor> {
    const OP: &str = "tensor-parallel all-gather";
    let send = x.contiguous()?;
    let mut shape = x.shape().to_vec();
    if let Some(d0) = shape.first_mut() {
        *d0 *= nccl.size();
    }
    let out = Tensor::zeros_on(&shape, x.dtype(), x.device())?;
    let (s, o) = (address(nccl, &send, OP)?, address(nccl, &out, OP)?);
    // SAFETY: `send` holds `x.numel()` and `out` `size()` times as many elements of `x`'s
    // dtype on the communicator's GPU, alive until the stream is synchronised; `out` is fresh.
    ordered(nccl, OP, || unsafe {
        nccl.all_gather_device(s, o, x.numel(), dtype_of(x.dtype()))
    })?;
    drop(send);
    Ok(out)
}

/// `x` summed over `nccl`'s ranks in f32, this rank keeping its block of dim 0, in `x`'s dtype.
pub(crate) fn reduce_scatter(nccl: &Nccl, x: &Tensor) -> anneal_engine::Result<Tensor> {
    const OP: &str = "tensor-parallel reduce-scatter";
    let n = nccl.size();
    let mut shape = x.shape().to_vec();
    match shape.first_mut() {
        Some(d0) if d0.is_multiple_of(n) => *d0 /= n,
        _ => {
            return Err(err(
                OP,
                format!("dim 0 of {:?} does not split over {n} ranks", x.shape()),
            ))
        }
    }
    let send = f32_buffer(x)?;
    let out = Tensor::zeros_on(&shape, DType::F32, x.device())?;
    let (s, o) = (address(nccl, &send, OP)?, address(nccl, &out, OP)?);
    // SAFETY: `send` holds `x.numel()` f32 and `out` `x.numel() / n` on the communicator's
    // GPU, alive until the stream is synchronised; `out` is fresh.
    ordered(nccl, OP, || unsafe {
        nccl.reduce_scatter_sum_device(s, o, x.numel() / n, NcclDtype::F32)
    })?;
    drop(send);
    out.to_dtype(x.dtype())
}

/// One ring pass of `blocks` (all on `nccl`'s GPU): each sent to rank `next`, its counterpart
/// received from rank `prev` into a fresh tensor of the same shape and dtype, in one NCCL group.
pub(crate) fn ring_pass(
    nccl: &Nccl,
    blocks: &[Tensor],
    next: usize,
    prev: usize,
) -> anneal_engine::Result<Vec<Tensor>> {
    const OP: &str = "ring_attention";
    let sends: Vec<Tensor> = blocks
        .iter()
        .map(|t| t.contiguous())
        .collect::<anneal_engine::Result<_>>()?;
    let recvs: Vec<Tensor> = blocks
        .iter()
        .map(|t| Tensor::zeros_on(t.shape(), t.dtype(), t.device()))
        .collect::<anneal_engine::Result<_>>()?;
    let transfer = |t: &Tensor, peer| -> anneal_engine::Result<Transfer> {
        Ok(Transfer {
            buf: address(nccl, t, OP)?,
            count: t.numel(),
            dtype: dtype_of(t.dtype()),
            peer,
        })
    };
    let s: Vec<Transfer> = sends
        .iter()
        .map(|t| transfer(t, next))
        .collect::<anneal_engine::Result<_>>()?;
    let r: Vec<Transfer> = recvs
        .iter()
        .map(|t| transfer(t, prev))
        .collect::<anneal_engine::Result<_>>()?;
    // SAFETY: every transfer names a contiguous tensor of its count and dtype on the
    // communicator's GPU; `sends` and `recvs` live until `ordered` synchronised the stream, and
    // the receive buffers are fresh, written by NCCL alone.
    ordered(nccl, OP, || unsafe { nccl.exchange_device(&s, &r) })?;
    drop(sends);
    Ok(recvs)
}

/// The rows of `x [S, width]` exchanged over `nccl`'s ranks (`send_rows[r]` consecutive rows
/// to rank `r`, `recv_rows[r]` from it, packed in source order), in `x`'s dtype.
pub(crate) fn exchange_rows(
    nccl: &Nccl,
    x: &Tensor,
    send_rows: &[usize],
    recv_rows: &[usize],
) -> anneal_engine::Result<Tensor> {
    const OP: &str = "expert exchange";
    let width = x.shape().get(1).copied().unwrap_or(0);
    let send = x.contiguous()?;
    let rows: usize = recv_rows.iter().sum();
    let out = Tensor::zeros_on(&[rows, width], x.dtype(), x.device())?;
    let scale = |v: &[usize]| v.iter().map(|&r| r * width).collect::<Vec<_>>();
    let (sc, rc) = (scale(send_rows), scale(recv_rows));
    if sc.iter().sum::<usize>() != send.numel() {
        return Err(err(
            OP,
            format!("{:?} rows to send, but x is {:?}", send_rows, x.shape()),
        ));
    }
    // An empty tensor may own no device memory: nothing to address.
    let addr = |t: &Tensor| match t.numel() {
        0 => Ok(0),
        _ => address(nccl, t, OP),
    };
    let (s, o) = (addr(&send)?, addr(&out)?);
    // SAFETY: `send` holds the send counts' sum and `out` the receive counts' sum of `x`'s
    // dtype on the communicator's GPU (zero-length transfers are not posted), alive until the
    // stream is synchronised; `out` is fresh.
    ordered(nccl, OP, || unsafe {
        nccl.all_to_all_v_device(s, &sc, o, &rc, dtype_of(x.dtype()))
    })?;
    drop(send);
    Ok(out)
}

/// The collectives a layout with `tp`, `cp` or `ep` groups (`groups`) still stages through host
/// memory, for the console note (empty without such groups).
pub(crate) fn still_staged(groups: bool, sharded: bool) -> String {
    if !groups {
        return String::new();
    }
    let mut left = vec![
        "the ring's key positions",
        "the expert row counts",
        "the vocabulary-parallel loss's row statistics and embedding masks",
        "sequence parallelism's partial-gradient sums",
    ];
    if sharded {
        left.push("FSDP's gathers and reduce-scatters");
    }
    format!(" ({})", left.join(", "))
}
