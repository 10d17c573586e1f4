//! Gathered sparse attention on CUDA (kernels/gathered_attention.cu): the forward and backward
//! of `ops::gathered_attention` entirely on the device, in f32, with nothing read back to the
//! host, deterministic and batch-invariant like the CPU op:
//! - [`plan`]: the positions as i64 on the device, whether each batch row of them ascends
//!   (`ga_sorted`; ascending rows are searched by bisection), and each selection row sorted with
//!   its repeats and out-of-range entries dropped (`ga_select`, a bitonic sort in shared memory);
//! - [`forward`]: one block per (query row, head) walks the row's visible columns in list order
//!   with an online softmax (`ga_fwd`), writing the output and the logsumexp;
//! - [`backward`]: `ga_dq` (one block per (query row, head): dq and delta = g·out), `ga_dkv` (one
//!   block per window key or block: every query that sees it, head by head, in a fixed order)
//!   and `ga_dsinks` (one block per head, a fixed-order sum over the rows).

use super::backend::{contiguous_as, copy_cast};
use super::device::Gpu;
use super::launch::{check_rows, empty, gpu_of, launch, ptr, upload, zeros};
use crate::error::{invalid, Result};
use crate::ops::GatheredAttentionParams;
use crate::{DType, Device, Tensor};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use std::sync::Arc;

const OP: &str = "gathered_attention";
/// Threads of every launch (`GA_CHUNK` of the kernels: columns or queries per step).
const THREADS: u32 = 128;
/// Shared memory one block may use without opting in (48 KiB on every architecture).
const SHARED_BYTES: usize = 48 * 1024;
/// An upper bound of the kernels' static shared memory (the chunk lists and scratch).
const STATIC_SHARED: usize = 4096;
/// The most choices per query `ga_select` sorts in shared memory (8192 u32 = 32 KiB).
pub(crate) const MAX_TOPK: usize = 8192;

/// The shapes of one call, as the op checked them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    /// Batch rows, heads, queries, head dim, window keys, blocks.
    pub(crate) b: usize,
    pub(crate) h: usize,
    pub(crate) t: usize,
    pub(crate) d: usize,
    pub(crate) s: usize,
    pub(crate) n: usize,
    /// Batch rows of `q_pos` and `k_pos` (1 or B).
    pub(crate) qb: usize,
    pub(crate) kb: usize,
    /// The selection's batch rows (1 or B) and choices per query.
    pub(crate) sel: Option<(usize, usize)>,
    pub(crate) window: usize,
    pub(crate) rate: usize,
    pub(crate) scale: f32,
    pub(crate) sinks: bool,
}

/// The `GaDims` struct of kernels/gathered_attention.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GaDims {
    b: i64,
    h: i64,
    t: i64,
    d: i64,
    s: i64,
    n: i64,
    qb: i64,
    kb: i64,
    sb: i64,
    k: i64,
    window: i64,
    rate: i64,
    scale: f32,
    has_sinks: i32,
    has_sel: i32,
}

// SAFETY: plain old data in the C layout the kernels declare.
unsafe impl DeviceRepr for GaDims {}

/// What the forward and the backward share, all on the device.
pub(crate) struct Plan {
    dims: GaDims,
    q_pos: Tensor,
    k_pos: Tensor,
    /// i32 per batch row of the positions: 1 where they ascend.
    q_sorted: Tensor,
    k_sorted: Tensor,
    /// Each selection row's sorted unique entries in `[0, N)` (`[sb·T, k]` i64) and their
    /// counts (`[sb·T]` i64); `None` without a selection.
    sel: Option<(Tensor, Tensor)>,
}

/// The gradients, each in its input's dtype, on the device.
pub(crate) struct Grads {
    pub(crate) q: Tensor,
    pub(crate) keys: Tensor,
    pub(crate) blocks: Option<Tensor>,
    pub(crate) sinks: Option<Tensor>,
}

/// An index tensor as contiguous i64 on `gpu`: uploaded from the host, converted in place on
/// the device (never read back).
fn index_on(gpu: &Arc<Gpu>, t: &Tensor) -> Result<Tensor> {
    match t.device() {
        Device::Cpu => upload(gpu, &t.to_vec::<i64>(), t.shape()),
        _ => contiguous_as(t, DType::I64, OP),
    }
}

/// A launch of `grid` blocks of [`THREADS`] threads with `shared_bytes` of dynamic shared memory.
fn cfg(grid: (usize, usize), shared_bytes: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared_bytes as u32,
    }
}

/// Fails when a launch's grid does not fit the hardware (x up to 2³¹−1, y up to 65535).
fn check_grid(x: usize, y: usize) -> Result<()> {
    check_rows(x, OP)?;
    if y > u16::MAX as usize {
        return Err(invalid(
            OP,
            format!("{y} heads or batch rows exceed one CUDA grid"),
        ));
    }
    Ok(())
}

