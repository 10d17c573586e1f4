//! Attention on CUDA, kernels with the same masks (causal, sliding window over explicit
//! positions), GQA, soft-capping and sinks, all deterministic:
//! - exact (kernels/attention.cu): one block per query row (and per key row for dK/dV) holding
//!   the row's scores in shared memory, which bounds the key length; kept for short sequences
//!   and as the tiled kernel's reference;
//! - tiled (kernels/flash.cu): FlashAttention-style tiles of queries and keys in shared memory
//!   with an online softmax, no bound on the key length; used from [`TILED_MIN_KEYS`] keys on,
//!   or wherever the exact kernel does not fit, for head dims it holds;
//! - tensor-core (kernels/flash_wmma.cu, forward only): the tiled kernel's schedule with Q·Kᵀ
//!   and P·V on bf16 tensor cores (wmma), f32 softmax; replaces the tiled forward for bf16
//!   outside batch-invariant mode on sm_80 and later, for head dims that are multiples of 16 up
//!   to 128. Its backward is the tiled one's.

use super::backend::contiguous_as;
use super::launch::{empty, float_suffix, gpu_of, grid, launch, ptr, upload, zeros};
use crate::error::{Error, Result};
use crate::ops::{AttentionGrads, AttentionSpec};
use crate::{DType, Tensor};
use cudarc::driver::{DeviceRepr, LaunchConfig};

const OP: &str = "attention";
/// Shared memory one block may use without opting in (48 KiB on every architecture).
const SHARED_BYTES: usize = 48 * 1024;
/// Queries per shared-memory chunk of the dK/dV kernel.
const CHUNK: usize = 1024;
const THREADS: u32 = 128;
/// Key length from which the tiled kernel replaces the exact one.
pub const TILED_MIN_KEYS: usize = 1024;
/// The tiled kernel's query and key tile sizes, threads per row and columns per thread
/// (`FQ`, `FK`, `FT`, `FMAXC` of kernels/flash.cu).
const FQ: usize = 16;
const FK: usize = 16;
const FT: usize = 8;
const FMAXC: usize = 32;
/// The tensor-core kernel's query rows per block (4 warps of 16) and largest head dim
/// (`WQ`, `16 · WMAXC` of kernels/flash_wmma.cu).
const WQ: usize = 64;
const WMAX_DIM: usize = 128;

/// Which kernel computes an attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernel {
    /// One block per row, the row's scores in shared memory (kernels/attention.cu).
    Exact,
    /// Tiles with an online softmax (kernels/flash.cu).
    Tiled,
    /// The tiled schedule on bf16 tensor cores (kernels/flash_wmma.cu), forward and backward.
    TensorCore,
}

/// Shared floats the exact kernels need, and whether they fit.
fn exact_fits(tk: usize, d: usize, dv: usize) -> bool {
    (tk + d + dv) * 4 <= SHARED_BYTES && d <= 4 * THREADS as usize && dv <= 4 * THREADS as usize
}

/// Shared floats of the tiled forward, dq and dk/dv kernels (the layouts of kernels/flash.cu).
fn tiled_shared(d: usize, dv: usize) -> [usize; 3] {
    [
        FQ * d + FK * (d + dv) + FQ * FK + 2 * FQ,
        FQ * (d + dv) + FK * (d + dv) + FQ * FK,
        (FK + FQ) * (d + dv) + 2 * FQ * FK,
    ]
}

fn tiled_fits(d: usize, dv: usize) -> bool {
    d <= FT * FMAXC
        && dv <= FT * FMAXC
        && tiled_shared(d, dv).iter().all(|&f| f * 4 <= SHARED_BYTES)
}

/// Shared bytes of the tensor-core forward (the layout of kernels/flash_wmma.cu).
fn tensor_core_shared(d: usize, dv: usize) -> usize {
    192 * d + 64 * dv + 12_288
}

/// Shared bytes of the tensor-core backward's dq and dk/dv kernels (kernels/flash_wmma.cu).
fn tensor_core_backward_shared(d: usize, dv: usize) -> [usize; 2] {
    [128 * (d + dv) + 6_144, 160 * (d + dv) + 6_272]
}

fn tensor_core_fits(d: usize, dv: usize) -> bool {
    [d, dv]
        .iter()
        .all(|&x| x > 0 && x % 16 == 0 && x <= WMAX_DIM)
        && tensor_core_shared(d, dv) <= SHARED_BYTES
        && tensor_core_backward_shared(d, dv)
            .iter()
            .all(|&b| b <= SHARED_BYTES)
}

