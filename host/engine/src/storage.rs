//! Typed views over allocator buffers, and dtype conversion of strided data.

use crate::alloc::Buffer;
use crate::dtype::{DType, Element};
use crate::layout::Layout;
use half::{bf16, f16};
use rayon::prelude::*;

/// Device memory behind a storage (a CUDA allocation); uninhabited without the `cuda` feature.
#[cfg(feature = "cuda")]
pub(crate) type DeviceMem = crate::cuda::DeviceBuffer;
/// Device memory behind a storage; uninhabited without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) enum DeviceMem {}

/// The memory behind one or more tensors: a buffer and the dtype of its elements.
pub struct Storage {
    /// `None` once released ([`Storage::release`]): the shape and dtype stay, the memory goes.
    /// Also `None` for a storage on a GPU, whose memory is `device`.
    buf: Option<Buffer>,
    /// The device memory of a storage that lives on a GPU (`None` for host storage).
    device: Option<DeviceMem>,
    dtype: DType,
    len: usize,
    /// How many times a tensor took this storage for writing (see [`Storage::writes`]).
    writes: u64,
    /// A host copy of a GPU storage's values ([`Storage::with_mirror`]), dropped at the first
    /// write: host reads of small integer tensors uploaded from the host (token ids, targets)
    /// then need no device round trip.
    mirror: Option<Box<Storage>>,
}

impl Storage {
    /// `len` zeroed elements of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Storage {
        Storage {
            buf: Some(Buffer::zeroed(len * dtype.size_in_bytes())),
            dtype,
            len,
            writes: 0,
            device: None,
            mirror: None,
        }
    }

    /// `len` elements with unspecified values, for kernels that write every element.
    pub fn any(dtype: DType, len: usize) -> Storage {
        Storage {
            buf: Some(Buffer::any(len * dtype.size_in_bytes())),
            dtype,
            len,
            writes: 0,
            device: None,
            mirror: None,
        }
    }

    /// A copy of `data`.
    pub fn from_slice<T: Element>(data: &[T]) -> Storage {
        let mut s = Storage::any(T::DTYPE, data.len());
        s.as_mut_slice::<T>().copy_from_slice(data);
        s
    }

    /// Raw bytes of `dtype`; `bytes.len()` must be a multiple of the element size.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Storage {
        let len = bytes.len() / dtype.size_in_bytes();
        let mut s = Storage::any(dtype, len);
        s.as_bytes_mut()
            .copy_from_slice(&bytes[..len * dtype.size_in_bytes()]);
        s
    }

    /// A storage of `len` elements of `dtype` in device memory (the CUDA backend's tensors).
    pub(crate) fn on_device(mem: DeviceMem, dtype: DType, len: usize) -> Storage {
        Storage {
            buf: None,
            dtype,
            len,
            writes: 0,
            device: Some(mem),
            mirror: None,
        }
    }

    /// This GPU storage with `host`, a host storage holding the same values, kept beside it
    /// until the first write (which drops it): a host read of the values (`to_vec`, an index
    /// check, a loss mask) is then served from `host` without a copy back from the device or
    /// waiting for the device's queue.
    pub(crate) fn with_mirror(mut self, host: Storage) -> Storage {
        debug_assert!(host.device.is_none() && host.len == self.len && host.dtype == self.dtype);
        self.mirror = Some(Box::new(host));
        self
    }

    /// The host copy of a GPU storage's values, while no write has happened since it was taken.
    pub(crate) fn mirror(&self) -> Option<&Storage> {
        self.mirror.as_deref()
    }

    /// The device memory, for a storage that lives on a GPU.
    pub(crate) fn device_mem(&self) -> Option<&DeviceMem> {
        self.device.as_ref()
    }

    /// A count that changes whenever a tensor takes this storage for writing, so a copy derived
    /// from it (a packed matrix operand) can tell whether it is still current.
    pub(crate) fn writes(&self) -> u64 {
        self.writes
    }

    /// Records a write access (called by [`crate::Tensor`] when it locks the storage for writing).
    pub(crate) fn note_write(&mut self) {
        self.writes = self.writes.wrapping_add(1);
        self.mirror = None;
    }

    /// Frees the memory, keeping the dtype and length: what FSDP does to a block's gathered
    /// parameters between its forward and its backward, while the graph still holds tensors
    /// over them. Reading a released storage is a bug and panics (see [`Storage::as_bytes`]);
    /// [`Storage::restore`] gives it values again.
    pub(crate) fn release(&mut self) {
        self.buf = None;
        self.device = None;
        // Copies derived from the old values (packed operands) must never be taken as current.
        self.note_write();
    }

    /// Whether [`Storage::release`] freed the memory (and no restore followed).
    pub fn is_released(&self) -> bool {
        self.buf.is_none() && self.device.is_none()
    }

    /// Gives a storage new memory holding `bytes` (exactly its length in its dtype); counts as a
    /// write, so a packed copy of the values before the release is never reused.
    pub(crate) fn restore(&mut self, bytes: &[u8]) {
        let mut buf = Buffer::any(self.len * self.dtype.size_in_bytes());
        buf.as_bytes_mut().copy_from_slice(bytes);
        self.buf = Some(buf);
        self.note_write();
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// [`Storage::restore`] for a storage on a GPU: its new device memory, already holding
    /// the values; counts as a write.
    pub(crate) fn restore_on_device(&mut self, mem: DeviceMem) {
        self.device = Some(mem);
        self.note_write();
    }

    fn buf(&self) -> &Buffer {
        assert!(
            self.device.is_none(),
            "host read of a GPU storage: copy the tensor to the CPU first (Tensor::to_device)"
        );
        self.buf
            .as_ref()
            .expect("read of a released storage: restore it before any op uses it")
    }

    fn buf_mut(&mut self) -> &mut Buffer {
        assert!(
            self.device.is_none(),
            "host write to a GPU storage: copy the tensor to the CPU first (Tensor::to_device)"
        );
        self.buf
            .as_mut()
            .expect("write to a released storage: restore it before any op uses it")
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The raw bytes. Panics on a released storage: every access goes through here or
    /// [`Storage::as_bytes_mut`], so a released tensor can never be read as stale or zero values.
    pub fn as_bytes(&self) -> &[u8] {
        self.buf().as_bytes()
    }

    /// The raw bytes, mutably (panics on a released storage, as [`Storage::as_bytes`]).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.buf_mut().as_bytes_mut()
    }

    /// The elements as `T`, which must be this storage's dtype.
    pub fn as_slice<T: Element>(&self) -> &[T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "storage accessed with the wrong element type"
        );
        bytemuck::cast_slice(self.as_bytes())
    }

    /// The elements as `T`, mutably.
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "storage accessed with the wrong element type"
        );
        bytemuck::cast_slice_mut(self.as_bytes_mut())
    }
}