/// Uploads or converts the positions, flags which batch rows ascend and sorts the selection
/// of `params`, all on the device. `q` names the device.
pub(crate) fn plan(q: &Tensor, params: &GatheredAttentionParams, sh: &Shape) -> Result<Plan> {
    let gpu = gpu_of(q, OP)?;
    if 3 * sh.d * 4 + STATIC_SHARED > SHARED_BYTES {
        return Err(invalid(
            OP,
            format!(
                "the CUDA kernels hold a few rows of D floats in shared memory: D = {} is too large",
                sh.d
            ),
        ));
    }
    let (sb, k) = sh.sel.unwrap_or((1, 0));
    if k > MAX_TOPK {
        return Err(invalid(
            OP,
            format!("the CUDA kernels sort at most {MAX_TOPK} choices per query, got {k}"),
        ));
    }
    if sh.n >= u32::MAX as usize {
        return Err(invalid(OP, format!("{} blocks are too many", sh.n)));
    }
    check_grid(sh.b * sh.t, sh.h)?;
    check_grid(sh.s + sh.n, sh.b)?;
    let dims = GaDims {
        b: sh.b as i64,
        h: sh.h as i64,
        t: sh.t as i64,
        d: sh.d as i64,
        s: sh.s as i64,
        n: sh.n as i64,
        qb: sh.qb as i64,
        kb: sh.kb as i64,
        sb: sb as i64,
        k: k as i64,
        window: sh.window as i64,
        rate: sh.rate as i64,
        scale: sh.scale,
        has_sinks: sh.sinks as i32,
        has_sel: sh.sel.is_some() as i32,
    };
    let (q_pos, k_pos) = (
        index_on(&gpu, &params.q_pos)?,
        index_on(&gpu, &params.k_pos)?,
    );
    let sorted = |pos: &Tensor, rows: usize, len: usize| -> Result<Tensor> {
        let flags = zeros(&gpu, DType::I32, &[rows])?;
        if rows > 0 && len > 0 {
            let (pp, fp, n) = (ptr(pos, OP)?, ptr(&flags, OP)?, len as i64);
            launch!(gpu, "gathered_attention", "ga_sorted", cfg((rows, 1), 0); pp, n, fp)?;
        }
        Ok(flags)
    };
    let q_sorted = sorted(&q_pos, sh.qb, sh.t)?;
    let k_sorted = sorted(&k_pos, sh.kb, sh.s)?;
    let sel = match &params.selected {
        Some(x) if sh.sel.is_some() => {
            let rows = sb * sh.t;
            let list = zeros(&gpu, DType::I64, &[(rows * k).max(1)])?;
            let count = zeros(&gpu, DType::I64, &[rows.max(1)])?;
            if rows > 0 {
                check_rows(rows, OP)?;
                let x = index_on(&gpu, x)?;
                let kp2 = k.next_power_of_two().max(1);
                let (xp, lp, cp, k2) =
                    (ptr(&x, OP)?, ptr(&list, OP)?, ptr(&count, OP)?, kp2 as i64);
                let c = cfg((rows, 1), kp2 * 4);
                launch!(gpu, "gathered_attention", "ga_select", c; xp, lp, cp, dims, k2)?;
            }
            Some((list, count))
        }
        _ => None,
    };
    Ok(Plan {
        dims,
        q_pos,
        k_pos,
        q_sorted,
        k_sorted,
        sel,
    })
}

/// The device address of an optional tensor (0 for none: the kernels do not read it then).
fn opt_ptr(t: Option<&Tensor>) -> Result<u64> {
    t.map(|t| ptr(t, OP)).transpose().map(|p| p.unwrap_or(0))
}

/// An optional float input as contiguous f32.
fn f32_of(t: Option<&Tensor>) -> Result<Option<Tensor>> {
    t.map(|t| contiguous_as(t, DType::F32, OP)).transpose()
}

/// The forward: the output `[B, H, T, D]` in q's dtype, the same in f32 (what the backward
/// reads) and the logsumexp `[B, H, T]` (f32, −∞ for a row that sees nothing).
pub(crate) fn forward(
    p: &Plan,
    q: &Tensor,
    keys: &Tensor,
    blocks: Option<&Tensor>,
    sinks: Option<&Tensor>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let gpu = gpu_of(q, OP)?;
    let a = p.dims;
    let (b, h, t, d) = (a.b as usize, a.h as usize, a.t as usize, a.d as usize);
    let out = empty(&gpu, DType::F32, &[b, h, t, d])?;
    let lse = empty(&gpu, DType::F32, &[b, h, t])?;
    if b * h * t > 0 {
        let (qf, kf) = (
            contiguous_as(q, DType::F32, OP)?,
            contiguous_as(keys, DType::F32, OP)?,
        );
        let (bf, sf) = (f32_of(blocks)?, f32_of(sinks)?);
        let (qp, kp, bp, sp) = (
            ptr(&qf, OP)?,
            ptr(&kf, OP)?,
            opt_ptr(bf.as_ref())?,
            opt_ptr(sf.as_ref())?,
        );
        let (qpos, kpos, ks) = (
            ptr(&p.q_pos, OP)?,
            ptr(&p.k_pos, OP)?,
            ptr(&p.k_sorted, OP)?,
        );
        let (lp, cp) = (
            opt_ptr(p.sel.as_ref().map(|s| &s.0))?,
            opt_ptr(p.sel.as_ref().map(|s| &s.1))?,
        );
        let (op_, zp) = (ptr(&out, OP)?, ptr(&lse, OP)?);
        let c = cfg((b * t, h), 2 * d * 4);
        launch!(gpu, "gathered_attention", "ga_fwd", c; qp, kp, bp, sp, qpos, kpos, ks, lp, cp, op_, zp, a)?;
    }
    let result = if q.dtype() == DType::F32 {
        out.clone()
    } else {
        copy_cast(&out, q.dtype(), OP)?
    };
    Ok((result, out, lse))
}

