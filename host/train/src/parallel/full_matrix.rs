//! The optimizer step, and under FSDP the one for optimizers that must see whole matrices
//! (`needs_full_matrix`, Muon: Newton–Schulz orthogonalizes each matrix as a whole, which no
//! set of dim-0 rows can do alone).
//!
//! Such an optimizer runs in the **owner** layout: each parameter is assigned to one rank of
//! the `dp_shard` group, balanced by the cost of its update (Newton–Schulz on an `m × n` matrix
//! costs about `m · n · min(m, n)`) with a longest-processing-time heap; every rank sends its
//! rows of the parameter, its gradient and its optimizer state to the owner (one variable-count
//! all-to-all per bucket of parameters), the owner steps the plugin on the full tensors, and the
//! updated rows of the parameter and the state go back the same way. Each matrix is
//! orthogonalized once in the group, and the owner computes the very arithmetic a single process
//! runs on the same full tensors, so every rank's rows carry the same bits as one process's.
//!
//! The state stays sharded between steps: that keeps the per-rank optimizer bytes falling as
//! 1/N, which is what FSDP promises, and leaves checkpoints and resharding as they are for every
//! optimizer. Full tensors exist only on their owner, one bucket at a time.

use crate::parallel::fsdp::Fsdp;
use crate::TrainError;
use anneal_dist::{Collective, Dim0Shard};
use anneal_engine::Tensor;
use anneal_runtime::plugins::PluginOptimizer;
use std::collections::BTreeMap;

/// How the trained parameters are sharded, when they are: the layout and the `dp_shard`
/// communicator.
pub(crate) type Sharding<'a> = Option<(&'a Fsdp, &'a dyn Collective)>;

/// Steps `optimizer` on `named` (this rank's shards under FSDP): on the shards directly unless
/// the optimizer needs full matrices and the parameters are sharded. Collective then, and
/// returns what the owner layout did on this rank.
pub(crate) fn optimizer_step(
    optimizer: &mut PluginOptimizer,
    sharding: Sharding<'_>,
    named: &[(String, Tensor)],
    step: u64,
    lr: f64,
) -> Result<Option<OwnerFigures>, TrainError> {
    match sharding {
        Some((fsdp, comm)) if optimizer.spec().needs_full_matrix => {
            full_matrix_step(optimizer, fsdp.layouts(), comm, named, step, lr).map(Some)
        }
        _ => {
            optimizer.step(named, step, lr)?;
            Ok(None)
        }
    }
}

/// Full tensors a bucket may hold on its owners at once (f32 bytes of the parameters, their
/// gradients and state): bounds the all-to-all messages and the owners' memory.
const BUCKET_BYTES: usize = 256 << 20;

/// What the owner layout did on this rank in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct OwnerFigures {
    /// Parameters this rank owned (and stepped whole).
    pub owned: usize,
    /// Their estimated update cost, `Σ m · n · min(m, n)` (the Newton–Schulz products' scale).
    pub work: f64,
    /// Bytes this rank sent in the all-to-alls (rows out and updates back).
    pub bytes: u64,
}

/// The cost estimate of updating a parameter of `shape` whole.
fn update_cost(shape: &[usize]) -> f64 {
    match shape {
        [m, n] => (*m as f64) * (*n as f64) * (*m.min(n) as f64),
        _ => shape.iter().product::<usize>() as f64,
    }
}

/// Owners for parameters of costs `costs` over `ranks`: the costliest first, each to the rank
/// with the least work so far (the lowest rank on a tie), the same on every rank.
fn assign_owners(costs: &[f64], ranks: usize) -> Vec<usize> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    // Min-heap on (load, rank); loads as integers of the f64 bits keep the order total.
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (0..ranks.max(1))
        .map(|r| Reverse((0f64.to_bits(), r)))
        .collect();
    let mut owner = vec![0; costs.len()];
    for i in order {
        let Reverse((load, r)) = heap.pop().expect("one entry per rank");
        owner[i] = r;
        heap.push(Reverse(((f64::from_bits(load) + costs[i]).to_bits(), r)));
    }
    owner
}

