//! Embedding lookup with a deterministic scatter-add backward.

use super::{fused, require_float};
use crate::autograd::record;
use crate::error::{invalid, Error, Result};
use crate::{DType, Tensor};

impl Tensor {
    /// Rows of this `[V, D]` weight at integer `ids` (i64 or i32, any shape): `ids.shape + [D]`.
    /// An id outside `0..V` is an [`Error::IndexOutOfRange`] naming `embedding`. The weight
    /// gradient sums the rows of repeated ids in position order (bitwise reproducible).
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        const OP: &str = "embedding";
        require_float(OP, self)?;
        self.check_device(OP)?;
        if self.rank() != 2 {
            return Err(invalid(
                OP,
                format!("weight must be [vocab, dim], got {:?}", self.shape()),
            ));
        }
        if !matches!(ids.dtype(), DType::I64 | DType::I32) {
            return Err(Error::DType {
                op: OP,
                got: ids.dtype(),
                expected: "i64 or i32 ids",
            });
        }
        let out = fused(self)?.embedding(&self.detach(), ids)?;
        Ok(record(OP, out, &[self], || {
            let (ids, vocab, dtype) = (ids.detach(), self.shape()[0], self.dtype());
            move |g: &Tensor| {
                Ok(vec![Some(
                    fused(g)?.embedding_backward(&ids, g, vocab, dtype)?,
                )])
            }
        }))
    }
}
