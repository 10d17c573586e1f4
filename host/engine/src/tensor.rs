//! `Tensor`: shared storage + layout + dtype + device, plus its place in the autograd graph.

use crate::autograd::{self, GradHook, LeafGrad, Node};
use crate::dtype::{DType, Element};
use crate::error::{invalid, Error, Result};
use crate::layout::Layout;
use crate::storage::{gather_dyn, Storage};
use crate::Device;
use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Where a tensor sits in the autograd graph.
#[derive(Clone)]
pub(crate) enum GradMeta {
    /// Not tracked.
    None,
    /// A leaf that accumulates a gradient (a parameter, or an input asked to require grad).
    Leaf(Arc<LeafGrad>),
    /// The output of a recorded op.
    Node(Arc<Node>),
}

pub(crate) struct TensorImpl {
    id: u64,
    storage: Arc<RwLock<Storage>>,
    layout: Layout,
    dtype: DType,
    device: Device,
    grad: GradMeta,
}

/// An n-dimensional array. Cloning is cheap (a reference count); views share storage.
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorImpl>);

impl Tensor {
    /// Wraps a storage with a layout (no autograd).
    pub(crate) fn from_parts(
        storage: Arc<RwLock<Storage>>,
        layout: Layout,
        device: Device,
    ) -> Tensor {
        let dtype = storage.read().expect("storage lock poisoned").dtype();
        debug_assert!(layout.storage_extent() <= storage.read().expect("poisoned").len());
        Tensor(Arc::new(TensorImpl {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            storage,
            layout,
            dtype,
            device,
            grad: GradMeta::None,
        }))
    }

    /// A contiguous CPU tensor owning `storage`.
    pub fn from_storage(storage: Storage, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if n != storage.len() {
            return Err(invalid(
                "from_storage",
                format!(
                    "shape {shape:?} needs {n} elements, storage has {}",
                    storage.len()
                ),
            ));
        }
        Ok(Tensor::from_parts(
            Arc::new(RwLock::new(storage)),
            Layout::contiguous(shape),
            Device::Cpu,
        ))
    }