/// Converts a contiguous run with the vectorized kernels where they exist (f32 ↔ bf16, the
/// mixed-precision casts); `false` when this pair of types has none.
fn convert_run<S: Element, D: Element>(src: &[S], dst: &mut [D]) -> bool {
    use crate::cpu::convert::{bf16_to_f32, f32_to_bf16};
    match (S::DTYPE, D::DTYPE) {
        (DType::F32, DType::BF16) => {
            f32_to_bf16(bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst))
        }
        (DType::BF16, DType::F32) => {
            bf16_to_f32(bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst))
        }
        _ => return false,
    }
    true
}

/// Copies the elements of `layout` over `src` into `dst` in row-major order, converting types.
pub(crate) fn gather_into<S: Element, D: Element>(src: &[S], layout: &Layout, dst: &mut [D]) {
    debug_assert_eq!(dst.len(), layout.numel());
    let conv = |s: S| -> D {
        if D::DTYPE.is_float() {
            D::from_f32(s.to_f32())
        } else {
            D::from_i64(s.to_i64())
        }
    };
    if let Some((a, b)) = layout.contiguous_range() {
        if S::DTYPE == D::DTYPE {
            dst.copy_from_slice(bytemuck::cast_slice(&src[a..b]));
        } else {
            dst.par_chunks_mut(1 << 14)
                .zip(src[a..b].par_chunks(1 << 14))
                .for_each(|(d, s)| {
                    if !convert_run(s, d) {
                        d.iter_mut().zip(s).for_each(|(d, &s)| *d = conv(s))
                    }
                });
        }
        return;
    }
    let shape = layout.shape();
    let rank = shape.len();
    // A converting copy with a contiguous innermost dim: whole rows through the vectorized
    // conversion.
    if S::DTYPE != D::DTYPE
        && rank >= 2
        && layout.strides()[rank - 1] == 1
        && shape[rank - 1] >= 16
        && convert_run::<S, D>(&[], &mut [])
    {
        let inner = shape[rank - 1];
        let outer = Layout::from_parts(
            shape[..rank - 1].to_vec(),
            layout.strides()[..rank - 1].to_vec(),
            layout.offset(),
        );
        let mut starts = Vec::with_capacity(layout.numel() / inner);
        outer.for_each_index(|i| starts.push(i));
        let rows_per_task = ((1 << 14) / inner).max(1);
        dst.par_chunks_mut(inner * rows_per_task)
            .zip(starts.par_chunks(rows_per_task))
            .for_each(|(d, starts)| {
                for (row, &s) in d.chunks_mut(inner).zip(starts) {
                    convert_run(&src[s..s + inner], row);
                }
            });
        return;
    }
    // Same dtype with a contiguous innermost dim (transposed heads, narrowed rows): copy whole
    // rows with memcpy instead of element by element.
    if S::DTYPE == D::DTYPE && rank >= 2 && layout.strides()[rank - 1] == 1 && shape[rank - 1] >= 8
    {
        let inner = shape[rank - 1];
        let outer = Layout::from_parts(
            shape[..rank - 1].to_vec(),
            layout.strides()[..rank - 1].to_vec(),
            layout.offset(),
        );
        let mut starts = Vec::with_capacity(layout.numel() / inner);
        outer.for_each_index(|i| starts.push(i));
        let src: &[D] = bytemuck::cast_slice(src);
        let rows_per_task = ((1 << 14) / inner).max(1);
        dst.par_chunks_mut(inner * rows_per_task)
            .zip(starts.par_chunks(rows_per_task))
            .for_each(|(d, starts)| {
                for (row, &s) in d.chunks_mut(inner).zip(starts) {
                    row.copy_from_slice(&src[s..s + inner]);
                }
            });
        return;
    }
    // Parallelize over the outermost dim; each slice of it fills its own run of `dst`.
    if layout.numel() >= 1 << 15 && shape[0] > 1 {
        let per = layout.numel() / shape[0];
        dst.par_chunks_mut(per).enumerate().for_each(|(i, d)| {
            let sub = layout.narrow(0, i, 1).expect("index within dim 0");
            let mut k = 0;
            sub.for_each_index(|idx| {
                d[k] = conv(src[idx]);
                k += 1;
            });
        });
        return;
    }
    let mut k = 0;
    layout.for_each_index(|idx| {
        dst[k] = conv(src[idx]);
        k += 1;
    });
}

/// Dispatches `gather_into` over the runtime dtypes of `src` and `dst`.
pub(crate) fn gather_dyn(src: &Storage, layout: &Layout, dst: &mut Storage) {
    macro_rules! with_dst {
        ($s:ty) => {
            match dst.dtype() {
                DType::F32 => gather_into::<$s, f32>(src.as_slice(), layout, dst.as_mut_slice()),
                DType::BF16 => gather_into::<$s, bf16>(src.as_slice(), layout, dst.as_mut_slice()),
                DType::F16 => gather_into::<$s, f16>(src.as_slice(), layout, dst.as_mut_slice()),
                DType::I32 => gather_into::<$s, i32>(src.as_slice(), layout, dst.as_mut_slice()),
                DType::I64 => gather_into::<$s, i64>(src.as_slice(), layout, dst.as_mut_slice()),
            }
        };
    }
    match src.dtype() {
        DType::F32 => with_dst!(f32),
        DType::BF16 => with_dst!(bf16),
        DType::F16 => with_dst!(f16),
        DType::I32 => with_dst!(i32),
        DType::I64 => with_dst!(i64),
    }
}
