//! The optimizer step, and under FSDP the one for optimizers that must see whole matrices
//! (`needs_full_matrix`, Muon: Newton–Schulz orthogonalizes each matrix as a whole, which no
//! set of dim-0 rows can do alone).
//!
//! For such an optimizer every rank, one parameter at a time, gathers the parameter, its
//! gradient and its optimizer state from the shards of its `dp_shard` group, steps the plugin
//! on the full tensors and keeps its own rows of the updated parameter and state. Every rank
//! thus runs the very arithmetic a single process runs on the same full tensors, so its rows
//! carry the same bits. The redundant update costs compute (the group repeats each matrix's
//! update), not memory between steps.
//!
//! The state stays sharded between steps (gathered with the parameter, not kept whole): that
//! keeps the per-rank optimizer bytes falling as 1/N, which is what FSDP promises, and leaves
//! checkpoints and resharding as they are for every optimizer. Only one parameter's full
//! tensors exist at a time, while the next parameter's gathers are already in flight.

use crate::fsdp::Fsdp;
use crate::TrainError;
use anneal_dist::{Collective, Dim0Shard, Pending};
use anneal_engine::Tensor;
use anneal_runtime::plugins::PluginOptimizer;
use std::collections::BTreeMap;

/// How the trained parameters are sharded, when they are: the layout and the `dp_shard`
/// communicator.
pub(crate) type Sharding<'a> = Option<(&'a Fsdp, &'a dyn Collective)>;

/// Steps `optimizer` on `named` (this rank's shards under FSDP): on the shards directly unless
/// the optimizer needs full matrices and the parameters are sharded. Collective then.
pub(crate) fn optimizer_step(
    optimizer: &mut PluginOptimizer,
    sharding: Sharding<'_>,
    named: &[(String, Tensor)],
    step: u64,
    lr: f64,
) -> Result<(), TrainError> {
    match sharding {
        Some((fsdp, comm)) if optimizer.spec().needs_full_matrix => {
            full_matrix_step(optimizer, fsdp.layouts(), comm, named, step, lr)
        }
        _ => Ok(optimizer.step(named, step, lr)?),
    }
}

/// One parameter's gathers in flight: its rows layout, then the parameter, its gradient and
/// each state tensor the optimizer already holds (keys in the optimizer's order).
struct Gathering<'a> {
    index: usize,
    shape: &'a [usize],
    shard: &'a Dim0Shard,
    param: Box<dyn Pending>,
    grad: Box<dyn Pending>,
    state: Vec<(String, Box<dyn Pending>)>,
}

/// See the module docs. `layouts` are the full shapes and rows of `named`, in its order.
fn full_matrix_step(
    optimizer: &mut PluginOptimizer,
    layouts: &[(Vec<usize>, Dim0Shard)],
    comm: &dyn Collective,
    named: &[(String, Tensor)],
    step: u64,
    lr: f64,
) -> Result<(), TrainError> {
    // Whether a parameter has a gradient is the same on every rank (the reduction sets it
    // from every data-parallel rank's flags), so every rank walks the same parameters and
    // the collectives pair up.
    let todo: Vec<usize> = (0..named.len())
        .filter(|&i| named[i].1.grad().is_some())
        .collect();
    let mut next = match todo.first() {
        Some(&i) => Some(start_gather(optimizer, layouts, comm, named, i)?),
        None => None,
    };
    for k in 0..todo.len() {
        let g = next
            .take()
            .expect("a gathering is started for every parameter in turn");
        // The next parameter's gathers overlap this one's update.
        if let Some(&i) = todo.get(k + 1) {
            next = Some(start_gather(optimizer, layouts, comm, named, i)?);
        }
        let (name, shard_param) = &named[g.index];
        let grad_dtype = shard_param
            .grad()
            .expect("only parameters with a gradient are gathered")
            .dtype();
        let full = |h: Box<dyn Pending>, dtype| -> Result<Tensor, TrainError> {
            Ok(Tensor::from_vec(g.shard.finish_gather(h)?, g.shape)?.to_dtype(dtype)?)
        };
        let param = full(g.param, shard_param.dtype())?.requires_grad_();
        param.set_grad(Some(full(g.grad, grad_dtype)?))?;
        let mut state = BTreeMap::new();
        for (key, h) in g.state {
            let dtype = optimizer.state()[&key].dtype();
            state.insert(key, full(h, dtype)?);
        }
        optimizer.step_with_state(&[(name.clone(), param.clone())], &mut state, step, lr)?;
        // `detach` shares the storage: the trainer's leaf itself changes, as in a plain step.
        shard_param.detach().copy_from(&rows(&param, g.shard)?)?;
        for (key, t) in state {
            let mine = rows(&t, g.shard)?;
            optimizer.state_mut().insert(key, mine);
        }
    }
    Ok(())
}

/// Starts the gathers of parameter `i` of `named`: the parameter, its gradient and each state
/// tensor of it the optimizer holds.
fn start_gather<'a>(
    optimizer: &PluginOptimizer,
    layouts: &'a [(Vec<usize>, Dim0Shard)],
    comm: &dyn Collective,
    named: &[(String, Tensor)],
    i: usize,
) -> Result<Gathering<'a>, TrainError> {
    let (name, p) = &named[i];
    let (shape, shard) = (&layouts[i].0, &layouts[i].1);
    let grad = p
        .grad()
        .expect("only parameters with a gradient are gathered");
    // A state the optimizer has not created yet (its first step) is missing on every rank
    // alike; the plugin then starts it from its declared initial value.
    let mut state = Vec::new();
    for s in &optimizer.spec().state {
        let key = format!("{name}.{}", s.name);
        if let Some(t) = optimizer.state().get(&key) {
            let h = shard.start_all_gather(comm, &t.to_vec_f32())?;
            state.push((key, h));
        }
    }
    Ok(Gathering {
        index: i,
        shape,
        shard,
        param: shard.start_all_gather(comm, &p.to_vec_f32())?,
        grad: shard.start_all_gather(comm, &grad.to_vec_f32())?,
        state,
    })
}

/// This rank's rows of a full tensor, as a tensor of its own (same dtype).
fn rows(full: &Tensor, shard: &Dim0Shard) -> Result<Tensor, TrainError> {
    let v = full.to_vec_f32();
    let t = Tensor::from_vec(shard.slice(&v).to_vec(), &shard.shape(full.shape()))?;
    Ok(t.to_dtype(full.dtype())?)
}
