//! Reverse-mode autograd: ops record nodes while grad is enabled; `backward` walks them once in
//! topological order, accumulating into leaf gradients.
//!
//! Invariants:
//! - Each node's backward runs at most once; it takes (and so frees) the tensors the op saved.
//! - Traversal and summation orders depend only on the graph, never on timing: gradients are
//!   bitwise reproducible.
//! - A leaf's hooks fire when its last incoming edge of the pass has been processed, i.e. when its
//!   gradient for this pass is final (what overlapping gradient communication waits for).
//! - A split backward ([`split`]) computes the same values in the same order as one pass: it
//!   only moves the weight side's work (and its accumulation) to a later call.

pub mod checkpoint;
pub mod hook;
pub mod split;

pub use checkpoint::{checkpoint, RegionFn};
pub use hook::{before_backward, BeforeBackwardFn};
pub use split::WeightGrads;

use crate::error::{invalid, Result};
use crate::tensor::{GradMeta, Tensor};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// A callback fired with a leaf's final gradient of a backward pass.
pub type GradHook = Box<dyn Fn(&Tensor) + Send + Sync>;

/// The gradient rule of one recorded op.
pub trait BackwardOp: Send + Sync {
    /// Gradients for each recorded input (in recording order), given the output's gradient.
    fn backward(&self, grad: &Tensor) -> Result<Vec<Option<Tensor>>>;

    /// Whether [`BackwardOp::backward_part`] computes the inputs' gradients separately, so a
    /// split backward can defer the weight side's (a product's `dW = gᵀ·x`).
    fn splits(&self) -> bool {
        false
    }

    /// The gradients of the inputs `want` marks (the others `None`), each bitwise what
    /// [`BackwardOp::backward`] gives; may be called twice (complementary halves), so it must
    /// not consume what the op saved. Without [`BackwardOp::splits`], all of them.
    fn backward_part(&self, grad: &Tensor, want: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let _ = want;
        self.backward(grad)
    }
}

/// A gradient rule that computes the inputs' gradients separately (see
/// [`BackwardOp::backward_part`]): `f(grad, want)`, where an empty `want` asks for all.
pub(crate) struct SplitRule<F>(pub F);

impl<F> BackwardOp for SplitRule<F>
where
    F: Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync,
{
    fn backward(&self, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        (self.0)(grad, &[])
    }

    fn splits(&self) -> bool {
        true
    }

    fn backward_part(&self, grad: &Tensor, want: &[bool]) -> Result<Vec<Option<Tensor>>> {
        (self.0)(grad, want)
    }
}

impl<F> BackwardOp for F
where
    F: Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync,
{
    fn backward(&self, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self(grad)
    }
}

/// A recorded op: its gradient rule and where its inputs came from.
pub struct Node {
    name: &'static str,
    op: Mutex<Option<Box<dyn BackwardOp>>>,
    inputs: Vec<Edge>,
}

#[derive(Clone)]
enum Edge {
    None,
    Leaf(Arc<LeafGrad>),
    Node(Arc<Node>),
}

/// Gradient slot and hooks of a leaf tensor.
#[derive(Default)]
pub struct LeafGrad {
    grad: Mutex<Option<Tensor>>,
    hooks: Mutex<Vec<GradHook>>,
}

impl LeafGrad {
    pub(crate) fn grad(&self) -> Option<Tensor> {
        self.grad.lock().expect("grad lock poisoned").clone()
    }

    pub(crate) fn set_grad(&self, g: Option<Tensor>) {
        *self.grad.lock().expect("grad lock poisoned") = g;
    }

    pub(crate) fn add_hook(&self, hook: GradHook) {
        self.hooks.lock().expect("hook lock poisoned").push(hook);
    }

    /// Adds `g` to the stored gradient (in place when one exists, so accumulation allocates once).
    fn accumulate(&self, g: Tensor) -> Result<()> {
        let mut slot = self.grad.lock().expect("grad lock poisoned");
        match slot.as_ref() {
            // A gradient nothing else references is kept as is; anything else (a view, a
            // tensor another consumer holds) is copied, since later passes add into it.
            None => {
                *slot = Some(
                    g.into_exclusive()
                        .unwrap_or_else(|g| g.materialize(g.dtype())),
                )
            }
            Some(existing) => crate::ops::add_assign(existing, &g)?,
        }
        Ok(())
    }

