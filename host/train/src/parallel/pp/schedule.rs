//! Pipeline schedules: the order in which one rank runs the forward and backward of each
//! (micro-batch, stage) it holds. Under the 1F1B family rank `r` of `p` holds stages
//! `r, r + p, r + 2p, ...` (its "chunks" `0..v`); with `v = 1` that is plain 1F1B. The orders
//! follow Megatron-LM's: warm up with forwards, then alternate one forward and one backward,
//! then drain the backwards, so a rank keeps at most about `p` micro-batches' activations alive.
//!
//! The zero-bubble schedules ([`super::zb`]) split each backward into the input-gradient pass
//! (`Backward`, what the previous stage waits for) and the weight-gradient pass (`Weight`, run
//! later to fill what would be idle time); `zbv` places a rank's two chunks in V order (rank
//! `r` holds stages `r` and `2p − 1 − r`).

/// Which schedule a pipeline runs (`parallelism.pp_schedule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// `1f1b` and `interleaved_1f1b`: whole backwards.
    OneFOneB,
    /// `zero_bubble`: ZB-H1 with one chunk per rank, interleaved zero bubble with several.
    ZeroBubble,
    /// `zbv`: two chunks per rank in V order, zero bubble.
    Zbv,
}

impl Schedule {
    /// The schedule `parallelism.pp_schedule` names (the config checked the name).
    pub fn from_name(name: &str) -> Schedule {
        match name {
            "zero_bubble" => Schedule::ZeroBubble,
            "zbv" => Schedule::Zbv,
            _ => Schedule::OneFOneB,
        }
    }

    /// Whether backwards are split into input and weight passes.
    pub fn splits_backward(self) -> bool {
        self != Schedule::OneFOneB
    }
}

/// One unit of work of a rank: the forward or backward of micro-batch `mb` through the rank's
/// chunk `chunk` (global stage [`stage_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A forward.
    Forward {
        /// Micro-batch (of this data-parallel rank's).
        mb: usize,
        /// The rank's virtual stage.
        chunk: usize,
    },
    /// A backward: whole under 1F1B, the input-gradient pass under the zero-bubble schedules.
    Backward {
        /// Micro-batch.
        mb: usize,
        /// The rank's virtual stage.
        chunk: usize,
    },
    /// The weight-gradient pass of a split backward (zero-bubble schedules).
    Weight {
        /// Micro-batch.
        mb: usize,
        /// The rank's virtual stage.
        chunk: usize,
    },
}

/// The global stage of `rank`'s chunk `chunk` in a pipeline of `p` ranks: `chunk × p + rank`,
/// or under `zbv` the V (`rank`, then `2p − 1 − rank`).
pub fn stage_of(schedule: Schedule, rank: usize, chunk: usize, p: usize) -> usize {
    match (schedule, chunk) {
        (Schedule::Zbv, 1) => 2 * p - 1 - rank,
        _ => chunk * p + rank,
    }
}

/// The pipeline rank that runs stage `s` (the inverse of [`stage_of`]).
pub fn rank_of(schedule: Schedule, s: usize, p: usize) -> usize {
    match schedule {
        Schedule::Zbv if s >= p => 2 * p - 1 - s,
        _ => s % p,
    }
}

/// The order of rank `rank`'s operations for `m` micro-batches over `p` ranks holding `v`
/// chunks each. Several chunks need `m` to be a multiple of `p` (the caller checks).
pub fn ops(schedule: Schedule, p: usize, v: usize, m: usize, rank: usize) -> Vec<Op> {
    match schedule {
        Schedule::OneFOneB => one_f_one_b(p, v, m, rank),
        Schedule::ZeroBubble if v == 1 => super::zb::h1(p, m, rank),
        Schedule::ZeroBubble | Schedule::Zbv => super::zb::greedy(schedule, p, v, m)
            .into_iter()
            .nth(rank)
            .unwrap_or_default(),
    }
}