/// The kernel [`forward`] and [`backward`] use for these shapes: the tiled one from
/// [`TILED_MIN_KEYS`] keys on or where the exact one does not fit, when its head dims fit. In
/// batch-invariant mode the tiled one whenever its head dims fit, so a decode step (few keys)
/// and a full forward (many) take the same kernel; its key tiles start at key 0 and the tiles
/// past a query's last visible key add nothing, so a query row gets the same bits either way.
pub fn kernel_for(tk: usize, d: usize, dv: usize) -> AttentionKernel {
    let by_length = tk >= TILED_MIN_KEYS || !exact_fits(tk, d, dv);
    if tiled_fits(d, dv) && (by_length || crate::invariant::batch_invariant()) {
        AttentionKernel::Tiled
    } else {
        AttentionKernel::Exact
    }
}

/// The kernel [`forward`] uses: the tensor-core one where [`kernel_for`] picks the tiled kernel,
/// the operands are bf16, the mode is not batch-invariant (whose rows must not depend on the
/// kernel), the device (`arch`, `sm_90`) has bf16 tensor cores and the head dims fit it; else
/// [`kernel_for`]'s.
pub fn forward_kernel_for(
    dtype: DType,
    arch: &str,
    tk: usize,
    d: usize,
    dv: usize,
) -> AttentionKernel {
    let kernel = kernel_for(tk, d, dv);
    if kernel == AttentionKernel::Tiled
        && dtype == DType::BF16
        && !crate::invariant::batch_invariant()
        && super::wmma::tensor_cores(arch)
        && tensor_core_fits(d, dv)
    {
        AttentionKernel::TensorCore
    } else {
        kernel
    }
}

/// The `AttnDims` struct of kernels/attention.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AttnDims {
    b: i64,
    hq: i64,
    hkv: i64,
    tq: i64,
    tk: i64,
    d: i64,
    dv: i64,
    scale: f32,
    softcap: f32,
    causal: i32,
    window: i64,
    has_sinks: i32,
}

// SAFETY: plain old data in the C layout the kernels declare.
unsafe impl DeviceRepr for AttnDims {}

struct Prepared {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Option<Tensor>,
    q_pos: Tensor,
    k_pos: Tensor,
    dims: AttnDims,
    suf: &'static str,
}

fn prepare(
    kernel: AttentionKernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    spec: &AttentionSpec,
) -> Result<Prepared> {
    let dtype = q.dtype();
    let suf = float_suffix(dtype, OP)?;
    let gpu = gpu_of(q, OP)?;
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let dims = AttnDims {
        b: qs[0] as i64,
        hq: qs[1] as i64,
        hkv: ks[1] as i64,
        tq: qs[2] as i64,
        tk: ks[2] as i64,
        d: qs[3] as i64,
        dv: vs[3] as i64,
        scale: spec.scale,
        softcap: spec.softcap.unwrap_or(0.0),
        causal: spec.causal as i32,
        window: spec.window.unwrap_or(0) as i64,
        has_sinks: sinks.is_some() as i32,
    };
    let need = (ks[2] + qs[3] + vs[3]) * 4;
    if kernel == AttentionKernel::TensorCore
        && (dtype != DType::BF16 || !tensor_core_fits(qs[3], vs[3]))
    {
        return Err(Error::Invalid {
            op: OP,
            msg: format!(
                "the tensor-core attention kernel takes bf16 with head dims that are multiples of 16 up to {WMAX_DIM}, got {dtype} with {}/{}",
                qs[3], vs[3]
            ),
        });
    }
    if kernel == AttentionKernel::Tiled && !tiled_fits(qs[3], vs[3]) {
        return Err(Error::Invalid {
            op: OP,
            msg: format!(
                "the tiled CUDA attention kernel holds head dims up to {} with D + Dv at most {}, got {}/{}",
                FT * FMAXC,
                (SHARED_BYTES / 4 - 2 * FQ * FK) / (FQ + FK),
                qs[3],
                vs[3]
            ),
        });
    }
    if kernel == AttentionKernel::Exact && !exact_fits(ks[2], qs[3], vs[3]) {
        return Err(Error::Invalid {
            op: OP,
            msg: format!(
                "the CUDA attention kernel holds a row of scores in shared memory: {} keys with head dims {}/{} need {need} bytes (limit {SHARED_BYTES}, head dims at most {})",
                ks[2],
                qs[3],
                vs[3],
                4 * THREADS
            ),
        });
    }
    // The tensor-core kernel stages rows by 16-byte cp.async copies: its operands start aligned.
    let operand = |t: &Tensor| match kernel {
        AttentionKernel::TensorCore => super::wmma::aligned(t, OP),
        _ => contiguous_as(t, dtype, OP),
    };
    Ok(Prepared {
        q: operand(q)?,
        k: operand(k)?,
        v: operand(v)?,
        sinks: sinks
            .map(|s| contiguous_as(s, DType::F32, OP))
            .transpose()?,
        q_pos: upload(&gpu, &spec.q_pos, &[spec.q_pos.len()])?,
        k_pos: upload(&gpu, &spec.k_pos, &[spec.k_pos.len()])?,
        dims,
        suf,
    })
}