    fn fire_hooks(&self) {
        let g = self.grad();
        if let Some(g) = g {
            for h in self.hooks.lock().expect("hook lock poisoned").iter() {
                h(&g);
            }
        }
    }
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// True when ops record the graph on this thread.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the previous grad mode when dropped.
#[must_use = "grad mode is restored when the guard is dropped"]
pub struct GradModeGuard {
    prev: bool,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}

/// Disables graph recording on this thread until the guard drops.
pub fn no_grad() -> GradModeGuard {
    set_grad_enabled(false)
}

/// Sets graph recording on this thread until the guard drops.
pub fn set_grad_enabled(enabled: bool) -> GradModeGuard {
    let prev = GRAD_ENABLED.with(|g| g.replace(enabled));
    GradModeGuard { prev }
}

fn edge_of(t: &Tensor) -> Edge {
    match t.grad_meta() {
        GradMeta::None => Edge::None,
        GradMeta::Leaf(l) => Edge::Leaf(l.clone()),
        GradMeta::Node(n) => Edge::Node(n.clone()),
    }
}

/// Attaches a node to `out` when grad is enabled and some input requires grad. `make` builds
/// the gradient rule only in that case, so ops save tensors only when needed.
pub(crate) fn record<B: BackwardOp + 'static>(
    name: &'static str,
    out: Tensor,
    inputs: &[&Tensor],
    make: impl FnOnce() -> B,
) -> Tensor {
    if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
        return out;
    }
    let node = Node {
        name,
        op: Mutex::new(Some(Box::new(make()))),
        inputs: inputs.iter().map(|t| edge_of(t)).collect(),
    };
    out.with_grad_meta(GradMeta::Node(Arc::new(node)))
}

fn key(n: &Arc<Node>) -> usize {
    Arc::as_ptr(n) as usize
}

/// Runs the backward pass from `root` with gradient `grad`.
pub(crate) fn backward(root: &Tensor, grad: Tensor) -> Result<()> {
    run(root, grad, None)
}

