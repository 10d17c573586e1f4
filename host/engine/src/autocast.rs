//! Mixed precision: inside an autocast region, matrix products take their inputs in a lower
//! precision (bf16) and accumulate in f32, as PyTorch's `torch.autocast` does on the CPU.
//!
//! Only matrix products cast: their inputs are converted (a differentiable cast, so the
//! gradient reaching an f32 parameter is f32 again), the product runs on bf16 operands with
//! f32 sums and returns bf16. Every other op keeps the dtype it is given and computes in f32
//! internally, so bf16 activations flow from one product to the next while the residual
//! stream, norms' statistics, the loss and everything the optimizer sees stay f32. Master
//! weights and optimizer state are never touched.
//!
//! The mode is per thread (ops decide on the calling thread before they fan out), and
//! recompute regions replay their forward under the mode they first ran with.

use crate::DType;
use std::cell::Cell;

thread_local! {
    static DTYPE: Cell<Option<DType>> = const { Cell::new(None) };
}

/// The dtype matrix products cast to on this thread, if an autocast region is active.
pub fn autocast_dtype() -> Option<DType> {
    DTYPE.with(|d| d.get())
}

/// Restores the previous mode when dropped.
#[must_use = "the mode is restored when the guard is dropped"]
pub struct AutocastGuard {
    prev: Option<DType>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        DTYPE.with(|d| d.set(self.prev));
    }
}

/// Makes matrix products on this thread cast to `dtype` (a floating dtype; `None` or f32
/// turns autocast off) until the guard drops.
pub fn set_autocast(dtype: Option<DType>) -> AutocastGuard {
    let dtype = dtype.filter(|d| d.is_float() && *d != DType::F32);
    AutocastGuard {
        prev: DTYPE.with(|d| d.replace(dtype)),
    }
}
