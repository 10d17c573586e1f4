//! Pipeline schedules: the order in which one rank runs the forward and backward of each
//! (micro-batch, stage) it holds. Rank `r` of `p` holds stages `r, r + p, r + 2p, ...` (its
//! "chunks" `0..v`); with `v = 1` that is plain 1F1B. The orders follow Megatron-LM's: warm up
//! with forwards, then alternate one forward and one backward, then drain the backwards, so a
//! rank keeps at most about `p` micro-batches' activations alive.

/// One unit of work of a rank: the forward or backward of micro-batch `mb` through the rank's
/// chunk `chunk` (global stage `chunk × p + rank`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A forward.
    Forward {
        /// Micro-batch (of this data-parallel rank's).
        mb: usize,
        /// The rank's virtual stage.
        chunk: usize,
    },
    /// A backward.
    Backward {
        /// Micro-batch.
        mb: usize,
        /// The rank's virtual stage.
        chunk: usize,
    },
}

/// The global stage of `rank`'s chunk `chunk` in a pipeline of `p` ranks.
pub fn stage_of(rank: usize, chunk: usize, p: usize) -> usize {
    chunk * p + rank
}

/// The order of rank `rank`'s operations for `m` micro-batches over `p` ranks holding `v`
/// chunks each. Interleaving (`v > 1`) needs `m` to be a multiple of `p` (the caller checks).
pub fn ops(p: usize, v: usize, m: usize, rank: usize) -> Vec<Op> {
    let total = m * v;
    // The k-th forward (backward) of a rank: micro-batches in groups of p, each group through
    // every chunk in turn (backwards through the chunks in reverse).
    let mb = |k: usize| (k / (p * v)) * p + k % p;
    let chunk = |k: usize| (k / p) % v;
    let fwd = |k: usize| Op::Forward {
        mb: mb(k),
        chunk: chunk(k),
    };
    let bwd = |k: usize| Op::Backward {
        mb: mb(k),
        chunk: v - 1 - chunk(k),
    };
    let warmup = if v == 1 {
        (p - rank - 1).min(m)
    } else if m == p {
        total
    } else {
        ((p - rank - 1) * 2 + (v - 1) * p).min(total)
    };
    let mut out = Vec::with_capacity(2 * total);
    out.extend((0..warmup).map(fwd));
    for k in 0..total - warmup {
        out.push(fwd(warmup + k));
        out.push(bwd(k));
    }
    out.extend((total - warmup..total).map(bwd));
    out
}

/// The idle fraction of the schedule in theory (equal stage times, free communication):
/// `(p − 1) / (v·m + p − 1)`, 1F1B's `(p − 1) / (m + p − 1)` with the ramp divided by `v`.
pub fn theory_bubble(p: usize, v: usize, m: usize) -> f64 {
    (p as f64 - 1.0) / ((v * m) as f64 + p as f64 - 1.0)
}

/// Runs every rank's operations against their dependencies (a forward needs the previous
/// stage's forward of the same micro-batch, a backward the next stage's backward), each rank
/// in its own order, with a forward costing `f` and a backward `b`. Returns each rank's idle
/// fraction, or `None` when the orders deadlock (a rank waits on one that waits on it).
#[cfg(test)]
pub fn simulate(p: usize, v: usize, m: usize, f: f64, b: f64) -> Option<Vec<f64>> {
    let stages = p * v;
    let lists: Vec<Vec<Op>> = (0..p).map(|r| ops(p, v, m, r)).collect();
    // When each (stage, micro-batch)'s forward and backward ended.
    let mut fwd_end = vec![vec![None::<f64>; m]; stages];
    let mut bwd_end = vec![vec![None::<f64>; m]; stages];
    let mut next = vec![0usize; p];
    let mut clock = vec![0f64; p];
    let mut busy = vec![0f64; p];
    loop {
        let mut progressed = false;
        for r in 0..p {
            let Some(&op) = lists[r].get(next[r]) else {
                continue;
            };
            let (ready, cost) = match op {
                Op::Forward { mb, chunk } => {
                    let s = stage_of(r, chunk, p);
                    let dep = if s == 0 {
                        Some(0.0)
                    } else {
                        fwd_end[s - 1][mb]
                    };
                    (dep, f)
                }
                Op::Backward { mb, chunk } => {
                    let s = stage_of(r, chunk, p);
                    let dep = if s + 1 == stages {
                        fwd_end[s][mb]
                    } else {
                        bwd_end[s + 1][mb]
                    };
                    (dep, b)
                }
            };
            let Some(ready) = ready else { continue };
            let end = clock[r].max(ready) + cost;
            match op {
                Op::Forward { mb, chunk } => fwd_end[stage_of(r, chunk, p)][mb] = Some(end),
                Op::Backward { mb, chunk } => bwd_end[stage_of(r, chunk, p)][mb] = Some(end),
            }
            clock[r] = end;
            busy[r] += cost;
            next[r] += 1;
            progressed = true;
        }
        if next.iter().zip(&lists).all(|(n, l)| *n == l.len()) {
            break;
        }
        if !progressed {
            return None;
        }
    }
    let makespan = clock.iter().copied().fold(0.0, f64::max);
    Some(busy.iter().map(|b| 1.0 - b / makespan).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_runs_each_forward_and_backward_once_in_an_order_that_cannot_deadlock() {
        for (p, v, m) in [
            (2, 1, 1),
            (2, 1, 4),
            (4, 1, 8),
            (3, 1, 2),
            (2, 2, 4),
            (4, 2, 8),
            (2, 3, 6),
            (2, 2, 2),
        ] {
            for r in 0..p {
                let list = ops(p, v, m, r);
                assert_eq!(list.len(), 2 * m * v, "p {p} v {v} m {m}");
                for mb in 0..m {
                    for chunk in 0..v {
                        let f = list.iter().position(|o| *o == Op::Forward { mb, chunk });
                        let b = list.iter().position(|o| *o == Op::Backward { mb, chunk });
                        assert!(
                            f.is_some() && b.is_some() && f < b,
                            "p {p} v {v} m {m} r {r}"
                        );
                    }
                }
            }
            assert!(
                simulate(p, v, m, 1.0, 2.0).is_some(),
                "p {p} v {v} m {m} deadlocks"
            );
        }
    }

    #[test]
    fn the_simulated_bubble_matches_the_formula() {
        // Backward twice the forward, as in a transformer: the ramp costs (p - 1)(f + b).
        for (p, v, m) in [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)] {
            let idle = simulate(p, v, m, 1.0, 2.0).expect("no deadlock");
            let theory = theory_bubble(p, v, m);
            for (r, got) in idle.iter().enumerate() {
                assert!(
                    (got - theory).abs() < 1e-9,
                    "p {p} v {v} m {m} rank {r}: simulated {got}, theory {theory}"
                );
            }
        }
        // Interleaving shrinks it.
        assert!(theory_bubble(2, 2, 4) < theory_bubble(2, 1, 4));
    }
}
