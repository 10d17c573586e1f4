//! Zero-bubble pipeline orders (Qi et al., "Zero Bubble Pipeline Parallelism"): each backward
//! is split into the input-gradient pass (`Backward`, on the critical path) and the weight-
//! gradient pass (`Weight`, which only this rank waits for), and the weight passes fill the time
//! 1F1B spends idle.
//!
//! Every order keeps each chunk's weight passes in micro-batch order, so a parameter's gradient
//! is summed over the micro-batches in the order 1F1B sums it (bitwise the same).

use super::schedule::{stage_of, Op, Schedule};
use std::collections::VecDeque;

/// ZB-H1 for rank `rank` of `p` (one chunk): 1F1B's warm-up of `p − rank − 1` forwards, then
/// forward / input pass pairs, each rank's weight passes trailing its input passes by `rank`
/// micro-batches. The later ranks so hold up to `p` micro-batches, as 1F1B's first rank does,
/// and their deferred weight passes fill the drain: with equal costs the idle time is one
/// forward per rank of ramp, a third of 1F1B's.
pub fn h1(p: usize, m: usize, rank: usize) -> Vec<Op> {
    let warmup = (p - rank - 1).min(m);
    let lag = rank;
    let f = |mb| Op::Forward { mb, chunk: 0 };
    let b = |mb| Op::Backward { mb, chunk: 0 };
    let w = |mb| Op::Weight { mb, chunk: 0 };
    let mut out: Vec<Op> = (0..warmup).map(f).collect();
    let (mut nf, mut nw) = (warmup, 0);
    for nb in 0..m {
        if nf < m {
            out.push(f(nf));
            nf += 1;
        }
        out.push(b(nb));
        if nb + 1 - nw > lag {
            out.push(w(nw));
            nw += 1;
        }
    }
    out.extend((nw..m).map(w));
    out
}

/// The most chunk activations a rank of the greedy orders keeps (forwards whose weight pass
/// has not run): under `zbv` 1F1B's peak (`p` micro-batches through a whole stage, a V chunk
/// being half of one), under interleaving interleaved 1F1B's.
fn cap(schedule: Schedule, p: usize, v: usize, m: usize) -> usize {
    match schedule {
        Schedule::Zbv => 2 * p,
        _ => ((p - 1) * 2 + (v - 1) * p + 1).min(m * v),
    }
}

/// Every rank's order under `zbv` or interleaved zero bubble: the pipeline is simulated with a
/// forward, an input pass and a weight pass each costing one unit, and every rank, when free,
/// runs the first of: an input pass whose gradient has arrived (oldest micro-batch, then the
/// later stage); a forward whose input has arrived while it holds fewer than [`cap`] chunk
/// activations (the later stage first, pushing micro-batches toward the loss); its oldest
/// pending weight pass. With `m` a multiple of `p` this reaches the ramp-only bound of
/// [`super::schedule::theory_bubble`] (checked by the unit tests up to `p = 4`).
pub fn greedy(schedule: Schedule, p: usize, v: usize, m: usize) -> Vec<Vec<Op>> {
    let n = p * v;
    let cap = cap(schedule, p, v, m);
    // When each (stage, micro-batch)'s forward and input pass end, in units.
    let mut f_end = vec![vec![usize::MAX; m]; n];
    let mut b_end = vec![vec![usize::MAX; m]; n];
    let (mut nf, mut nb) = (vec![0usize; n], vec![0usize; n]);
    let mut weights: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); p];
    let (mut held, mut free_at) = (vec![0usize; p], vec![0usize; p]);
    let mut out: Vec<Vec<Op>> = vec![Vec::with_capacity(3 * m * v); p];
    let (total, mut done) = (3 * m * n, 0);
    let mut t = 0;
    // Each unit of time some rank runs something, so this bounds the loop.
    while done < total && t <= total {
        for r in 0..p {
            if free_at[r] > t {
                continue;
            }
            let stage = |c| stage_of(schedule, r, c, p);
            let backward = (0..v)
                .filter(|&c| {
                    let (s, k) = (stage(c), nb[stage(c)]);
                    let next_done = s + 1 == n || (k < m && b_end[s + 1][k] <= t);
                    k < m && f_end[s][k] <= t && next_done
                })
                .min_by_key(|&c| (nb[stage(c)], std::cmp::Reverse(stage(c))));
            let forward = || {
                (0..v)
                    .filter(|&c| {
                        let (s, k) = (stage(c), nf[stage(c)]);
                        k < m && (s == 0 || f_end[s - 1][k] <= t)
                    })
                    .max_by_key(|&c| stage(c))
            };
            let op = if let Some(c) = backward {
                let (s, k) = (stage(c), nb[stage(c)]);
                b_end[s][k] = t + 1;
                nb[s] += 1;
                weights[r].push_back((k, c));
                Op::Backward { mb: k, chunk: c }
            } else if let Some(c) = (held[r] < cap).then(forward).flatten() {
                let (s, k) = (stage(c), nf[stage(c)]);
                f_end[s][k] = t + 1;
                nf[s] += 1;
                held[r] += 1;
                Op::Forward { mb: k, chunk: c }
            } else if let Some((k, c)) = weights[r].pop_front() {
                held[r] -= 1;
                Op::Weight { mb: k, chunk: c }
            } else {
                continue;
            };
            out[r].push(op);
            free_at[r] = t + 1;
            done += 1;
        }
        t += 1;
    }
    out
}