/// `t` (f32) in `dtype`.
fn cast(t: Tensor, dtype: DType) -> Result<Tensor> {
    if dtype == DType::F32 {
        Ok(t)
    } else {
        copy_cast(&t, dtype, OP)
    }
}

/// The gradients of [`forward`] given the upstream gradient `g` and the forward's f32 output
/// and logsumexp: dq, dkeys, dblocks and dsinks, each in its input's dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    p: &Plan,
    q: &Tensor,
    keys: &Tensor,
    blocks: Option<&Tensor>,
    sinks: Option<&Tensor>,
    out: &Tensor,
    lse: &Tensor,
    g: &Tensor,
) -> Result<Grads> {
    let gpu = gpu_of(q, OP)?;
    let a = p.dims;
    let (b, h, t, d, s, n) = (
        a.b as usize,
        a.h as usize,
        a.t as usize,
        a.d as usize,
        a.s as usize,
        a.n as usize,
    );
    let (qf, kf, gf) = (
        contiguous_as(q, DType::F32, OP)?,
        contiguous_as(keys, DType::F32, OP)?,
        contiguous_as(g, DType::F32, OP)?,
    );
    let (bf, sf) = (f32_of(blocks)?, f32_of(sinks)?);
    let dq = empty(&gpu, DType::F32, &[b, h, t, d])?;
    let delta = empty(&gpu, DType::F32, &[b, h, t])?;
    let dkeys = empty(&gpu, DType::F32, &[b, s, d])?;
    let dblocks = blocks
        .map(|_| empty(&gpu, DType::F32, &[b, n, d]))
        .transpose()?;
    let (qp, kp, bp, gp) = (
        ptr(&qf, OP)?,
        ptr(&kf, OP)?,
        opt_ptr(bf.as_ref())?,
        ptr(&gf, OP)?,
    );
    let (op_, zp, dp) = (ptr(out, OP)?, ptr(lse, OP)?, ptr(&delta, OP)?);
    let (qpos, kpos) = (ptr(&p.q_pos, OP)?, ptr(&p.k_pos, OP)?);
    let (qs, ks) = (ptr(&p.q_sorted, OP)?, ptr(&p.k_sorted, OP)?);
    let (lp, cp) = (
        opt_ptr(p.sel.as_ref().map(|s| &s.0))?,
        opt_ptr(p.sel.as_ref().map(|s| &s.1))?,
    );
    if b * h * t > 0 {
        let dqp = ptr(&dq, OP)?;
        let c = cfg((b * t, h), 3 * d * 4);
        launch!(gpu, "gathered_attention", "ga_dq", c; qp, kp, bp, op_, gp, zp, qpos, kpos, ks, lp, cp, dqp, dp, a)?;
    }
    if b * (s + n) > 0 {
        // Every column's gradient is written (zeros where no query sees it, or none ran).
        let (dkp, dbp) = (ptr(&dkeys, OP)?, opt_ptr(dblocks.as_ref())?);
        let c = cfg((s + n, b), 2 * d * 4);
        launch!(gpu, "gathered_attention", "ga_dkv", c; qp, kp, bp, gp, zp, dp, qpos, kpos, qs, lp, cp, dkp, dbp, a)?;
    }
    let dsinks = match (sinks, &sf) {
        (Some(orig), Some(sf)) => {
            let total = zeros(&gpu, DType::F32, &[h])?;
            if h > 0 {
                let (sp, tp) = (ptr(sf, OP)?, ptr(&total, OP)?);
                launch!(gpu, "gathered_attention", "ga_dsinks", cfg((h, 1), 0); sp, zp, dp, tp, a)?;
            }
            Some(cast(total, orig.dtype())?)
        }
        _ => None,
    };
    Ok(Grads {
        q: cast(dq, q.dtype())?,
        keys: cast(dkeys, keys.dtype())?,
        blocks: match (dblocks, blocks) {
            (Some(x), Some(orig)) => Some(cast(x, orig.dtype())?),
            _ => None,
        },
        sinks: dsinks,
    })
}