/// The backward pass from `root`. With `now` (a split pass: the slots of the leaves whose
/// gradients are wanted now), only the nodes from which some path reaches one of those leaves
/// compute, and only toward them; the rest (the weight side) is queued on [`split`]'s list in
/// the order one pass would run it, with whatever the computing nodes owe it.
fn run(root: &Tensor, grad: Tensor, now: Option<&HashSet<usize>>) -> Result<()> {
    if grad.shape() != root.shape() {
        return Err(crate::Error::ShapeMismatch {
            op: "backward",
            lhs: root.shape().to_vec(),
            rhs: grad.shape().to_vec(),
        });
    }
    let _guard = no_grad();
    let _phase = crate::profile::phase("backward");
    let root_node = match root.grad_meta() {
        GradMeta::None => return Err(invalid("backward", "tensor does not require grad")),
        GradMeta::Leaf(l) => {
            l.accumulate(grad)?;
            l.fire_hooks();
            return Ok(());
        }
        GradMeta::Node(n) => n.clone(),
    };

    // Count, for every reachable node and leaf, how many edges lead into it.
    let mut node_deps: HashMap<usize, usize> = HashMap::new();
    let mut leaf_uses: HashMap<usize, usize> = HashMap::new();
    let mut stack = vec![root_node.clone()];
    let mut seen = HashMap::from([(key(&root_node), ())]);
    while let Some(n) = stack.pop() {
        for e in &n.inputs {
            match e {
                Edge::None => {}
                Edge::Leaf(l) => *leaf_uses.entry(Arc::as_ptr(l) as usize).or_default() += 1,
                Edge::Node(m) => {
                    *node_deps.entry(key(m)).or_default() += 1;
                    if seen.insert(key(m), ()).is_none() {
                        stack.push(m.clone());
                    }
                }
            }
        }
    }
    let weight_side = match now {
        Some(now) => split::weight_side(&root_node, &node_deps, now),
        None => HashSet::new(),
    };
    // An input the weight pass serves: a weight-side node, or a leaf not wanted now.
    let deferred = |e: &Edge| match (e, now) {
        (Edge::Node(m), Some(_)) => weight_side.contains(&key(m)),
        (Edge::Leaf(l), Some(now)) => !now.contains(&(Arc::as_ptr(l) as usize)),
        _ => false,
    };

    let mut pending: HashMap<usize, Tensor> = HashMap::new();
    if weight_side.contains(&key(&root_node)) {
        split::push(split::Deferred::Seed {
            node: root_node.clone(),
            grad,
        });
    } else {
        pending.insert(key(&root_node), grad);
    }
    let mut ready = vec![root_node];
    while let Some(node) = ready.pop() {
        let later: Vec<bool> = node.inputs.iter().map(&deferred).collect();
        let (grads, source) = if weight_side.contains(&key(&node)) {
            (vec![None; node.inputs.len()], Some(split::Source::Node))
        } else {
            let (grads, source) = node_grads(&node, pending.remove(&key(&node)), &later)?;
            (grads, source)
        };
        let mut fire = vec![false; node.inputs.len()];
        for (i, (edge, g)) in node.inputs.iter().zip(grads).enumerate() {
            match edge {
                Edge::None => {}
                Edge::Leaf(l) => {
                    if let (Some(g), false) = (g, later[i]) {
                        l.accumulate(g)?;
                    }
                    let uses = leaf_uses
                        .get_mut(&(Arc::as_ptr(l) as usize))
                        .expect("counted above");
                    *uses -= 1;
                    if *uses == 0 {
                        match later[i] {
                            true => fire[i] = true,
                            false => l.fire_hooks(),
                        }
                    }
                }
                Edge::Node(m) => {
                    if let (Some(g), false) = (g, later[i]) {
                        let k = key(m);
                        let summed = match pending.remove(&k) {
                            None => g,
                            Some(prev) => crate::ops::add(&prev, &g)?,
                        };
                        pending.insert(k, summed);
                    }
                    let deps = node_deps.get_mut(&key(m)).expect("counted above");
                    *deps -= 1;
                    if *deps == 0 {
                        ready.push(m.clone());
                    }
                }
            }
        }
        if let Some(source) = source {
            split::push(split::Deferred::Route {
                node,
                source,
                route: later,
                fire,
            });
        }
    }
    Ok(())
}

/// The gradients a computing node passes on now (for its inputs not marked `later`), and what
/// the weight pass needs for the others (`None` when no input waits for it).
fn node_grads(
    node: &Arc<Node>,
    g: Option<Tensor>,
    later: &[bool],
) -> Result<(Vec<Option<Tensor>>, Option<split::Source>)> {
    let op = node.op.lock().expect("node lock poisoned").take();
    let any_later = later.iter().any(|&l| l);
    let (g, op) = match (g, op) {
        (Some(g), Some(op)) => (g, op),
        (None, _) => {
            let source = any_later.then(|| split::Source::Done(vec![None; later.len()]));
            return Ok((vec![None; node.inputs.len()], source));
        }
        (Some(_), None) => return Err(invalid(
            node.name,
            "backward through this part of the graph ran already (its saved tensors were freed)",
        )),
    };
    let check = |grads: &Vec<Option<Tensor>>| {
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
        Ok(())
    };
    if !any_later {
        let grads = op.backward(&g)?;
        check(&grads)?;
        return Ok((grads, None));
    }
    if op.splits() {
        let want: Vec<bool> = later.iter().map(|&l| !l).collect();
        let grads = op.backward_part(&g, &want)?;
        check(&grads)?;
        let source = split::Source::Part {
            op,
            grad: g,
            want: later.to_vec(),
        };
        return Ok((grads, Some(source)));
    }
    // An op that computes every gradient at once: the weight side's wait, computed.
    let mut grads = op.backward(&g)?;
    check(&grads)?;
    let kept = grads
        .iter_mut()
        .zip(later)
        .map(|(g, &l)| if l { g.take() } else { None })
        .collect();
    Ok((grads, Some(split::Source::Done(kept))))
}
