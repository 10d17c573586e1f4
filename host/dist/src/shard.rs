//! Dim-0 sharding, the layout FSDP keeps parameters, gradients and optimizer state in: rank `r`
//! of `n` holds rows `[r·b, min((r+1)·b, rows))` with `b = ceil(rows / n)`, so the last ranks may
//! hold fewer rows (or none). On the wire every rank's block is padded to `b` rows, which is what
//! lets the equal-count collectives (all-gather, reduce-scatter) move them.

use crate::{Collective, DistError, Pending};

/// One rank's rows of a tensor sharded on dim 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dim0Shard {
    /// Rows of the whole tensor (its dim 0; 1 for a scalar).
    pub rows: usize,
    /// Elements per row (the product of the other dims).
    pub row_len: usize,
    /// Rows every rank's block is padded to: `ceil(rows / n)`.
    pub block_rows: usize,
    /// The first row this rank holds.
    pub start: usize,
    /// One past the last row this rank holds (`start` when it holds none).
    pub end: usize,
    /// Ranks the tensor is sharded over.
    pub ranks: usize,
}

impl Dim0Shard {
    /// Rank `rank`'s rows of a tensor of `shape` sharded over `ranks`.
    pub fn new(shape: &[usize], rank: usize, ranks: usize) -> Dim0Shard {
        let rows = shape.first().copied().unwrap_or(1);
        let row_len = shape.iter().skip(1).product();
        let block_rows = rows.div_ceil(ranks.max(1));
        let start = (rank * block_rows).min(rows);
        let end = ((rank + 1) * block_rows).min(rows);
        Dim0Shard {
            rows,
            row_len,
            block_rows,
            start,
            end,
            ranks: ranks.max(1),
        }
    }