    /// A tensor sharing this one's storage with another layout, and the given autograd meta.
    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor::from_parts(self.0.storage.clone(), layout, self.0.device)
    }

    pub(crate) fn with_grad_meta(self, grad: GradMeta) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            id: self.0.id,
            storage: self.0.storage.clone(),
            layout: self.0.layout.clone(),
            dtype: self.0.dtype,
            device: self.0.device,
            grad,
        }))
    }

    /// A tensor holding a copy of `data` with `shape`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_storage(Storage::from_slice(data), shape)
    }

    /// A tensor taking `data` with `shape`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_slice(&data, shape)
    }

    /// A 0-dimensional f32 tensor.
    pub fn scalar(v: f32) -> Tensor {
        Tensor::from_storage(Storage::from_slice(&[v]), &[]).expect("one element for rank 0")
    }

    /// Zeros of `shape` and `dtype`.
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_storage(Storage::zeros(dtype, n), shape).expect("sized to fit")
    }

    /// Zeros of `shape` and `dtype` allocated on `device` (on a GPU without a host copy).
    pub fn zeros_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        match device {
            Device::Cpu => Ok(Tensor::zeros(shape, dtype)),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => crate::cuda::zeros_on(shape, dtype, n),
            #[cfg(not(feature = "cuda"))]
            d => Tensor::zeros(shape, dtype).to_device(d),
        }
    }

    /// `value` everywhere, in `shape` and `dtype`.
    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = Storage::any(dtype, n);
        match dtype {
            DType::F32 => s.as_mut_slice::<f32>().fill(value as f32),
            DType::BF16 => s
                .as_mut_slice::<half::bf16>()
                .fill(half::bf16::from_f64(value)),
            DType::F16 => s
                .as_mut_slice::<half::f16>()
                .fill(half::f16::from_f64(value)),
            DType::I32 => s.as_mut_slice::<i32>().fill(value as i32),
            DType::I64 => s.as_mut_slice::<i64>().fill(value as i64),
        }
        Tensor::from_storage(s, shape).expect("sized to fit")
    }

    /// Ones of `shape` and `dtype`.
    pub fn ones(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::full(shape, 1.0, dtype)
    }

    /// Zeros with this tensor's shape and dtype.
    pub fn zeros_like(&self) -> Tensor {
        Tensor::zeros(self.shape(), self.dtype())
    }

    /// Ones with this tensor's shape and dtype.
    pub fn ones_like(&self) -> Tensor {
        Tensor::ones(self.shape(), self.dtype())
    }

    /// `0, 1, ..., n-1` as a 1-d tensor of `dtype`.
    pub fn arange(n: usize, dtype: DType) -> Tensor {
        let v: Vec<i64> = (0..n as i64).collect();
        Tensor::from_slice(&v, &[n])
            .expect("sized to fit")
            .to_dtype(dtype)
            .expect("i64 casts to every dtype")
    }

    /// A unique id (views and clones share their source's storage but not this id, except
    /// [`Tensor::clone`], which is the same tensor).
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The size of every dimension.
    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.layout.rank()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }

    /// Size of one dim (negative counts from the end).
    pub fn dim(&self, dim: isize) -> Result<usize> {
        let d = crate::layout::resolve_dim("dim", dim, self.rank())?;
        Ok(self.shape()[d])
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// The device holding the storage.
    pub fn device(&self) -> Device {
        self.0.device
    }

    /// Shape, strides and offset.
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }

    /// True when the elements are row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }

    /// This tensor detached, when it is the only reference to a storage it covers exactly
    /// (contiguous, from offset 0): then in-place updates cannot be seen through any other
    /// tensor. Otherwise gives the tensor back.
    pub(crate) fn into_exclusive(self) -> std::result::Result<Tensor, Tensor> {
        let whole = self.layout().contiguous_range() == Some((0, self.storage().len()));
        if whole && Arc::strong_count(&self.0) == 1 && Arc::strong_count(&self.0.storage) == 1 {
            Ok(Tensor::from_parts(
                self.0.storage.clone(),
                self.0.layout.clone(),
                self.0.device,
            ))
        } else {
            Err(self)
        }
    }

    /// Identifies the storage behind this tensor (equal for tensors that share it).
    pub(crate) fn storage_id(&self) -> usize {
        Arc::as_ptr(&self.0.storage) as usize
    }

    /// True when two tensors share storage.
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    /// Frees the memory behind this tensor (and every view and clone sharing its storage),
    /// keeping shapes and dtype: FSDP frees a block's gathered parameters after its forward while
    /// the graph's saved tensors still point at them, and [`Tensor::restore_storage`] fills them
    /// again before the block's backward. Any read or write of a released tensor panics.
    pub fn release_storage(&self) {
        self.0
            .storage
            .write()
            .expect("storage lock poisoned")
            .release();
    }

    /// Whether this tensor's storage was released ([`Tensor::release_storage`]) and not restored.
    pub fn is_released(&self) -> bool {
        self.storage().is_released()
    }

    /// Gives a released storage back its values, in place (every tensor sharing it sees them):
    /// `values` must hold exactly the storage's elements, in its dtype. Counts as a write.
    pub fn restore_storage(&self, values: &Tensor) -> Result<()> {
        if self.shares_storage_with(values) {
            return Err(invalid(
                "restore_storage",
                "the values share the storage being restored",
            ));
        }
        let mut guard = self.0.storage.write().expect("storage lock poisoned");
        if !guard.is_released() {
            return Err(invalid(
                "restore_storage",
                "the storage was not released (restoring would overwrite live values)",
            ));
        }
        if values.numel() != guard.len() || values.dtype() != guard.dtype() {
            return Err(invalid(
                "restore_storage",
                format!(
                    "values of {} {} elements for a storage of {} {}",
                    values.numel(),
                    values.dtype(),
                    guard.len(),
                    guard.dtype()
                ),
            ));
        }
        let mut bytes = Vec::with_capacity(values.numel() * values.dtype().size_in_bytes());
        values.copy_bytes_into(&mut bytes);
        match self.device() {
            Device::Cpu => guard.restore(&bytes),
            // A GPU tensor's storage gets device memory again (FSDP's re-gathered block on a
            // GPU rank), never host memory its kernels cannot read.
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => guard.restore_on_device(crate::cuda::gpu(n)?.upload(&bytes)?),
            #[cfg(not(feature = "cuda"))]
            d @ Device::Cuda(_) => {
                return Err(crate::Error::DeviceUnavailable {
                    device: d,
                    reason: "this build has no CUDA backend".into(),
                })
            }
        }
        Ok(())
    }

    pub(crate) fn storage(&self) -> RwLockReadGuard<'_, Storage> {
        self.0.storage.read().expect("storage lock poisoned")
    }

    pub(crate) fn storage_mut(&self) -> RwLockWriteGuard<'_, Storage> {
        let mut guard = self.0.storage.write().expect("storage lock poisoned");
        guard.note_write();
        guard
    }

    /// The shared storage cell itself (for caches keyed by storage identity).
    pub(crate) fn storage_cell(&self) -> &Arc<RwLock<Storage>> {
        &self.0.storage
    }

    pub(crate) fn grad_meta(&self) -> &GradMeta {
        &self.0.grad
    }

    /// The elements in row-major order as `T`, converting from this tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Vec<T> {
        self.contig::<T>().to_vec()
    }

    /// The elements as f32, whatever the dtype.
    pub fn to_vec_f32(&self) -> Vec<f32> {
        self.to_vec::<f32>()
    }

    /// The elements' raw little-endian bytes in row-major order, in their own dtype: one copy
    /// (a snapshot for checkpoints, independent of later in-place updates).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.copy_bytes_into(&mut out);
        out
    }

    /// [`Tensor::to_bytes`] into `out` (cleared first), reusing its capacity: a repeated snapshot
    /// into the same buffer is a plain memcpy, without page faults.
    pub fn copy_bytes_into(&self, out: &mut Vec<u8>) {
        out.clear();
        let size = self.dtype().size_in_bytes();
        #[cfg(feature = "cuda")]
        if matches!(self.device(), Device::Cuda(_)) {
            // A GPU tensor (a checkpoint of a GPU run): one download of its elements.
            let host = self
                .to_device(Device::Cpu)
                .unwrap_or_else(|e| panic!("reading a GPU tensor on the host failed: {e}"));
            out.extend_from_slice(host.storage().as_bytes());
            return;
        }
        if let Some((a, b)) = self.layout().contiguous_range() {
            out.extend_from_slice(&self.storage().as_bytes()[a * size..b * size]);
        } else {
            out.extend_from_slice(self.materialize(self.dtype()).storage().as_bytes());
        }
    }

    /// Whether reading this tensor's values on the host costs no device round trip: a CPU
    /// tensor, or a GPU one uploaded from host values that nothing has written since (its host
    /// copy, [`Storage::with_mirror`]). Checks that need values run only then, so a step never
    /// waits for the device to validate indices the device computed itself.
    pub(crate) fn host_resident(&self) -> bool {
        if self.device() == Device::Cpu {
            return true;
        }
        #[cfg(feature = "cuda")]
        if self.storage().mirror().is_some() {
            return true;
        }
        false
    }

    /// The single value of a one-element tensor, as f32.
    pub fn item(&self) -> Result<f32> {
        if self.numel() != 1 {
            return Err(invalid(
                "item",
                format!("tensor of shape {:?} is not a single value", self.shape()),
            ));
        }
        Ok(self.to_vec_f32()[0])
    }

    /// Row-major elements as `T`: borrowed when already contiguous and of type `T`, else a
    /// converted copy.
    pub(crate) fn contig<T: Element>(&self) -> Contig<'_, T> {
        let guard = self.storage();
        #[cfg(feature = "cuda")]
        if let Some(host) = guard.mirror() {
            // A GPU tensor uploaded from host values nothing has written since: read there.
            let mut out = Storage::any(T::DTYPE, self.numel());
            gather_dyn(host, self.layout(), &mut out);
            return Contig::Owned(out, std::marker::PhantomData);
        }
        #[cfg(feature = "cuda")]
        if guard.device_mem().is_some() {
            // A GPU tensor read on the host (`to_vec`, checks): one download of its storage.
            let host = crate::cuda::download_storage(&guard)
                .unwrap_or_else(|e| panic!("reading a GPU tensor on the host failed: {e}"));
            let mut out = Storage::any(T::DTYPE, self.numel());
            gather_dyn(&host, self.layout(), &mut out);
            return Contig::Owned(out, std::marker::PhantomData);
        }
        if T::DTYPE == self.dtype() {
            if let Some((a, b)) = self.layout().contiguous_range() {
                return Contig::Borrowed(guard, a, b, std::marker::PhantomData);
            }
        }
        let _p = crate::profile::scope("copy");
        let mut out = Storage::any(T::DTYPE, self.numel());
        gather_dyn(&guard, self.layout(), &mut out);
        Contig::Owned(out, std::marker::PhantomData)
    }

    /// A contiguous copy with a fresh storage of `dtype` (no autograd).
    pub(crate) fn materialize(&self, dtype: DType) -> Tensor {
        let _p = crate::profile::scope("copy");
        #[cfg(feature = "cuda")]
        if matches!(self.device(), Device::Cuda(_)) {
            return crate::cuda::materialize(self, dtype)
                .unwrap_or_else(|e| panic!("copying a GPU tensor failed: {e}"));
        }
        let guard = self.storage();
        let mut out = Storage::any(dtype, self.numel());
        gather_dyn(&guard, self.layout(), &mut out);
        drop(guard);
        Tensor::from_storage(out, self.shape()).expect("sized to fit")
    }

    /// This tensor when it already holds f32 (same layout, no copy; broadcast views stay views),
    /// else a contiguous f32 copy. Kernels that read f32 in place start from this.
    pub(crate) fn f32_or_converted(&self) -> Tensor {
        if self.dtype() == DType::F32 {
            self.detach()
        } else {
            self.materialize(DType::F32)
        }
    }

    /// A copy on `device` (no autograd): contiguous, in this tensor's dtype. The same device
    /// gives this tensor back.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.detach());
        }
        #[cfg(feature = "cuda")]
        {
            crate::cuda::to_device(self, device)
        }
        #[cfg(not(feature = "cuda"))]
        Err(Error::DeviceUnavailable {
            device,
            reason: "this build has no CUDA backend (the engine's `cuda` feature is off)".into(),
        })
    }

    /// Fails unless a backend for this tensor's device is built: the CPU, or a CUDA device
    /// with the `cuda` feature (whether that device can run is the backend lookup's question,
    /// which names what is missing).
    pub(crate) fn check_device(&self, op: &'static str) -> Result<()> {
        match self.device() {
            Device::Cpu => Ok(()),
            Device::Cuda(_) if cfg!(feature = "cuda") => Ok(()),
            d => Err(Error::DeviceUnavailable {
                device: d,
                reason: format!("{op}: this build has no CUDA backend"),
            }),
        }
    }

    // ---- autograd ----

    /// True when gradients flow to or through this tensor.
    pub fn requires_grad(&self) -> bool {
        !matches!(self.0.grad, GradMeta::None)
    }

    /// This tensor as a leaf that accumulates a gradient (the way parameters are made).
    pub fn requires_grad_(self) -> Tensor {
        if let GradMeta::Leaf(_) = self.0.grad {
            return self;
        }
        self.with_grad_meta(GradMeta::Leaf(Arc::new(LeafGrad::default())))
    }

    /// The same values, cut from the graph.
    pub fn detach(&self) -> Tensor {
        self.with_layout(self.layout().clone())
    }

    /// True for tracked leaves (parameters).
    pub fn is_leaf(&self) -> bool {
        matches!(self.0.grad, GradMeta::Leaf(_))
    }

    /// The accumulated gradient of a leaf.
    pub fn grad(&self) -> Option<Tensor> {
        match &self.0.grad {
            GradMeta::Leaf(l) => l.grad(),
            _ => None,
        }
    }

    /// Replaces (or clears, with `None`) the accumulated gradient of a leaf.
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        match &self.0.grad {
            GradMeta::Leaf(l) => {
                l.set_grad(grad);
                Ok(())
            }
            _ => Err(invalid(
                "set_grad",
                "only leaves that require grad hold a gradient",
            )),
        }
    }

    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        if let GradMeta::Leaf(l) = &self.0.grad {
            l.set_grad(None);
        }
    }

    /// Calls `hook` with the gradient each time this leaf's gradient for a backward pass is final.
    pub fn register_grad_hook(&self, hook: GradHook) -> Result<()> {
        match &self.0.grad {
            GradMeta::Leaf(l) => {
                l.add_hook(hook);
                Ok(())
            }
            _ => Err(invalid(
                "register_grad_hook",
                "hooks attach to leaves that require grad",
            )),
        }
    }

    /// Backpropagates from this scalar (a gradient of 1).
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(invalid(
                "backward",
                format!(
                    "needs a single-value tensor, got shape {:?}; use backward_with",
                    self.shape()
                ),
            ));
        }
        // The seed lives where the graph does, so a GPU loss backpropagates on the GPU.
        let seed = Tensor::ones(self.shape(), self.dtype()).to_device(self.device())?;
        autograd::backward(self, seed)
    }

    /// Backpropagates `grad` (the gradient of some objective with respect to this tensor).
    pub fn backward_with(&self, grad: Tensor) -> Result<()> {
        autograd::backward(self, grad)
    }

    /// The first half of a split backward (zero-bubble pipelines): backpropagates `grad` only
    /// as far as the leaves `now` need (their gradients are final on return) and returns the
    /// rest, the other leaves' (weights') gradients, to [`autograd::WeightGrads::run`] later.
    /// Together the two halves give each leaf bitwise what [`Tensor::backward_with`] would.
    pub fn backward_split(&self, grad: Tensor, now: &[&Tensor]) -> Result<autograd::WeightGrads> {
        autograd::split::backward_split(self, grad, now)
    }
}

/// Row-major elements of a tensor, borrowed or converted.
pub(crate) enum Contig<'a, T> {
    Borrowed(
        RwLockReadGuard<'a, Storage>,
        usize,
        usize,
        std::marker::PhantomData<T>,
    ),
    Owned(Storage, std::marker::PhantomData<T>),
}

impl<T: Element> Deref for Contig<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Contig::Borrowed(g, a, b, _) => &g.as_slice::<T>()[*a..*b],
            Contig::Owned(s, _) => s.as_slice::<T>(),
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let vals = self.to_vec_f32();
        let shown: Vec<f32> = vals.iter().take(8).copied().collect();
        write!(
            f,
            "Tensor(shape={:?}, dtype={}, device={}, values={:?}{})",
            self.shape(),
            self.dtype(),
            self.device(),
            shown,
            if vals.len() > 8 { " ..." } else { "" }
        )
    }
}
