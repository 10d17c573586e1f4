//! When the pipeline's messages can move device buffers over NCCL without a deadlock, and in
//! what order each rank posts its sends.
//!
//! NCCL pairs the sends and receives between two ranks in the order they are posted, and a
//! group of them completes only when each of its sends has met its receive (for messages larger
//! than NCCL's buffers; smaller ones can complete sooner, which only helps). So
//! [`super::wire::Wire`] queues a rank's sends and posts them with its next receive in one
//! group, each only once it is *due*: every message the receiver takes from this rank before it
//! has been posted (so a pair meets its messages in one order even where a schedule makes them
//! in another). Whether that finishes depends on the schedule's shape: [`plan`] runs the
//! protocol over every rank's operations (what NCCL does, its waits included) and answers
//! `None` where some ranks would wait on each other forever; the step then stages its messages
//! through host memory over MPI, whose sends never wait.

use super::layout::Layout;
use super::schedule::{self, Op};
use super::wire::{tag, Kind};
use std::collections::{HashMap, HashSet, VecDeque};

/// One rank's sends to a neighbour rank, in the order the neighbour receives them.
pub struct Plan {
    /// By destination rank: the tags of the messages it takes from this rank, in its order.
    pub due: HashMap<usize, VecDeque<u16>>,
}

/// A message leaving or reaching a rank (messages to itself never leave it).
#[derive(Clone, Copy)]
enum Event {
    /// Made and queued (an activation's header leaves at once, over MPI).
    Send { to: usize, tag: u16 },
    /// An activation's header: waits until the sender made the message.
    Header { from: usize, tag: u16 },
    /// The values, over NCCL.
    Recv { from: usize, tag: u16 },
}

/// Rank `r`'s messages with other ranks, in the order its operations `ops` make and need
/// them.
fn events(layout: &Layout, ops: Vec<Op>, r: usize) -> Vec<Event> {
    let n = layout.n_stages();
    let mut out = Vec::new();
    for op in ops {
        let (mb, chunk, kind) = match op {
            Op::Forward { mb, chunk } => (mb, chunk, Kind::Activation),
            Op::Backward { mb, chunk } => (mb, chunk, Kind::Gradient),
            Op::Weight { .. } => continue,
        };
        let s = layout.stage_of(r, chunk);
        // A forward takes from the stage before and gives to the one after, a backward the
        // other way round; the tag names the stage the activation enters.
        let (from, to, entered) = match kind {
            Kind::Activation => (s.checked_sub(1), (s + 1 < n).then_some(s + 1), [s, s + 1]),
            Kind::Gradient => ((s + 1 < n).then_some(s + 1), s.checked_sub(1), [s + 1, s]),
        };
        if let Some(f) = from.map(|f| layout.rank_of(f)).filter(|&f| f != r) {
            let tag = tag(kind, entered[0], mb);
            if let Kind::Activation = kind {
                out.push(Event::Header { from: f, tag });
            }
            out.push(Event::Recv { from: f, tag });
        }
        if let Some(d) = to.map(|d| layout.rank_of(d)).filter(|&d| d != r) {
            let tag = tag(kind, entered[1], mb);
            out.push(Event::Send { to: d, tag });
        }
    }
    out
}

/// A rank's open NCCL group: its sends (destination, index among this rank's sends there) and
/// its receive (source, index among what it takes from there), if any.
type Group = (Vec<(usize, usize)>, Option<(usize, usize)>);

/// Rank `rank`'s plan for a step of `m` micro-batches, or `None` when the protocol would not
/// finish (the ranks would wait on each other) under `layout`'s schedule.
pub fn plan(layout: &Layout, m: usize, rank: usize) -> Option<Plan> {
    let ops = |r| schedule::ops(layout.schedule, layout.p, layout.v, m, r);
    plan_of(layout, ops, rank)
}

/// [`plan`] for an evaluation of `m` batches: forwards alone, each batch through the rank's
/// stages in pipeline order.
pub fn evaluation(layout: &Layout, m: usize, rank: usize) -> Option<Plan> {
    let ops = |r| {
        let mut chunks: Vec<usize> = (0..layout.v).collect();
        chunks.sort_by_key(|&c| layout.stage_of(r, c));
        (0..m)
            .flat_map(|mb| chunks.iter().map(move |&chunk| Op::Forward { mb, chunk }))
            .collect()
    };
    plan_of(layout, ops, rank)
}