    /// The shape of this rank's shard: `shape` with dim 0 cut to its rows.
    pub fn shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut s = shape.to_vec();
        if let Some(d0) = s.first_mut() {
            *d0 = self.end - self.start;
        }
        s
    }

    /// Elements this rank holds.
    pub fn len(&self) -> usize {
        (self.end - self.start) * self.row_len
    }

    /// Whether this rank holds no row.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements of one padded block on the wire.
    pub fn block_len(&self) -> usize {
        self.block_rows * self.row_len
    }

    /// Elements of the whole tensor.
    pub fn full_len(&self) -> usize {
        self.rows * self.row_len
    }

    /// This rank's rows of the whole tensor `full`.
    pub fn slice<'a>(&self, full: &'a [f32]) -> &'a [f32] {
        &full[self.start * self.row_len..self.end * self.row_len]
    }

    /// `local` padded with zeros to a block.
    fn padded(&self, local: &[f32]) -> Vec<f32> {
        let mut block = Vec::with_capacity(self.block_len());
        block.extend_from_slice(local);
        block.resize(self.block_len(), 0.0);
        block
    }

    /// `full` padded with zero rows to `ranks` blocks.
    fn padded_full(&self, full: &[f32]) -> Vec<f32> {
        let mut all = Vec::with_capacity(self.block_len() * self.ranks);
        all.extend_from_slice(full);
        all.resize(self.block_len() * self.ranks, 0.0);
        all
    }

    fn check(
        &self,
        op: &'static str,
        what: &'static str,
        expected: usize,
        got: usize,
    ) -> Result<(), DistError> {
        if expected != got {
            return Err(DistError::Size {
                op,
                what,
                expected,
                got,
            });
        }
        Ok(())
    }

    /// The whole tensor from every rank's shard (`local` is this rank's, [`Dim0Shard::len`]
    /// elements): what FSDP does before a block's forward and backward.
    pub fn all_gather(&self, comm: &dyn Collective, local: &[f32]) -> Result<Vec<f32>, DistError> {
        self.check("all_gather_dim0", "local shard", self.len(), local.len())?;
        let mut all = vec![0f32; self.block_len() * self.ranks];
        comm.all_gather((&self.padded(local)[..]).into(), (&mut all[..]).into())?;
        all.truncate(self.full_len());
        Ok(all)
    }

    /// Sums the whole tensor `full` (a gradient) over the ranks and returns this rank's rows of
    /// the sum: what FSDP does after a block's backward.
    pub fn reduce_scatter(
        &self,
        comm: &dyn Collective,
        full: &[f32],
    ) -> Result<Vec<f32>, DistError> {
        self.check(
            "reduce_scatter_dim0",
            "full tensor",
            self.full_len(),
            full.len(),
        )?;
        let mut block = vec![0f32; self.block_len()];
        comm.reduce_scatter_sum(&self.padded_full(full), &mut block)?;
        block.truncate(self.len());
        Ok(block)
    }

    /// Starts [`Dim0Shard::all_gather`]; finish it with [`Dim0Shard::finish_gather`] (the
    /// prefetch of the next block's parameters).
    pub fn start_all_gather(
        &self,
        comm: &dyn Collective,
        local: &[f32],
    ) -> Result<Box<dyn Pending>, DistError> {
        self.check("all_gather_dim0", "local shard", self.len(), local.len())?;
        comm.iall_gather(self.padded(local))
    }

    /// Waits for a gather started by [`Dim0Shard::start_all_gather`]: the whole tensor.
    pub fn finish_gather(&self, pending: Box<dyn Pending>) -> Result<Vec<f32>, DistError> {
        let mut all = pending.wait()?;
        all.truncate(self.full_len());
        Ok(all)
    }

    /// Starts [`Dim0Shard::reduce_scatter`]; finish it with [`Dim0Shard::finish_scatter`] (a
    /// gradient's reduction overlapping the next block's backward).
    pub fn start_reduce_scatter(
        &self,
        comm: &dyn Collective,
        full: &[f32],
    ) -> Result<Box<dyn Pending>, DistError> {
        self.check(
            "reduce_scatter_dim0",
            "full tensor",
            self.full_len(),
            full.len(),
        )?;
        comm.ireduce_scatter_sum(self.padded_full(full))
    }

    /// Waits for a reduction started by [`Dim0Shard::start_reduce_scatter`]: this rank's rows.
    pub fn finish_scatter(&self, pending: Box<dyn Pending>) -> Result<Vec<f32>, DistError> {
        let mut block = pending.wait()?;
        block.truncate(self.len());
        Ok(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Single;

    #[test]
    fn rows_split_with_ceil_blocks() {
        let shards: Vec<_> = (0..4).map(|r| Dim0Shard::new(&[5, 3], r, 4)).collect();
        let rows: Vec<_> = shards.iter().map(|s| (s.start, s.end)).collect();
        assert_eq!(rows, [(0, 2), (2, 4), (4, 5), (5, 5)]);
        assert_eq!(shards[2].shape(&[5, 3]), [1, 3]);
        assert!(shards[3].is_empty());
        assert_eq!(shards[0].block_len(), 6);
        let scalar = Dim0Shard::new(&[], 0, 2);
        assert_eq!((scalar.rows, scalar.row_len, scalar.len()), (1, 1, 1));
    }

    #[test]
    fn a_world_of_one_holds_everything() {
        let s = Dim0Shard::new(&[3, 2], 0, 1);
        let full: Vec<f32> = (0..6).map(|v| v as f32).collect();
        assert_eq!(s.slice(&full), &full[..]);
        assert_eq!(s.all_gather(&Single::new(), &full).unwrap(), full);
        assert_eq!(s.reduce_scatter(&Single::new(), &full).unwrap(), full);
        let p = s.start_all_gather(&Single::new(), &full).unwrap();
        assert_eq!(s.finish_gather(p).unwrap(), full);
        assert!(s.all_gather(&Single::new(), &full[..5]).is_err());
    }
}
