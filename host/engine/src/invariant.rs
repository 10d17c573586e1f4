//! Batch-invariant mode: a sequence's results do not depend on what else is in the batch, or on
//! whether it is computed in one forward or token by token with a KV cache.
//!
//! Plain kernels may pick their code path by size (`gemm` has a separate path for one row, and
//! attention's tile products go through it), so the same row can round differently in a decode
//! step than in a full forward. In this mode every reduction a row goes through has a fixed
//! order that ignores the other rows. On CPUs with a packed kernel (AVX-512, or AVX2 + FMA)
//! that costs almost nothing: its products are row-independent by construction
//! (`cpu::sgemm`), attention scores each query on its own with a fixed lane tree and aligns
//! key blocks to position 0, and decode steps reuse packed weights. Elsewhere (no AVX2) matrix
//! products run on zero-padded 64-row tiles and attention on 64-aligned query and key blocks,
//! which costs padding work in decode. The gated delta rule's decode (`ops::DeltaRuleCache`)
//! reruns the chunked kernel over the tokens since the last 64-aligned state instead of the
//! recurrence, so a step sees the same chunks as a full forward.
//! On a GPU the products run on one FMA chain per element (`cuda/kernels/gemm.cu`,
//! the packed CPU kernel's bits for f32) instead of cuBLAS, and attention on the tiled kernel at
//! every key length. RL rollouts and the trainer's logprob pass turn the mode on.
//!
//! The flag is per thread (ops decide on the calling thread before they fan out).

use std::cell::Cell;

/// Rows per matrix-product tile and the block size attention aligns to in this mode.
pub const TILE: usize = 64;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
}

/// True when ops on this thread run batch-invariant.
pub fn batch_invariant() -> bool {
    ON.with(|c| c.get())
}

/// Restores the previous mode when dropped.
#[must_use = "the mode is restored when the guard is dropped"]
pub struct BatchInvariantGuard {
    prev: bool,
}

impl Drop for BatchInvariantGuard {
    fn drop(&mut self) {
        ON.with(|c| c.set(self.prev));
    }
}

/// Turns batch-invariant mode on or off on this thread until the guard drops.
pub fn set_batch_invariant(on: bool) -> BatchInvariantGuard {
    BatchInvariantGuard {
        prev: ON.with(|c| c.replace(on)),
    }
}
