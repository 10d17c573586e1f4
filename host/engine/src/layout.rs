//! Shapes, strides and offsets: the arithmetic behind free views.

use crate::error::{Error, Result};

/// How a tensor's elements are laid out in its storage (in elements, not bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of a shape.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i];
    }
    strides
}

/// Resolves a possibly negative dim against a rank.
pub fn resolve_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    let d = if dim < 0 { dim + rank as isize } else { dim };
    if d < 0 || d >= rank as isize {
        return Err(Error::DimOutOfRange { op, dim, rank });
    }
    Ok(d as usize)
}

/// The shape two operands broadcast to (NumPy rules), or a mismatch error naming both.
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::ShapeMismatch {
                    op,
                    lhs: a.to_vec(),
                    rhs: b.to_vec(),
                })
            }
        };
    }
    Ok(out)
}

impl Layout {
    /// A contiguous row-major layout at offset 0.
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// A layout from explicit parts (the caller guarantees it fits its storage).
    pub fn from_parts(shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Layout {
        debug_assert_eq!(shape.len(), strides.len());
        Layout {
            shape,
            strides,
            offset,
        }
    }

    /// The size of every dimension.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The step, in elements, of every dimension.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The storage index of element zero.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when elements are laid out row-major with no gaps (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for i in (0..self.shape.len()).rev() {
            if self.shape[i] != 1 && self.strides[i] != acc {
                return false;
            }
            acc *= self.shape[i];
        }
        true
    }

    /// The storage range `[start, end)` of a contiguous layout.
    pub fn contiguous_range(&self) -> Option<(usize, usize)> {
        self.is_contiguous()
            .then(|| (self.offset, self.offset + self.numel()))
    }

    /// One past the largest storage index this layout touches (0 for empty tensors).
    pub fn storage_extent(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        self.offset
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(&n, &s)| (n - 1) * s)
                .sum::<usize>()
            + 1
    }

    /// A view of `len` elements of `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Layout> {
        if start + len > self.shape[dim] {
            return Err(crate::error::invalid(
                "narrow",
                format!(
                    "range {start}..{} exceeds size {} of dim {dim} in shape {:?}",
                    start + len,
                    self.shape[dim],
                    self.shape
                ),
            ));
        }
        let mut out = self.clone();
        out.offset += start * self.strides[dim];
        out.shape[dim] = len;
        Ok(out)
    }

    /// The dims reordered by `perm`.
    pub fn permute(&self, perm: &[usize]) -> Result<Layout> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if perm.len() != rank
            || perm
                .iter()
                .any(|&p| p >= rank || std::mem::replace(&mut seen[p], true))
        {
            return Err(crate::error::invalid(
                "permute",
                format!(
                    "{perm:?} is not a permutation of the dims of shape {:?}",
                    self.shape
                ),
            ));
        }
        Ok(Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        })
    }

    /// A view with `shape`, if the elements can be reached without copying.
    ///
    /// Works dim-group by dim-group: each run of old dims that merges into a run of new dims must be
    /// internally contiguous.
    pub fn reshape(&self, shape: &[usize]) -> Option<Layout> {
        if shape.iter().product::<usize>() != self.numel() {
            return None;
        }
        if self.is_contiguous() {
            return Some(Layout {
                shape: shape.to_vec(),
                strides: contiguous_strides(shape),
                offset: self.offset,
            });
        }
        // Walk old dims from the innermost, cutting them into chunks that are contiguous within
        // themselves; each chunk must map onto a run of new dims with the same element count.
        let (old_shape, old_strides) = (&self.shape, &self.strides);
        let mut strides = vec![0usize; shape.len()];
        let mut view_d = shape.len() as isize - 1;
        let mut chunk_base = *old_strides.last()?;
        let (mut tensor_numel, mut view_numel) = (1usize, 1usize);
        for d in (0..old_shape.len()).rev() {
            tensor_numel *= old_shape[d];
            let chunk_ends = d == 0
                || (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base);
            if chunk_ends {
                while view_d >= 0 && (view_numel < tensor_numel || shape[view_d as usize] == 1) {
                    strides[view_d as usize] = view_numel * chunk_base;
                    view_numel *= shape[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if d > 0 {
                    chunk_base = old_strides[d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        if view_d != -1 {
            return None;
        }
        Some(Layout {
            shape: shape.to_vec(),
            strides,
            offset: self.offset,
        })
    }

    /// A broadcast view to `shape` (stride 0 on expanded dims); new leading dims are allowed.
    pub fn expand(&self, shape: &[usize]) -> Result<Layout> {
        let err = || Error::ShapeMismatch {
            op: "expand",
            lhs: self.shape.clone(),
            rhs: shape.to_vec(),
        };
        if shape.len() < self.rank() {
            return Err(err());
        }
        let lead = shape.len() - self.rank();
        let mut strides = vec![0; shape.len()];
        for (i, &n) in shape.iter().enumerate() {
            if i < lead {
                continue;
            }
            let (src_n, src_s) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = if src_n == n {
                src_s
            } else if src_n == 1 {
                0
            } else {
                return Err(err());
            };
        }
        Ok(Layout {
            shape: shape.to_vec(),
            strides,
            offset: self.offset,
        })
    }

    /// Inserts a size-1 dim at `dim`.
    pub fn unsqueeze(&self, dim: usize) -> Layout {
        let mut out = self.clone();
        let stride = if dim < self.rank() {
            self.strides[dim] * self.shape[dim]
        } else {
            1
        };
        out.shape.insert(dim, 1);
        out.strides.insert(dim, stride);
        out
    }

    /// Removes dim `dim`, which must have size 1.
    pub fn squeeze(&self, dim: usize) -> Result<Layout> {
        if self.shape[dim] != 1 {
            return Err(crate::error::invalid(
                "squeeze",
                format!(
                    "dim {dim} of shape {:?} has size {}, not 1",
                    self.shape, self.shape[dim]
                ),
            ));
        }
        let mut out = self.clone();
        out.shape.remove(dim);
        out.strides.remove(dim);
        Ok(out)
    }

    /// Visits the storage index of every element in row-major order.
    pub fn for_each_index(&self, mut f: impl FnMut(usize)) {
        let n = self.numel();
        if n == 0 {
            return;
        }
        let rank = self.rank();
        if rank == 0 {
            f(self.offset);
            return;
        }
        let inner = self.shape[rank - 1];
        let inner_stride = self.strides[rank - 1];
        let mut idx = vec![0usize; rank];
        let mut base = self.offset;
        loop {
            for k in 0..inner {
                f(base + k * inner_stride);
            }
            // Advance the outer multi-index.
            let mut d = rank - 1;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                base += self.strides[d];
                if idx[d] < self.shape[d] {
                    break;
                }
                base -= self.strides[d] * self.shape[d];
                idx[d] = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn indices(l: &Layout) -> Vec<usize> {
        let mut v = vec![];
        l.for_each_index(|i| v.push(i));
        v
    }

    #[test]
    fn transpose_then_reshape_needs_copy_but_merging_contiguous_dims_does_not() {
        let l = Layout::contiguous(&[2, 3, 4]);
        let t = l.permute(&[1, 0, 2]).unwrap();
        assert!(!t.is_contiguous());
        // [3,2,4] -> [3,8]: dims 0 and 1 of t are not mergeable (stride 4 vs 12*...)
        assert!(t.reshape(&[6, 4]).is_none());
        // Split the last dim of a transposed view: fine.
        let r = t.reshape(&[3, 2, 2, 2]).unwrap();
        assert_eq!(indices(&r), indices(&t));
        // Merge trailing dims of a narrowed view.
        let n = l.narrow(0, 1, 1).unwrap();
        let r = n.reshape(&[12]).unwrap();
        assert_eq!(indices(&r), (12..24).collect::<Vec<_>>());
    }

    #[test]
    fn reshape_with_unit_dims() {
        let l = Layout::contiguous(&[4, 6]).permute(&[1, 0]).unwrap(); // [6,4], strides [1,6]
        let r = l.reshape(&[1, 6, 1, 4, 1]).unwrap();
        assert_eq!(indices(&r), indices(&l));
        let r = l.reshape(&[2, 3, 4]).unwrap();
        assert_eq!(indices(&r), indices(&l));
    }

    #[test]
    fn broadcast_rules() {
        assert_eq!(broadcast_shapes("add", &[3, 1], &[4]).unwrap(), vec![3, 4]);
        let e = broadcast_shapes("add", &[3, 2], &[4])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("add") && e.contains("[3, 2]") && e.contains("[4]"),
            "{e}"
        );
        let x = Layout::contiguous(&[3, 1]).expand(&[2, 3, 5]).unwrap();
        assert_eq!(x.strides(), &[0, 1, 0]);
    }
}