/// 1F1B's (and interleaved 1F1B's) order of rank `rank`'s operations.
fn one_f_one_b(p: usize, v: usize, m: usize, rank: usize) -> Vec<Op> {
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

/// The idle fraction of the schedule in theory (equal stage times, free communication).
/// 1F1B: `(p − 1) / (v·m + p − 1)`, 1F1B's `(p − 1) / (m + p − 1)` with the ramp divided by
/// `v`. Zero bubble, with a forward, an input pass and a weight pass costing the same: the ramp
/// is one forward per rank, `(p − 1) / (3·v·m + p − 1)` (for ZB-H1 with `m < p`, `p − m`
/// more: the weight passes then cannot fill the drain).
pub fn theory_bubble(schedule: Schedule, p: usize, v: usize, m: usize) -> f64 {
    let (p, v, m) = (p as f64, v as f64, m as f64);
    match schedule {
        Schedule::OneFOneB => (p - 1.0) / (v * m + p - 1.0),
        Schedule::ZeroBubble | Schedule::Zbv => {
            let span = 3.0 * v * m + p - 1.0 + (p - m).max(0.0);
            1.0 - 3.0 * v * m / span
        }
    }
}

/// Runs every rank's operations against their dependencies (a forward needs the previous
/// stage's forward of the same micro-batch, a backward the next stage's backward, a weight pass
/// its own backward), each rank in its own order, a forward costing `f`, a backward `b` and a
/// weight pass `w`. Returns each rank's idle fraction, or `None` when the orders deadlock (a
/// rank waits on one that waits on it).
#[cfg(test)]
pub fn simulate(
    schedule: Schedule,
    p: usize,
    v: usize,
    m: usize,
    [f, b, w]: [f64; 3],
) -> Option<Vec<f64>> {
    let stages = p * v;
    let lists: Vec<Vec<Op>> = (0..p).map(|r| ops(schedule, p, v, m, r)).collect();
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
            let at = |chunk| stage_of(schedule, r, chunk, p);
            let (ready, cost) = match op {
                Op::Forward { mb, chunk } => {
                    let s = at(chunk);
                    let dep = if s == 0 {
                        Some(0.0)
                    } else {
                        fwd_end[s - 1][mb]
                    };
                    (dep, f)
                }
                Op::Backward { mb, chunk } => {
                    let s = at(chunk);
                    let dep = if s + 1 == stages {
                        fwd_end[s][mb]
                    } else {
                        bwd_end[s + 1][mb]
                    };
                    // Its own forward too (a V's last stage runs on the rank that feeds it).
                    (dep.zip(fwd_end[s][mb]).map(|(a, b)| a.max(b)), b)
                }
                Op::Weight { mb, chunk } => (bwd_end[at(chunk)][mb], w),
            };
            let Some(ready) = ready else { continue };
            let end = clock[r].max(ready) + cost;
            match op {
                Op::Forward { mb, chunk } => fwd_end[at(chunk)][mb] = Some(end),
                Op::Backward { mb, chunk } => bwd_end[at(chunk)][mb] = Some(end),
                Op::Weight { .. } => {}
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

    const ALL: [Schedule; 3] = [Schedule::OneFOneB, Schedule::ZeroBubble, Schedule::Zbv];

    /// The (p, v, m) each schedule runs in the tests.
    fn cases(s: Schedule) -> Vec<(usize, usize, usize)> {
        match s {
            Schedule::OneFOneB => vec![
                (2, 1, 1),
                (2, 1, 4),
                (4, 1, 8),
                (3, 1, 2),
                (2, 2, 4),
                (4, 2, 8),
                (2, 3, 6),
                (2, 2, 2),
            ],
            Schedule::ZeroBubble => {
                let mut c = Vec::new();
                for p in 2..=5 {
                    for m in [1, 2, p, 2 * p, 3 * p + 1] {
                        c.push((p, 1, m));
                    }
                }
                for p in 2..=4 {
                    for v in [2, 3] {
                        c.extend([p, 2 * p, 3 * p].map(|m| (p, v, m)));
                    }
                }
                c
            }
            Schedule::Zbv => (2..=4)
                .flat_map(|p| [p, 2 * p, 3 * p].map(|m| (p, 2, m)))
                .collect(),
        }
    }

    /// The most chunk activations the order keeps at once (forwards whose backward, or weight
    /// pass when split, has not run).
    fn peak(list: &[Op], split: bool) -> usize {
        let (mut held, mut most) = (0usize, 0usize);
        for op in list {
            match (op, split) {
                (Op::Forward { .. }, _) => held += 1,
                (Op::Backward { .. }, false) | (Op::Weight { .. }, true) => held -= 1,
                _ => {}
            }
            most = most.max(held);
        }
        most
    }

    #[test]
    fn every_rank_runs_each_pass_once_in_an_order_that_cannot_deadlock() {
        for s in ALL {
            for (p, v, m) in cases(s) {
                let what = format!("{s:?} p {p} v {v} m {m}");
                for r in 0..p {
                    let list = ops(s, p, v, m, r);
                    let passes = if s.splits_backward() { 3 } else { 2 };
                    assert_eq!(list.len(), passes * m * v, "{what}");
                    for chunk in 0..v {
                        let at = |op: Op| list.iter().position(|o| *o == op);
                        let mut last_w = None;
                        for mb in 0..m {
                            let f = at(Op::Forward { mb, chunk });
                            let b = at(Op::Backward { mb, chunk });
                            assert!(f.is_some() && b.is_some() && f < b, "{what} r {r}");
                            let w = at(Op::Weight { mb, chunk });
                            if s.splits_backward() {
                                assert!(w.is_some() && b < w, "{what} r {r}");
                                // Weight passes in micro-batch order: each parameter's sum
                                // runs in 1F1B's order.
                                assert!(last_w < w, "{what} r {r}");
                                last_w = w;
                            } else {
                                assert!(w.is_none(), "{what}");
                            }
                        }
                    }
                }
                assert!(
                    simulate(s, p, v, m, [1.0, 2.0, 1.0]).is_some(),
                    "{what} deadlocks"
                );
            }
        }
        // Greedy orders on longer pipelines are complete too.
        for p in 5..=8 {
            for m in [p, 2 * p] {
                let lists: Vec<Vec<Op>> = (0..p).map(|r| ops(Schedule::Zbv, p, 2, m, r)).collect();
                assert!(lists.iter().all(|l| l.len() == 6 * m), "zbv p {p} m {m}");
                assert!(simulate(Schedule::Zbv, p, 2, m, [1.0; 3]).is_some());
            }
        }
    }

    #[test]
    fn the_simulated_bubble_matches_the_formula() {
        for s in ALL {
            // 1F1B: a backward twice the forward, as in a transformer: the ramp costs
            // (p - 1)(f + b). Zero bubble: the paper's equal forward, input and weight passes.
            let costs = match s {
                Schedule::OneFOneB => [1.0, 2.0, 0.0],
                _ => [1.0; 3],
            };
            for (p, v, m) in cases(s) {
                let checked = [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)];
                if s == Schedule::OneFOneB && !checked.contains(&(p, v, m)) {
                    continue;
                }
                let idle = simulate(s, p, v, m, costs).expect("no deadlock");
                let theory = theory_bubble(s, p, v, m);
                for (r, got) in idle.iter().enumerate() {
                    assert!(
                        (got - theory).abs() < 1e-9,
                        "{s:?} p {p} v {v} m {m} rank {r}: simulated {got}, theory {theory}"
                    );
                }
            }
        }
        // Interleaving shrinks it, and the zero-bubble schedules shrink it further.
        assert!(
            theory_bubble(Schedule::OneFOneB, 2, 2, 4) < theory_bubble(Schedule::OneFOneB, 2, 1, 4)
        );
        assert!(
            theory_bubble(Schedule::ZeroBubble, 2, 1, 4)
                < theory_bubble(Schedule::OneFOneB, 2, 1, 4)
        );
        assert!(
            theory_bubble(Schedule::Zbv, 2, 2, 4) < theory_bubble(Schedule::ZeroBubble, 2, 1, 4)
        );
    }

    #[test]
    fn the_zero_bubble_schedules_keep_no_more_activations_than_1f1b() {
        for s in [Schedule::ZeroBubble, Schedule::Zbv] {
            for (p, v, m) in cases(s) {
                // 1F1B's first rank is its fullest; a V chunk is half a 1F1B stage.
                let ref_v = if s == Schedule::Zbv { 1 } else { v };
                let one = peak(&ops(Schedule::OneFOneB, p, ref_v, m, 0), false) * v / ref_v;
                for r in 0..p {
                    let got = peak(&ops(s, p, v, m, r), true);
                    assert!(
                        got <= one,
                        "{s:?} p {p} v {v} m {m} rank {r}: {got} > {one}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_v_places_both_ends_on_the_first_rank() {
        assert_eq!(stage_of(Schedule::Zbv, 0, 1, 2), 3);
        assert_eq!(stage_of(Schedule::Zbv, 1, 1, 2), 2);
        for s in 0..8 {
            let r = rank_of(Schedule::Zbv, s, 4);
            assert!((0..2).any(|c| stage_of(Schedule::Zbv, r, c, 4) == s));
            assert_eq!(rank_of(Schedule::ZeroBubble, s, 4), s % 4);
        }
    }
}