/// A tiled launch: `rows` query (or key) rows in tiles of 16, FT threads per row.
fn tiled_cfg(rows: usize, heads: usize, shared_floats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(FQ) as u32, heads as u32, 1),
        block_dim: ((FQ * FT) as u32, 1, 1),
        shared_mem_bytes: (shared_floats * 4) as u32,
    }
}

fn cfg(grid: (usize, usize), shared_floats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (shared_floats * 4) as u32,
    }
}

/// The output `[B, Hq, Tq, Dv]` (q's dtype) and the logsumexp `[B, Hq, Tq]` (f32), by the
/// kernel [`kernel_for`] picks.
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor)> {
    let arch = &gpu_of(q, OP)?.arch;
    let kernel = forward_kernel_for(q.dtype(), arch, k.shape()[2], q.shape()[3], v.shape()[3]);
    forward_with(kernel, q, k, v, sinks, spec)
}

/// [`forward`] by the given kernel (the tests compare the two).
pub fn forward_with(
    kernel: AttentionKernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor)> {
    let gpu = gpu_of(q, OP)?;
    let p = prepare(kernel, q, k, v, sinks, spec)?;
    let a = p.dims;
    let (b, hq, tq, dv) = (a.b as usize, a.hq as usize, a.tq as usize, a.dv as usize);
    let out = empty(&gpu, q.dtype(), &[b, hq, tq, dv])?;
    let lse = empty(&gpu, DType::F32, &[b, hq, tq])?;
    if b * hq * tq == 0 {
        return Ok((out, lse));
    }
    let (qp, kp, vp) = (ptr(&p.q, OP)?, ptr(&p.k, OP)?, ptr(&p.v, OP)?);
    let sp = p
        .sinks
        .as_ref()
        .map(|s| ptr(s, OP))
        .transpose()?
        .unwrap_or(0);
    let (qpos, kpos) = (ptr(&p.q_pos, OP)?, ptr(&p.k_pos, OP)?);
    let (op_, lp) = (ptr(&out, OP)?, ptr(&lse, OP)?);
    match kernel {
        AttentionKernel::TensorCore => {
            if !super::wmma::tensor_cores(&gpu.arch) {
                return Err(Error::Invalid {
                    op: OP,
                    msg: format!(
                        "the tensor-core attention kernel needs sm_80 or later, the device is {}",
                        gpu.arch
                    ),
                });
            }
            let c = LaunchConfig {
                grid_dim: (tq.div_ceil(WQ) as u32, (b * hq) as u32, 1),
                block_dim: (WQ as u32 / 16 * 32, 1, 1),
                shared_mem_bytes: tensor_core_shared(a.d as usize, dv) as u32,
            };
            launch!(gpu, "flash_wmma", "flash_wmma_fwd_bf16", c; qp, kp, vp, sp, qpos, kpos, op_, lp, a)?;
        }
        AttentionKernel::Tiled => {
            let c = tiled_cfg(tq, b * hq, tiled_shared(a.d as usize, dv)[0]);
            launch!(gpu, "flash", format!("flash_fwd_{}", p.suf), c; qp, kp, vp, sp, qpos, kpos, op_, lp, a)?;
        }
        AttentionKernel::Exact => {
            let c = cfg((tq, b * hq), (a.tk + a.d) as usize);
            launch!(gpu, "attention", format!("attention_fwd_{}", p.suf), c; qp, kp, vp, sp, qpos, kpos, op_, lp, a)?;
        }
    }
    Ok((out, lse))
}

/// Gradients of q, k, v (each in its input's dtype) and of the sinks (f32, summed on the host
/// in row order), by the kernel [`kernel_for`] picks.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    out: &Tensor,
    lse: &Tensor,
    grad: &Tensor,
    spec: &AttentionSpec,
) -> Result<AttentionGrads> {
    let arch = &gpu_of(q, OP)?.arch;
    let kernel = forward_kernel_for(q.dtype(), arch, k.shape()[2], q.shape()[3], v.shape()[3]);
    backward_with(kernel, q, k, v, sinks, out, lse, grad, spec)
}

