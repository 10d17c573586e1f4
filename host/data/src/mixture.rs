//! A weighted mixture of token streams: each row of a batch is a window of one source, the
//! source chosen so that every source's share of the rows drawn so far stays as close to its
//! weight as whole rows allow (the source furthest behind its share goes next: smooth weighted
//! round robin, as deterministic as the sources' own orders). Each source keeps its own
//! resumable order and cursor; the mixture's state is theirs and the rows drawn.

use serde::{Deserialize, Serialize};

use crate::loader::{Batch, LoaderState, PackedLoader};
use crate::{DataError, Result};

/// Where a [`MixtureLoader`] stands: each source's loader and the rows drawn in all.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MixtureState {
    /// Each source's loader state, in the order of the sources.
    pub sources: Vec<LoaderState>,
    /// Rows drawn from the mixture so far.
    pub drawn: u64,
}

/// Rows from several [`PackedLoader`]s in proportion to their weights.
#[derive(Clone, Debug)]
pub struct MixtureLoader {
    sources: Vec<PackedLoader>,
    /// Weights normalized to sum to 1.
    weights: Vec<f64>,
    /// How far each source is ahead of (negative) or behind its share, in rows.
    credit: Vec<f64>,
    /// Rows drawn from each source.
    rows: Vec<u64>,
    drawn: u64,
}

impl MixtureLoader {
    /// A mixture of `sources` (at least one, all with the same `seq_len`) with positive,
    /// finite `weights` (any scale).
    pub fn new(sources: Vec<PackedLoader>, weights: &[f64]) -> Result<Self> {
        let bad = |message: String| DataError::InvalidArgument {
            name: "data.sources",
            message,
        };
        if sources.is_empty() || sources.len() != weights.len() {
            return Err(bad(format!(
                "{} sources with {} weights",
                sources.len(),
                weights.len()
            )));
        }
        if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w > 0.0)) {
            return Err(bad(format!("weight {w}: weights must be positive")));
        }
        let total: f64 = weights.iter().sum();
        let n = sources.len();
        Ok(MixtureLoader {
            sources,
            weights: weights.iter().map(|w| w / total).collect(),
            credit: vec![0.0; n],
            rows: vec![0; n],
            drawn: 0,
        })
    }

    /// The source the next row comes from (and the books updated for it).
    fn pick(&mut self) -> usize {
        for (c, w) in self.credit.iter_mut().zip(&self.weights) {
            *c += w;
        }
        let mut best = 0;
        for (i, &c) in self.credit.iter().enumerate() {
            if c > self.credit[best] {
                best = i;
            }
        }
        self.credit[best] -= 1.0;
        self.rows[best] += 1;
        self.drawn += 1;
        best
    }

    /// The next `rows` rows, each a window of the source whose turn it is.
    pub fn next_batch(&mut self, rows: usize) -> Result<Batch> {
        self.next_rows(rows, 0..rows)
    }

    /// Rows `keep` of the next `rows` rows: every turn is taken, only these windows read.
    pub fn next_rows(&mut self, rows: usize, keep: std::ops::Range<usize>) -> Result<Batch> {
        let mut out = Batch::with_capacity(keep.len(), self.sources[0].seq_len());
        for r in 0..rows {
            let i = self.pick();
            // A row this rank does not keep moves its source on without reading it.
            let mine = usize::from(!keep.contains(&r))..1;
            let row = self.sources[i].next_rows(1, mine)?;
            out.inputs.extend(row.inputs);
            out.targets.extend(row.targets);
            out.batch += row.batch;
        }
        Ok(out)
    }

    /// Rows drawn from each source so far.
    pub fn rows_per_source(&self) -> &[u64] {
        &self.rows
    }

    /// Where the mixture stands now.
    pub fn state(&self) -> MixtureState {
        MixtureState {
            sources: self.sources.iter().map(PackedLoader::state).collect(),
            drawn: self.drawn,
        }
    }

    /// Moves the mixture to `s`, taken from a mixture of the same sources and weights: each
    /// source's loader restored, and the turns replayed up to the rows drawn (the same float
    /// operations in the same order, so the next turns are the ones the saved run would take).
    pub fn restore(&mut self, s: &MixtureState) -> Result<()> {
        if s.sources.len() != self.sources.len() {
            return Err(DataError::InvalidArgument {
                name: "data.sources",
                message: format!(
                    "the saved state has {} sources, this mixture {}",
                    s.sources.len(),
                    self.sources.len()
                ),
            });
        }
        for (l, st) in self.sources.iter_mut().zip(&s.sources) {
            l.restore(st)?;
        }
        self.credit.iter_mut().for_each(|c| *c = 0.0);
        self.rows.iter_mut().for_each(|r| *r = 0);
        self.drawn = 0;
        for _ in 0..s.drawn {
            self.pick();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source whose every id is `id`.
    fn source(id: u32, seed: u64) -> PackedLoader {
        PackedLoader::new(vec![id; 401], 4, seed, true).unwrap()
    }

    #[test]
    fn shares_stay_within_a_row_of_the_weights_and_resume_exactly() {
        let mut m = MixtureLoader::new(
            vec![source(1, 1), source(2, 2), source(3, 3)],
            &[7.0, 2.0, 1.0],
        )
        .unwrap();
        let mut seen = [0u64; 3];
        for step in 1..=1000 {
            let b = m.next_batch(4).unwrap();
            for r in 0..b.batch {
                seen[b.inputs[r * 4] as usize - 1] += 1;
            }
            let drawn = 4.0 * step as f64;
            for (i, w) in [0.7, 0.2, 0.1].iter().enumerate() {
                assert!(
                    (seen[i] as f64 - w * drawn).abs() <= 1.0,
                    "step {step}: {seen:?}"
                );
            }
        }
        assert_eq!(m.rows_per_source(), seen);
        let state = m.state();
        let want = m.next_batch(9).unwrap();
        let mut again = MixtureLoader::new(
            vec![source(1, 1), source(2, 2), source(3, 3)],
            &[7.0, 2.0, 1.0],
        )
        .unwrap();
        again.restore(&state).unwrap();
        assert_eq!(again.next_batch(9).unwrap(), want);
    }

    #[test]
    fn a_ranks_rows_are_the_rows_of_the_whole_batch() {
        let make = || MixtureLoader::new(vec![source(1, 1), source(2, 2)], &[3.0, 1.0]).unwrap();
        let (mut whole, mut part) = (make(), make());
        for _ in 0..20 {
            let b = whole.next_batch(8).unwrap();
            assert_eq!(part.next_rows(8, 3..6).unwrap(), b.rows(3, 6));
            assert_eq!(part.next_rows(8, 0..0).unwrap().batch, 0);
            whole.next_batch(8).unwrap();
        }
        assert_eq!(part.state(), whole.state());
    }

    #[test]
    fn bad_weights_are_refused() {
        for w in [vec![1.0], vec![1.0, 0.0], vec![1.0, f64::NAN]] {
            assert!(
                MixtureLoader::new(vec![source(1, 0), source(2, 0)], &w).is_err(),
                "{w:?}"
            );
        }
    }
}