/// See the module docs. `layouts` are the full shapes and rows of `named`, in its order.
fn full_matrix_step(
    optimizer: &mut PluginOptimizer,
    layouts: &[(Vec<usize>, Dim0Shard)],
    comm: &dyn Collective,
    named: &[(String, Tensor)],
    step: u64,
    lr: f64,
) -> Result<OwnerFigures, TrainError> {
    // Whether a parameter has a gradient is the same on every rank (the reduction sets it
    // from every data-parallel rank's flags), so every rank walks the same parameters and
    // the collectives pair up.
    let todo: Vec<usize> = (0..named.len())
        .filter(|&i| named[i].1.grad().is_some())
        .collect();
    let costs: Vec<f64> = todo.iter().map(|&i| update_cost(&layouts[i].0)).collect();
    let owners = assign_owners(&costs, comm.size());
    let mut figures = OwnerFigures::default();
    for (cost, _) in costs.iter().zip(&owners).filter(|(_, &o)| o == comm.rank()) {
        figures.owned += 1;
        figures.work += cost;
    }
    let tensors_per_param = 2 + optimizer.spec().state.len();
    let full_bytes = |i: usize| {
        let n: usize = layouts[i].0.iter().product();
        n * 4 * tensors_per_param
    };
    let mut start = 0;
    while start < todo.len() {
        let mut end = start + 1;
        let mut bytes = full_bytes(todo[start]);
        while end < todo.len() && bytes + full_bytes(todo[end]) <= BUCKET_BYTES {
            bytes += full_bytes(todo[end]);
            end += 1;
        }
        let bucket: Vec<(usize, usize)> = todo[start..end]
            .iter()
            .copied()
            .zip(owners[start..end].iter().copied())
            .collect();
        figures.bytes += step_bucket(optimizer, layouts, comm, named, &bucket, step, lr)?;
        start = end;
    }
    Ok(figures)
}

/// The state keys of parameter `name` the optimizer holds now, in its spec's order (none
/// before its first step: the plugin then starts them from their declared initial values).
fn held_state(optimizer: &PluginOptimizer, name: &str) -> Vec<String> {
    optimizer
        .spec()
        .state
        .iter()
        .map(|s| format!("{name}.{}", s.name))
        .filter(|k| optimizer.state().contains_key(k))
        .collect()
}

/// One bucket of `(parameter index, owner)`: rows to the owners, the owners' full steps, the
/// updated rows back. Returns the bytes this rank sent.
fn step_bucket(
    optimizer: &mut PluginOptimizer,
    layouts: &[(Vec<usize>, Dim0Shard)],
    comm: &dyn Collective,
    named: &[(String, Tensor)],
    bucket: &[(usize, usize)],
    step: u64,
    lr: f64,
) -> Result<u64, TrainError> {
    let (ranks, me) = (comm.size(), comm.rank());
    let rows_of = |i: usize, r: usize| Dim0Shard::new(&layouts[i].0, r, ranks).len();
    let held: Vec<Vec<String>> = bucket
        .iter()
        .map(|&(i, _)| held_state(optimizer, &named[i].0))
        .collect();
    let all_state: Vec<String> = optimizer
        .spec()
        .state
        .iter()
        .map(|s| s.name.clone())
        .collect();

    // Out: to each owner, my rows of each of its parameters, gradient, held state.
    let mut send = vec![Vec::new(); ranks];
    for (b, &(i, owner)) in bucket.iter().enumerate() {
        let (_, p) = &named[i];
        let out = &mut send[owner];
        out.extend(p.to_vec_f32());
        out.extend(
            p.grad()
                .expect("only parameters with a gradient")
                .to_vec_f32(),
        );
        for key in &held[b] {
            out.extend(optimizer.state()[key].to_vec_f32());
        }
    }
    let recv_counts: Vec<usize> = (0..ranks)
        .map(|r| {
            bucket
                .iter()
                .enumerate()
                .filter(|(_, &(_, o))| o == me)
                .map(|(b, &(i, _))| rows_of(i, r) * (2 + held[b].len()))
                .sum()
        })
        .collect();
    let (got, mut sent) = exchange(comm, send, &recv_counts)?;

    // The owner's full tensors (rank r's rows come r-th), stepped as one process would.
    let mut at = run_starts(&recv_counts);
    let mut take = |r: usize, n: usize| {
        let v = &got[at[r]..at[r] + n];
        at[r] += n;
        v
    };
    let mut back = vec![Vec::new(); ranks];
    for (b, &(i, owner)) in bucket.iter().enumerate() {
        if owner != me {
            continue;
        }
        let (name, shard_param) = &named[i];
        let shape = &layouts[i].0;
        let n_tensors = 2 + held[b].len();
        let mut full: Vec<Vec<f32>> = vec![Vec::new(); n_tensors];
        for r in 0..ranks {
            let len = rows_of(i, r);
            for f in full.iter_mut() {
                f.extend_from_slice(take(r, len));
            }
        }
        let grad_dtype = shard_param.grad().expect("has a gradient").dtype();
        let mut full = full.into_iter();
        let mut tensor = |dtype| -> Result<Tensor, TrainError> {
            let v = full.next().expect("one run per tensor");
            super::staged::rebuild(v, shape, dtype, shard_param.device())
        };
        let param = tensor(shard_param.dtype())?.requires_grad_();
        param.set_grad(Some(tensor(grad_dtype)?))?;
        let mut state = BTreeMap::new();
        for key in &held[b] {
            let dtype = optimizer.state()[key].dtype();
            state.insert(key.clone(), tensor(dtype)?);
        }
        optimizer.step_with_state(&[(name.clone(), param.clone())], &mut state, step, lr)?;
        let updated = param.to_vec_f32();
        let states: Vec<Vec<f32>> = all_state
            .iter()
            .map(|s| state[&format!("{name}.{s}")].to_vec_f32())
            .collect();
        for (r, out) in back.iter_mut().enumerate() {
            let shard = Dim0Shard::new(shape, r, ranks);
            out.extend_from_slice(shard.slice(&updated));
            for st in &states {
                out.extend_from_slice(shard.slice(st));
            }
        }
    }

    // Back: each rank's rows of the updated parameters and their whole state.
    let recv_counts: Vec<usize> = (0..ranks)
        .map(|owner| {
            bucket
                .iter()
                .filter(|&&(_, o)| o == owner)
                .map(|&(i, _)| rows_of(i, me) * (1 + all_state.len()))
                .sum()
        })
        .collect();
    let (got, sent_back) = exchange(comm, back, &recv_counts)?;
    sent += sent_back;
    let mut at = run_starts(&recv_counts);
    for &(i, owner) in bucket {
        let (name, shard_param) = &named[i];
        let shard = &layouts[i].1;
        let local_shape = shard.shape(&layouts[i].0);
        let len = shard.len();
        let mut next = || {
            let v = got[at[owner]..at[owner] + len].to_vec();
            at[owner] += len;
            v
        };
        let device = shard_param.device();
        let p = super::staged::rebuild(next(), &local_shape, shard_param.dtype(), device)?;
        // `detach` shares the storage: the trainer's leaf itself changes, as in a plain step.
        shard_param.detach().copy_from(&p)?;
        for s in &all_state {
            let key = format!("{name}.{s}");
            let dtype = optimizer
                .state()
                .get(&key)
                .map_or(anneal_engine::DType::F32, |t| t.dtype());
            let t = super::staged::rebuild(next(), &local_shape, dtype, device)?;
            optimizer.state_mut().insert(key, t);
        }
    }
    Ok(sent)
}

