//! Helpers shared by the CUDA kernels' Rust side: device pointers of tensors, fresh outputs,
//! strided-view descriptors, launch shapes, and dtype names.

use super::device::{gpu, Gpu};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::storage::Storage;
use crate::{DType, Device, Tensor};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use std::sync::{Arc, RwLock};

/// The `Strided` struct of kernels/common.cuh: a view of up to 8 dims.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strided {
    rank: i32,
    shape: [i64; 8],
    stride: [i64; 8],
    offset: i64,
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for Strided {}

impl Strided {
    /// The descriptor of `layout` (in elements), for views of rank at most 8.
    pub(crate) fn of(layout: &Layout, op: &'static str) -> Result<Strided> {
        let rank = layout.rank();
        if rank > 8 {
            return Err(Error::Invalid {
                op,
                msg: format!("CUDA kernels take views of rank at most 8, got {rank}"),
            });
        }
        let mut s = Strided {
            rank: rank as i32,
            shape: [1; 8],
            stride: [0; 8],
            offset: layout.offset() as i64,
        };
        for d in 0..rank {
            s.shape[d] = layout.shape()[d] as i64;
            s.stride[d] = layout.strides()[d] as i64;
        }
        Ok(s)
    }
}

/// The device a tensor of a CUDA op lives on.
pub(crate) fn gpu_of(t: &Tensor, op: &'static str) -> Result<Arc<Gpu>> {
    match t.device() {
        Device::Cuda(n) => gpu(n),
        d => Err(Error::DeviceUnavailable {
            device: d,
            reason: format!("{op}: the CUDA backend got a tensor on {d}"),
        }),
    }
}

/// The device address of the first element of `t`'s storage (not its view's offset).
pub(crate) fn storage_ptr(t: &Tensor, op: &'static str) -> Result<u64> {
    let g = t.storage();
    g.device_mem()
        .map(|m| m.ptr())
        .ok_or_else(|| Error::DeviceUnavailable {
            device: t.device(),
            reason: format!("{op}: tensor memory is not on the GPU (released or on the host)"),
        })
}

/// The device address of `t`'s first element; `t` must be contiguous.
pub(crate) fn ptr(t: &Tensor, op: &'static str) -> Result<u64> {
    debug_assert!(t.is_contiguous(), "{op}: ptr of a strided view");
    Ok(storage_ptr(t, op)? + (t.layout().offset() * t.dtype().size_in_bytes()) as u64)
}

/// A fresh contiguous tensor on `gpu` with unspecified contents.
pub(crate) fn empty(gpu: &Arc<Gpu>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mem = gpu.alloc(n * dtype.size_in_bytes())?;
    Ok(wrap(gpu, Storage::on_device(mem, dtype, n), shape))
}

/// A fresh contiguous tensor of zeros on `gpu`.
pub(crate) fn zeros(gpu: &Arc<Gpu>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mem = gpu.alloc_zeroed(n * dtype.size_in_bytes())?;
    Ok(wrap(gpu, Storage::on_device(mem, dtype, n), shape))
}

/// A device tensor holding `data`.
pub(crate) fn upload<T: crate::Element>(
    gpu: &Arc<Gpu>,
    data: &[T],
    shape: &[usize],
) -> Result<Tensor> {
    let mem = gpu.upload(bytemuck::cast_slice(data))?;
    Ok(wrap(
        gpu,
        Storage::on_device(mem, T::DTYPE, data.len()),
        shape,
    ))
}

fn wrap(gpu: &Gpu, storage: Storage, shape: &[usize]) -> Tensor {
    Tensor::from_parts(
        Arc::new(RwLock::new(storage)),
        Layout::contiguous(shape),
        Device::Cuda(gpu.ordinal),
    )
}

/// The kernel-name suffix of a floating dtype the kernels compute in.
pub(crate) fn float_suffix(dtype: DType, op: &'static str) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        got => Err(Error::DType {
            op,
            got,
            expected: "f32 or bf16 on CUDA",
        }),
    }
}

/// The copy-kernel name of any dtype.
pub(crate) fn any_suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::I32 => "i32",
        DType::I64 => "i64",
    }
}

/// A grid-stride launch over `n` elements.
pub(crate) fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` per row.
pub(crate) fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Fails when a launch dimension does not fit the hardware's grid (rows per launch).
pub(crate) fn check_rows(rows: usize, op: &'static str) -> Result<()> {
    if rows > i32::MAX as usize {
        return Err(Error::Invalid {
            op,
            msg: format!("{rows} rows exceed one CUDA grid"),
        });
    }
    Ok(())
}

/// Queues kernel `$name` of source `$module` on `$gpu`'s stream with the given arguments
/// (places, each passed by reference).
macro_rules! launch {
    ($gpu:expr, $module:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let name: &str = &$name;
        let f = $gpu.function($module, name)?;
        use cudarc::driver::PushKernelArg as _;
        let mut b = $gpu.stream.launch_builder(&f);
        $( b.arg(&$arg); )*
        // SAFETY: the argument list matches the kernel's signature in kernels/*.cu, every
        // pointer is a live device allocation of the sizes the kernel indexes, and the stream
        // orders the launch after the work that wrote its inputs.
        unsafe { b.launch($cfg) }
            .map(|_| ())
            .map_err(|e| $crate::cuda::device::cuda_error($gpu.ordinal, name, e))
    }};
}
pub(crate) use launch;

/// A CUDA op that has no kernel yet.
pub(crate) fn not_yet(op: &'static str) -> Error {
    Error::Invalid {
        op,
        msg: "not implemented on CUDA yet (compute it on the CPU: Tensor::to_device(Device::Cpu))"
            .into(),
    }
}
