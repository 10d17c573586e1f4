//! A backward pass split in two (zero-bubble pipeline schedules): the input pass computes only
//! the gradients on a path to the leaves wanted now (a pipeline stage's received input, whose
//! gradient the previous stage waits for); everything else, the weight side (a product's
//! `dW = gᵀ·x`, the parameter's transposes and casts, the leaves' accumulation), is queued and
//! runs when [`WeightGrads::run`] is called, keeping what it needs (saved inputs, the output
//! gradient) alive until then.
//!
//! The queue holds the weight side's work in the order one whole pass would have done it, and
//! each op computes the same values from the same inputs, so the gradients are bitwise those
//! of [`Tensor::backward_with`]. Ops that compute their inputs' gradients separately
//! ([`super::BackwardOp::splits`]: the matrix product) defer the weight side's compute; the
//! others compute all of theirs in the input pass and the weight pass only adds them up.
//! A recompute region's nested backward splits the same way (its own inputs wanted now).

use super::{invalid, no_grad, BackwardOp, Edge, GradMeta, Node};
use crate::error::Result;
use crate::tensor::Tensor;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Where the weight pass gets a queued node's gradients for its deferred inputs.
pub(crate) enum Source {
    /// A splitting op's gradients for the inputs `want` marks, from the output's `grad`.
    Part {
        op: Box<dyn BackwardOp>,
        grad: Tensor,
        want: Vec<bool>,
    },
    /// Computed by the input pass already (`None` where the input is not deferred).
    Done(Vec<Option<Tensor>>),
    /// A weight-side node: its op runs on the gradient summed for it in the weight pass.
    Node,
}

/// One step of the weight pass.
pub(crate) enum Deferred {
    /// A weight-side root: its gradient is the seed.
    Seed { node: Arc<Node>, grad: Tensor },
    /// Route `node`'s gradients to its inputs marked in `route`; fire a leaf's hooks where
    /// `fire` says this was its last edge of the pass.
    Route {
        node: Arc<Node>,
        source: Source,
        route: Vec<bool>,
        fire: Vec<bool>,
    },
}

thread_local! {
    /// The queue of the split pass running on this thread, if any.
    static QUEUE: RefCell<Option<Vec<Deferred>>> = const { RefCell::new(None) };
}

pub(crate) fn push(d: Deferred) {
    QUEUE.with(|q| {
        if let Some(q) = q.borrow_mut().as_mut() {
            q.push(d);
        }
    });
}

fn active() -> bool {
    QUEUE.with(|q| q.borrow().is_some())
}

/// The weight side of a split backward, to run later. Dropping it without running it drops
/// those gradients (and frees what they kept alive).
#[must_use = "the weight gradients are only added to the leaves by `run`"]
pub struct WeightGrads {
    items: Vec<Deferred>,
}