/// [`backward`] by the given kernel (the tests compare them).
#[allow(clippy::too_many_arguments)]
pub fn backward_with(
    kernel: AttentionKernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    out: &Tensor,
    lse: &Tensor,
    grad: &Tensor,
    spec: &AttentionSpec,
) -> Result<AttentionGrads> {
    let gpu = gpu_of(q, OP)?;
    if kernel == AttentionKernel::TensorCore && !super::wmma::tensor_cores(&gpu.arch) {
        return Err(Error::Invalid {
            op: OP,
            msg: format!(
                "the tensor-core attention kernel needs sm_80 or later, the device is {}",
                gpu.arch
            ),
        });
    }
    let p = prepare(kernel, q, k, v, sinks, spec)?;
    let a = p.dims;
    let dtype = q.dtype();
    let (o, g) = (
        contiguous_as(out, dtype, OP)?,
        match kernel {
            // Staged by 16-byte copies like the operands.
            AttentionKernel::TensorCore => super::wmma::aligned(grad, OP)?,
            _ => contiguous_as(grad, dtype, OP)?,
        },
    );
    let lse = contiguous_as(lse, DType::F32, OP)?;
    let (b, hq, hkv, tq, tk) = (
        a.b as usize,
        a.hq as usize,
        a.hkv as usize,
        a.tq as usize,
        a.tk as usize,
    );
    let (d, dv) = (a.d as usize, a.dv as usize);
    let rows = b * hq * tq;
    let delta = empty(&gpu, DType::F32, &[rows])?;
    let dq = empty(&gpu, DType::F32, &[b, hq, tq, d])?;
    let dk = empty(&gpu, DType::F32, &[b, hkv, tk, d])?;
    let dvt = empty(&gpu, DType::F32, &[b, hkv, tk, dv])?;
    let (qp, kp, vp, gp) = (ptr(&p.q, OP)?, ptr(&p.k, OP)?, ptr(&p.v, OP)?, ptr(&g, OP)?);
    let (qpos, kpos, lp, dp) = (
        ptr(&p.q_pos, OP)?,
        ptr(&p.k_pos, OP)?,
        ptr(&lse, OP)?,
        ptr(&delta, OP)?,
    );
    if rows > 0 {
        let (opp, dv64) = (ptr(&o, OP)?, a.dv);
        let c = cfg((rows, 1), 0);
        launch!(gpu, "attention", format!("attention_delta_{}", p.suf), c; opp, gp, dp, dv64)?;
        let dqp = ptr(&dq, OP)?;
        if kernel == AttentionKernel::TensorCore {
            let c = LaunchConfig {
                grid_dim: (tq.div_ceil(32) as u32, (b * hq) as u32, 1),
                block_dim: (64, 1, 1),
                shared_mem_bytes: tensor_core_backward_shared(d, dv)[0] as u32,
            };
            launch!(gpu, "flash_wmma", "flash_wmma_dq_bf16", c; qp, kp, vp, gp, lp, dp, qpos, kpos, dqp, a)?;
        } else if kernel == AttentionKernel::Tiled {
            let c = tiled_cfg(tq, b * hq, tiled_shared(d, dv)[1]);
            launch!(gpu, "flash", format!("flash_dq_{}", p.suf), c; qp, kp, vp, gp, lp, dp, qpos, kpos, dqp, a)?;
        } else {
            let c = cfg((tq, b * hq), tk + d + dv);
            launch!(gpu, "attention", format!("attention_dq_{}", p.suf), c; qp, kp, vp, gp, lp, dp, qpos, kpos, dqp, a)?;
        }
    }
    let (dk, dvt) = if rows == 0 {
        // No query: the gradients of k and v are zero.
        (
            zeros(&gpu, DType::F32, &[b, hkv, tk, d])?,
            zeros(&gpu, DType::F32, &[b, hkv, tk, dv])?,
        )
    } else {
        (dk, dvt)
    };
    if b * hkv * tk > 0 && rows > 0 {
        let (dkp, dvp, chunk) = (ptr(&dk, OP)?, ptr(&dvt, OP)?, CHUNK as i64);
        if kernel == AttentionKernel::TensorCore {
            let c = LaunchConfig {
                grid_dim: (tk.div_ceil(64) as u32, (b * hkv) as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: tensor_core_backward_shared(d, dv)[1] as u32,
            };
            launch!(gpu, "flash_wmma", "flash_wmma_dkv_bf16", c; qp, kp, vp, gp, lp, dp, qpos, kpos, dkp, dvp, a)?;
        } else if kernel == AttentionKernel::Tiled {
            // Key tiles of FK rows: the same launch shape as the query tiles (FQ = FK).
            let c = tiled_cfg(tk, b * hkv, tiled_shared(d, dv)[2]);
            launch!(gpu, "flash", format!("flash_dkv_{}", p.suf), c; qp, kp, vp, gp, lp, dp, qpos, kpos, dkp, dvp, a)?;
        } else {
            let c = cfg((tk, b * hkv), 2 * CHUNK + d + dv);
            launch!(gpu, "attention", format!("attention_dkv_{}", p.suf), c; qp, kp, vp, gp, lp, dp, qpos, kpos, dkp, dvp, a, chunk)?;
        }
    }
    let dsinks = match sinks {
        None => None,
        Some(s) => {
            // d/dsink_h = -Σ_rows exp(sink_h - lse) · delta, on the device in row order.
            let sf = contiguous_as(s, DType::F32, OP)?;
            let total = zeros(&gpu, DType::F32, &[hq])?;
            if rows > 0 && hq > 0 {
                let (sp, lp, dp, tp) = (
                    ptr(&sf, OP)?,
                    ptr(&lse, OP)?,
                    ptr(&delta, OP)?,
                    ptr(&total, OP)?,
                );
                let (b64, hq64, tq64) = (b as i64, hq as i64, tq as i64);
                launch!(gpu, "attention", "attention_dsinks", grid(hq); sp, lp, dp, tp, b64, hq64, tq64)?;
            }
            Some(if s.dtype() == DType::F32 {
                total
            } else {
                contiguous_as(&total, s.dtype(), OP)?
            })
        }
    };
    let cast = |t: Tensor, to: DType| {
        if to == DType::F32 {
            Ok(t)
        } else {
            contiguous_as(&t, to, OP)
        }
    };
    Ok(AttentionGrads {
        q: cast(dq, q.dtype())?,
        k: cast(dk, k.dtype())?,
        v: cast(dvt, v.dtype())?,
        sinks: dsinks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_keys_go_to_the_tiled_kernel_when_its_head_dims_fit() {
        assert_eq!(kernel_for(37, 16, 16), AttentionKernel::Exact);
        assert_eq!(kernel_for(TILED_MIN_KEYS, 128, 128), AttentionKernel::Tiled);
        // Past the exact kernel's shared memory whatever the threshold.
        assert_eq!(kernel_for(20_000, 64, 64), AttentionKernel::Tiled);
        assert!(!exact_fits(20_000, 64, 64));
        // Head dims the tiled kernel cannot hold stay exact (which then says why it refuses).
        assert_eq!(kernel_for(2048, 512, 512), AttentionKernel::Exact);
        assert!(tiled_fits(128, 128) && !tiled_fits(256, 256));
    }

    #[test]
    fn bf16_tiled_forwards_go_to_tensor_cores_outside_batch_invariant_mode() {
        let pick = |dtype, arch, tk, d, dv| forward_kernel_for(dtype, arch, tk, d, dv);
        assert_eq!(
            pick(DType::BF16, "sm_90", 4096, 128, 128),
            AttentionKernel::TensorCore
        );
        assert_eq!(
            pick(DType::BF16, "sm_80", 4096, 64, 48),
            AttentionKernel::TensorCore
        );
        // f32, GPUs before Ampere, head dims off the fragments' grid or past 128, short keys.
        assert_eq!(
            pick(DType::F32, "sm_90", 4096, 128, 128),
            AttentionKernel::Tiled
        );
        assert_eq!(
            pick(DType::BF16, "sm_75", 4096, 128, 128),
            AttentionKernel::Tiled
        );
        assert_eq!(
            pick(DType::BF16, "sm_90", 4096, 72, 72),
            AttentionKernel::Tiled
        );
        assert_eq!(
            pick(DType::BF16, "sm_90", 4096, 144, 144),
            AttentionKernel::Tiled
        );
        assert_eq!(
            pick(DType::BF16, "sm_90", 37, 64, 64),
            AttentionKernel::Exact
        );
        assert!(tensor_core_fits(128, 128) && tensor_core_shared(128, 128) <= SHARED_BYTES);
        let _invariant = crate::invariant::set_batch_invariant(true);
        assert_eq!(
            pick(DType::BF16, "sm_90", 4096, 128, 128),
            AttentionKernel::Tiled
        );
    }
}