/// Runs the protocol over every rank's messages: each rank queues its sends (an activation's
/// header leaves at once), waits at a header until its sender made the message, and at each
/// receive (and once at the end) posts one group of its due sends and the receive, then waits
/// until the receive arrived and each send was taken.
fn plan_of(layout: &Layout, ops: impl Fn(usize) -> Vec<Op>, rank: usize) -> Option<Plan> {
    let p = layout.p;
    let evs: Vec<Vec<Event>> = (0..p).map(|r| events(layout, ops(r), r)).collect();
    // What each receiver takes from each sender, in its order.
    let mut order: HashMap<(usize, usize), Vec<u16>> = HashMap::new();
    for (r, ev) in evs.iter().enumerate() {
        for e in ev {
            if let Event::Recv { from, tag } = *e {
                order.entry((from, r)).or_default().push(tag);
            }
        }
    }
    let mut made: HashSet<(usize, usize, u16)> = HashSet::new();
    let mut posted: HashMap<(usize, usize), usize> = HashMap::new();
    let mut taking: HashMap<(usize, usize), usize> = HashMap::new();
    let mut pc = vec![0usize; p];
    let mut queued: Vec<Vec<(usize, u16)>> = vec![Vec::new(); p];
    let mut open: Vec<Option<Group>> = vec![None; p];
    let mut done = vec![false; p];
    while !done.iter().all(|&d| d) {
        let mut moved = false;
        for r in 0..p {
            if done[r] {
                continue;
            }
            if let Some((sends, recv)) = open[r].clone() {
                let taken = sends
                    .iter()
                    .all(|&(to, k)| taking.get(&(r, to)).copied().unwrap_or(0) > k);
                let arrived =
                    recv.is_none_or(|(from, k)| posted.get(&(from, r)).copied().unwrap_or(0) > k);
                if taken && arrived {
                    open[r] = None;
                    moved = true;
                    done[r] = recv.is_none();
                }
                continue;
            }
            match evs[r].get(pc[r]).copied() {
                Some(Event::Send { to, tag }) => {
                    made.insert((r, to, tag));
                    queued[r].push((to, tag));
                }
                Some(Event::Header { from, tag }) => {
                    if !made.contains(&(from, r, tag)) {
                        continue;
                    }
                }
                Some(Event::Recv { from, .. }) => {
                    let sends = post_due(r, &mut queued[r], &order, &mut posted);
                    let k = taking.entry((from, r)).or_default();
                    *k += 1;
                    open[r] = Some((sends, Some((from, *k - 1))));
                }
                None => {
                    let sends = post_due(r, &mut queued[r], &order, &mut posted);
                    if !queued[r].is_empty() {
                        // Made but never due: the receivers do not take them.
                        return None;
                    }
                    open[r] = Some((sends, None));
                    moved = true;
                    continue;
                }
            }
            pc[r] += 1;
            moved = true;
        }
        if !moved {
            return None;
        }
    }
    let due = order
        .into_iter()
        .filter(|((from, _), _)| *from == rank)
        .map(|((_, to), tags)| (to, tags.into()))
        .collect();
    Some(Plan { due })
}

/// Takes rank `r`'s due sends out of `queued` for one group (each the next its receiver takes
/// from `r`); returns them as (destination, index).
fn post_due(
    r: usize,
    queued: &mut Vec<(usize, u16)>,
    order: &HashMap<(usize, usize), Vec<u16>>,
    posted: &mut HashMap<(usize, usize), usize>,
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    while let Some(i) = queued.iter().position(|&(to, tag)| {
        let k = posted.get(&(r, to)).copied().unwrap_or(0);
        order.get(&(r, to)).and_then(|o| o.get(k)) == Some(&tag)
    }) {
        let (to, _) = queued.remove(i);
        let k = posted.entry((r, to)).or_default();
        *k += 1;
        out.push((to, *k - 1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::pp::schedule::Schedule;

    fn layout(schedule: Schedule, p: usize, v: usize) -> Layout {
        Layout {
            p,
            v,
            stages: (0..p * v).map(|s| s..s + 1).collect(),
            schedule,
        }
    }

    #[test]
    fn one_stage_per_rank_finishes_over_nccl_and_interleaving_does_not() {
        for (schedule, v) in [
            (Schedule::OneFOneB, 1),
            (Schedule::OneFOneB, 2),
            (Schedule::ZeroBubble, 1),
            (Schedule::ZeroBubble, 2),
            (Schedule::Zbv, 2),
        ] {
            for p in [2, 3, 4] {
                for m in [p, 2 * p, 3 * p] {
                    let got = plan(&layout(schedule, p, v), m, 0);
                    // With several stages a rank waits for a header its neighbour makes only
                    // after taking a message this rank still holds (see below).
                    assert_eq!(got.is_some(), v == 1, "{schedule:?} p {p} v {v} m {m}");
                    // Rank 0 sends its next rank stage 1's activations in order.
                    if let Some(plan) = got {
                        let first: Vec<u16> = plan.due[&1].iter().take(2).copied().collect();
                        let (a0, a1) = (tag(Kind::Activation, 1, 0), tag(Kind::Activation, 1, 1));
                        assert_eq!(first, [a0, a1]);
                    }
                }
            }
        }
        for p in [2, 3, 4] {
            assert!(evaluation(&layout(Schedule::OneFOneB, p, 1), 3, 0).is_some());
            assert!(evaluation(&layout(Schedule::Zbv, p, 2), 3, 0).is_none());
        }
    }

    #[test]
    fn a_v_would_wait_on_itself() {
        // zbv on 2 ranks, 2 micro-batches: rank 0 holds stage 1's two activations, to be
        // posted at its next receive, the activation into stage 3; rank 1 makes that only
        // from stage 1's first activation. Staged over MPI the sends leave at once.
        let zbv = layout(Schedule::Zbv, 2, 2);
        assert!(plan(&zbv, 2, 0).is_none());
        assert!(plan(&layout(Schedule::OneFOneB, 2, 1), 2, 0).is_some());
    }
}