impl WeightGrads {
    /// Whether nothing was deferred.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Computes the deferred gradients and adds them to their leaves, in the order one whole
    /// backward pass would have (so the sums are bitwise the same), firing each leaf's hooks
    /// after its last contribution.
    pub fn run(self) -> Result<()> {
        let _guard = no_grad();
        let _phase = crate::profile::phase("backward_w");
        let mut pending: HashMap<usize, Tensor> = HashMap::new();
        for item in self.items {
            let (node, source, route, fire) = match item {
                Deferred::Seed { node, grad } => {
                    pending.insert(super::key(&node), grad);
                    continue;
                }
                Deferred::Route {
                    node,
                    source,
                    route,
                    fire,
                } => (node, source, route, fire),
            };
            let grads = match source {
                Source::Done(grads) => grads,
                Source::Part { op, grad, want } => op.backward_part(&grad, &want)?,
                Source::Node => {
                    let g = pending.remove(&super::key(&node));
                    let op = node.op.lock().expect("node lock poisoned").take();
                    match (g, op) {
                        (Some(g), Some(op)) => op.backward(&g)?,
                        (None, _) => vec![None; node.inputs.len()],
                        (Some(_), None) => {
                            return Err(invalid(
                                node.name,
                                "backward through this part of the graph ran already (its saved tensors were freed)",
                            ))
                        }
                    }
                }
            };
            if grads.len() != node.inputs.len() {
                return Err(invalid(
                    node.name,
                    format!(
                        "backward returned {} grads for {} inputs",
                        grads.len(),
                        node.inputs.len()
                    ),
                ));
            }
            for (i, (edge, g)) in node.inputs.iter().zip(grads).enumerate() {
                if !route[i] {
                    continue;
                }
                match edge {
                    Edge::None => {}
                    Edge::Leaf(l) => {
                        if let Some(g) = g {
                            l.accumulate(g)?;
                        }
                        if fire[i] {
                            l.fire_hooks();
                        }
                    }
                    Edge::Node(m) => {
                        if let Some(g) = g {
                            let k = super::key(m);
                            let summed = match pending.remove(&k) {
                                None => g,
                                Some(prev) => crate::ops::add(&prev, &g)?,
                            };
                            pending.insert(k, summed);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Resets the thread's queue when a split pass ends, however it ends.
struct Active;

impl Drop for Active {
    fn drop(&mut self) {
        QUEUE.with(|q| q.borrow_mut().take());
    }
}

fn slots(now: &[&Tensor]) -> HashSet<usize> {
    now.iter()
        .filter_map(|t| match t.grad_meta() {
            GradMeta::Leaf(l) => Some(Arc::as_ptr(l) as usize),
            _ => None,
        })
        .collect()
}

/// The input pass of a split backward from `root` with gradient `grad`: the gradients of the
/// leaves `now` (and everything on the way to them) are computed and accumulated; the rest is
/// returned, to run later.
pub(crate) fn backward_split(root: &Tensor, grad: Tensor, now: &[&Tensor]) -> Result<WeightGrads> {
    if active() {
        return Err(invalid(
            "backward_split",
            "a split backward is already running on this thread",
        ));
    }
    QUEUE.with(|q| *q.borrow_mut() = Some(Vec::new()));
    let active = Active;
    super::run(root, grad, Some(&slots(now)))?;
    let items = QUEUE.with(|q| q.borrow_mut().take()).unwrap_or_default();
    drop(active);
    Ok(WeightGrads { items })
}

/// A recompute region's backward from `root`: split (the region's `inputs` wanted now) when it
/// runs inside a split pass, whole otherwise.
pub(crate) fn backward_region(root: &Tensor, grad: Tensor, inputs: &[Tensor]) -> Result<()> {
    if !active() {
        return super::backward(root, grad);
    }
    let refs: Vec<&Tensor> = inputs.iter().collect();
    super::run(root, grad, Some(&slots(&refs)))
}

/// The nodes reachable from `root` from which no path leads to a leaf in `now`: the weight
/// side. `deps` counts each node's incoming edges.
pub(crate) fn weight_side(
    root: &Arc<Node>,
    deps: &HashMap<usize, usize>,
    now: &HashSet<usize>,
) -> HashSet<usize> {
    // Consumers before producers (Kahn's order from the root), then walked backwards so each
    // node is decided after all its inputs.
    let mut left = deps.clone();
    let mut order = Vec::with_capacity(deps.len() + 1);
    let mut stack = vec![root.clone()];
    while let Some(n) = stack.pop() {
        for e in &n.inputs {
            if let Edge::Node(m) = e {
                let d = left.get_mut(&super::key(m)).expect("counted by the caller");
                *d -= 1;
                if *d == 0 {
                    stack.push(m.clone());
                }
            }
        }
        order.push(n);
    }
    let mut reaches: HashSet<usize> = HashSet::new();
    let mut side = HashSet::new();
    for n in order.iter().rev() {
        let hit = n.inputs.iter().any(|e| match e {
            Edge::None => false,
            Edge::Leaf(l) => now.contains(&(Arc::as_ptr(l) as usize)),
            Edge::Node(m) => reaches.contains(&super::key(m)),
        });
        if hit {
            reaches.insert(super::key(n));
        } else {
            side.insert(super::key(n));
        }
    }
    side
}

#[cfg(test)]
#[path = "split_tests.rs"]
mod tests;
