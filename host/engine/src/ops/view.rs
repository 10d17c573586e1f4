//! View ops: new layouts over the same storage (copies only in `contiguous` and in reshapes
//! that no layout can express).

use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::layout::resolve_dim;
use crate::Tensor;

impl Tensor {
    /// The same elements with `shape`; a view when the layout allows, else a copy.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(Error::ShapeMismatch {
                op: "reshape",
                lhs: self.shape().to_vec(),
                rhs: shape.to_vec(),
            });
        }
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let out = match self.layout().reshape(shape) {
            Some(l) => self.with_layout(l),
            None => {
                let c = self.detach().materialize(self.dtype());
                c.with_layout(crate::layout::Layout::contiguous(shape))
            }
        };
        Ok(record("reshape", out, &[self], || {
            let in_shape = self.shape().to_vec();
            move |g: &Tensor| Ok(vec![Some(g.reshape(&in_shape)?)])
        }))
    }

    /// All dims from `start` on merged into one.
    pub fn flatten_from(&self, start: usize) -> Result<Tensor> {
        let mut shape = self.shape()[..start.min(self.rank())].to_vec();
        shape.push(self.shape()[start.min(self.rank())..].iter().product());
        self.reshape(&shape)
    }

    /// A view with dims reordered by `perm`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let out = self.with_layout(self.layout().permute(perm)?);
        Ok(record("permute", out, &[self], || {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            move |g: &Tensor| Ok(vec![Some(g.permute(&inv)?)])
        }))
    }

    /// A view with two dims swapped (negative dims count from the end).
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let a = resolve_dim("transpose", d0, self.rank())?;
        let b = resolve_dim("transpose", d1, self.rank())?;
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// `len` elements of `dim` starting at `start`, as a view.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = resolve_dim("narrow", dim, self.rank())?;
        let out = self.with_layout(self.layout().narrow(d, start, len)?);
        Ok(record("narrow", out, &[self], || {
            let full = self.shape().to_vec();
            move |g: &Tensor| {
                // Scatter the slice's gradient into zeros of the full shape, on its device.
                let gz = Tensor::zeros_on(&full, g.dtype(), g.device())?;
                let dst = gz.with_layout(gz.layout().narrow(d, start, len)?);
                copy_into(&dst, g)?;
                Ok(vec![Some(gz)])
            }
        }))
    }

    /// A broadcast view to `shape` (size-1 dims repeat; leading dims may be added).
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let out = self.with_layout(self.layout().expand(shape)?);
        Ok(record("expand", out, &[self], || {
            let in_shape = self.shape().to_vec();
            move |g: &Tensor| Ok(vec![Some(g.sum_to_shape(&in_shape)?)])
        }))
    }

    /// Inserts a size-1 dim at `dim` (which may equal the rank, or be negative).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim("unsqueeze", dim, self.rank() + 1)?;
        let mut shape = self.shape().to_vec();
        shape.insert(d, 1);
        let out = self.with_layout(self.layout().unsqueeze(d));
        debug_assert_eq!(out.shape(), &shape[..]);
        Ok(record("unsqueeze", out, &[self], || {
            let in_shape = self.shape().to_vec();
            move |g: &Tensor| Ok(vec![Some(g.reshape(&in_shape)?)])
        }))
    }

    /// Removes dim `dim`, which must have size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim("squeeze", dim, self.rank())?;
        let out = self.with_layout(self.layout().squeeze(d)?);
        Ok(record("squeeze", out, &[self], || {
            let in_shape = self.shape().to_vec();
            move |g: &Tensor| Ok(vec![Some(g.reshape(&in_shape)?)])
        }))
    }

    /// A row-major copy when the layout is not already contiguous; `self` otherwise.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let out = self.materialize(self.dtype());
        Ok(record("contiguous", out, &[self], || {
            move |g: &Tensor| Ok(vec![Some(g.clone())])
        }))
    }

    /// Copies `src` (broadcast to this shape, converted to this dtype) into this tensor's
    /// elements in place. Not recorded by autograd.
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        let src = src.expand(self.shape())?.detach();
        copy_into(self, &src)
    }
}

/// Writes the elements of `src` into the (possibly strided) view `dst`.
pub(crate) fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.shape() != src.shape() {
        return Err(Error::ShapeMismatch {
            op: "copy",
            lhs: dst.shape().to_vec(),
            rhs: src.shape().to_vec(),
        });
    }
    let _p = crate::profile::scope("copy_into");
    #[cfg(feature = "cuda")]
    if matches!(dst.device(), crate::Device::Cuda(_)) {
        return crate::cuda::copy_into(dst, src);
    }
    // A GPU source comes to the host first (a host destination).
    let src = &src.to_device(crate::Device::Cpu)?;
    // Convert (and detach from shared storage) first, then scatter by index.
    let vals = src.materialize(dst.dtype());
    let v = vals.storage();
    let bytes = dst.dtype().size_in_bytes();
    let src_bytes = v.as_bytes();
    let mut guard = dst.storage_mut();
    let dst_bytes = guard.as_bytes_mut();
    let (shape, strides) = (dst.shape(), dst.layout().strides());
    let rank = shape.len();
    if rank >= 1 && strides[rank - 1] == 1 && shape[rank - 1] >= 8 {
        // Rows contiguous in the destination (a slice of a KV cache, a narrowed block): copy
        // whole rows instead of element by element.
        let row = shape[rank - 1] * bytes;
        let outer = crate::layout::Layout::from_parts(
            shape[..rank - 1].to_vec(),
            strides[..rank - 1].to_vec(),
            dst.layout().offset(),
        );
        let mut k = 0;
        outer.for_each_index(|i| {
            dst_bytes[i * bytes..i * bytes + row].copy_from_slice(&src_bytes[k..k + row]);
            k += row;
        });
        return Ok(());
    }
    let mut k = 0;
    dst.layout().for_each_index(|i| {
        dst_bytes[i * bytes..(i + 1) * bytes]
            .copy_from_slice(&src_bytes[k * bytes..(k + 1) * bytes]);
        k += 1;
    });
    if k != dst.numel() {
        return Err(invalid("copy", "layout visited a wrong number of elements"));
    }
    Ok(())
}