/// Where each source rank's run starts in an all-to-all's result.
fn run_starts(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &n| {
            let start = *at;
            *at += n;
            Some(start)
        })
        .collect()
}

/// A variable-count all-to-all of f32 runs: `send[r]` goes to rank `r`, `recv_counts[r]` values
/// come from rank `r` (in rank order in the result). Returns the values and the bytes sent.
fn exchange(
    comm: &dyn Collective,
    send: Vec<Vec<f32>>,
    recv_counts: &[usize],
) -> Result<(Vec<f32>, u64), TrainError> {
    let send_counts: Vec<usize> = send.iter().map(Vec::len).collect();
    let flat = send.concat();
    let mut got = vec![0f32; recv_counts.iter().sum()];
    comm.all_to_all_v(
        (&flat[..]).into(),
        &send_counts,
        (&mut got[..]).into(),
        recv_counts,
    )?;
    let me = comm.rank();
    let away: usize = send_counts
        .iter()
        .enumerate()
        .filter(|&(r, _)| r != me)
        .map(|(_, n)| n)
        .sum();
    Ok((got, 4 * away as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_balance_the_work_longest_first() {
        // 8 matrices of 64×64, 2 of 256×64, vectors: the two big ones go to different ranks.
        let mut costs = vec![update_cost(&[64, 64]); 8];
        costs.extend([update_cost(&[256, 64]), update_cost(&[64, 256])]);
        costs.extend([update_cost(&[64]); 4]);
        let owners = assign_owners(&costs, 2);
        assert_ne!(owners[8], owners[9]);
        let load = |r: usize| -> f64 {
            costs
                .iter()
                .zip(&owners)
                .filter(|(_, &o)| o == r)
                .map(|(c, _)| c)
                .sum()
        };
        let (a, b) = (load(0), load(1));
        assert!((a - b).abs() / (a + b) < 0.1, "{a} vs {b}");
        assert_eq!(assign_owners(&costs, 2), owners, "the same on every call");
        assert!(assign_owners(&costs, 1).iter().all(|&o| o == 0));
        // More ranks than parameters: each gets at most one.
        let few = assign_owners(&costs[..3], 4);
        let mut sorted = few.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 3);
    }
}
