//! Per-block FSDP units (ZeRO-3 as FSDP2 runs it): one unit per block (the parameters whose
//! `ParamSpec::layer` is that block) and one outer unit (embedding, final norm, output: every
//! other trained parameter). Each micro-batch:
//! - the outer unit is gathered before `embed` and kept until its backward ends (FSDP2's root);
//! - block `i`'s parameters are gathered right before its forward, with block `i + 1`'s gather
//!   started meanwhile (prefetch), and their memory is released when its forward ends
//!   (`reshard_after_forward`): the graph keeps the tensors, without their values;
//! - the backward gathers them again right before it enters the block (block `i - 1`'s gather
//!   prefetched meanwhile): in place for a block that kept its activations, as fresh leaves for
//!   a recomputed one (the recompute asks for them);
//! - once every parameter of a unit has its final gradient (the engine's leaf hooks), the unit's
//!   reduce-scatter starts while the backward goes on; units are issued strictly in the order
//!   last block, ..., first block, outer, so every rank starts the same collectives in the same
//!   order (a unit not complete yet holds back the ones after it; what is left when the
//!   backward returns is issued then, a parameter without gradient sending zeros).
//!
//! Gathers and reduce-scatters each have their own communicator, so each keeps one fixed order
//! whatever the interleaving of the two. Under expert parallelism a unit's expert parameters
//! (group 1) travel over the expert-FSDP ranks (those holding the same experts) in their own
//! gather and reduce-scatter beside the dense ones' (group 0, over `dp_shard`). Every rank runs the same model on the same shapes, so
//! its graph (and so the sequence of collectives it starts and waits for) is the same.
//!
//! On GPU ranks with NCCL ([`crate::parallel::nccl`]) and f32 gathers, the shard rows, the
//! gathers, the reduce-scatters and the step's gradient rows all stay on the GPU ([`device`]).
//!
//! The driver lives in a thread-local for the length of a step ([`Units::activate`]): the
//! runner's hook and the engine's gradient hooks must be `Send + Sync`, the communicators are
//! not, and both only ever run on the training thread.

mod device;
mod scatter;

pub(crate) use device::set_shard_grads_device;

use super::{Experts, GatherCodec};
use crate::parallel::nccl::ShardNccl;
use crate::parallel::staged;
use crate::TrainError;
use anneal_dist::{Collective, Dim0Shard, Pending};
use anneal_engine::{DType, Device, Tensor};
use anneal_runtime::plugins::{Params, Stage, StageParams};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;

/// Tensors by name.
type Named = Vec<(String, Tensor)>;

/// One trained parameter as the units see it.
struct Member {
    /// Its index in the trainer's name-ordered parameters.
    index: usize,
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    shard: Dim0Shard,
    /// 0: sharded over `dp_shard`; 1: an expert parameter's slice, over the expert-FSDP ranks.
    group: usize,
}

/// A group's gather and reduce-scatter communicators.
type GroupComms = (Box<dyn Collective>, Box<dyn Collective>);

/// One collective in flight: over a [`Collective`] (host buffers) or NCCL on device buffers.
enum Flight {
    Host(Box<dyn Pending>),
    Device(device::Buffers),
}

impl Flight {
    /// The host collective's received values (a device one is the caller's mistake).
    fn wait_host(self) -> Result<Vec<f32>, TrainError> {
        match self {
            Flight::Host(p) => Ok(p.wait()?),
            Flight::Device(_) => Err(TrainError::Engine(engine_err(
                "a device collective waited for as a host one",
            ))),
        }
    }
}

/// Collectives in flight for one unit, one per group it has members in.
type InFlight = Vec<(usize, Flight)>;

/// Whether the micro-batch is in its forward or its backward.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Forward,
    Backward,
}

/// A unit's gathered parameters during a micro-batch.
#[derive(Default)]
struct Live {
    /// The full parameters (leaves), in member order; empty before the first gather.
    leaves: Vec<Tensor>,
    /// Bumped whenever `leaves` are replaced, so hooks of older leaves are ignored.
    generation: u64,
    /// Which leaves' gradients are final in this backward.
    fired: Vec<bool>,
    /// Whether the leaves' storages are released (between forward and backward).
    released: bool,
}

/// What one micro-batch holds.
struct MicroBatch {
    phase: Phase,
    /// Per block, then the outer unit last.
    live: Vec<Live>,
    /// Gathers started and not yet taken, by unit.
    gathers: BTreeMap<usize, InFlight>,
    /// The next block whose forward gather starts.
    next_forward: usize,
    /// The next block whose backward gather starts (counting down); `None` once all started.
    next_backward: Option<usize>,
    /// How many units (in scatter order) were issued.
    scattered: usize,
    /// Reduce-scatters in flight, oldest first.
    scatters: VecDeque<(usize, InFlight)>,
    /// The first failure inside a gradient hook (which cannot return one).
    failed: Option<TrainError>,
}

/// The per-block FSDP driver of one rank (see the module docs).
pub(crate) struct Units {
    /// Members per unit: blocks `0..n`, then the outer unit at index `n`.
    units: Vec<Vec<Member>>,
    /// Parameters in the trainer's order (for the step's gradient rows).
    n_params: usize,
    /// The gathers' and the reduce-scatters' communicators of each group, split from
    /// `dp_shard`'s (and the expert-FSDP one's) at the first step (not at construction: rank 0
    /// builds its trainer while the others wait for it).
    comms: Option<Vec<GroupComms>>,
    /// This step's shard rows of every parameter (as f32), by trainer index.
    local: Vec<Vec<f32>>,
    buffers: Named,
    /// The step's gradient rows of every parameter, summed over its micro-batches.
    grad_rows: Vec<Vec<f32>>,
    /// Whether this rank got a gradient for each parameter this step.
    got_grad: Vec<bool>,
    /// Bytes of full parameters held (gathered and not released or dropped), and their peak.
    full_bytes: u64,
    full_bytes_peak: u64,
    /// Block units whose reduce-scatter started while the backward was still running, this step.
    early_scatters: u64,
    /// How the parameter gathers travel.
    codec: GatherCodec,
    /// Bytes this rank sent in parameter gathers this step.
    gather_bytes: u64,
    /// Where this step's shards live: gathered parameters are rebuilt there.
    device: Device,
    /// NCCL on device buffers for the shard group, when the job runs it ([`device`]).
    dev: Option<device::DeviceGroup>,
    /// On device buffers: this step's f32 shard rows and gradient rows, by trainer index.
    local_dev: Vec<Tensor>,
    grad_dev: Vec<Tensor>,
    mb: Option<MicroBatch>,
}

/// What a step's units hand to the optimizer side.
pub(crate) struct StepGrads {
    /// This rank's rows of every parameter's gradient (trainer order), summed over the shard
    /// ranks and this rank's micro-batches.
    pub rows: Vec<Vec<f32>>,
    /// Whether this rank got a gradient for each parameter.
    pub got: Vec<bool>,
    /// The most bytes of full parameters held at once during the step.
    pub full_bytes_peak: u64,
    /// Block units whose reduce-scatter started before their micro-batch's backward returned
    /// (overlapping it), over the step's micro-batches.
    pub early_scatters: u64,
    /// Bytes this rank sent in parameter all-gathers during the step.
    pub gather_bytes: u64,
    /// On device buffers: the gradient rows on the GPU (then `rows` is empty).
    pub device_rows: Option<Vec<Tensor>>,
}

thread_local! {
    /// The driver of the step running on this thread.
    static ACTIVE: RefCell<Option<Rc<RefCell<Units>>>> = const { RefCell::new(None) };
}

/// Keeps a driver active on this thread until dropped.
pub(crate) struct Active(());

impl Drop for Active {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.borrow_mut().take());
    }
}

fn engine_err(msg: impl std::fmt::Display) -> anneal_engine::Error {
    anneal_engine::Error::Invalid {
        op: "fsdp",
        msg: msg.to_string(),
    }
}

/// Runs `f` on the active driver.
fn with_active<T>(f: impl FnOnce(&mut Units) -> Result<T, TrainError>) -> anneal_engine::Result<T> {
    let units = ACTIVE
        .with(|a| a.borrow().clone())
        .ok_or_else(|| engine_err("block parameters were asked for outside a training step"))?;
    let mut units = units
        .try_borrow_mut()
        .map_err(|_| engine_err("block parameters were asked for while the driver was busy"))?;
    f(&mut units).map_err(|e| match e {
        TrainError::Engine(e) => e,
        other => engine_err(other),
    })
}

/// The runner's view of the active driver ([`StageParams`]).
pub(crate) struct Hook;

impl StageParams for Hook {
    fn params(&self, stage: Stage) -> anneal_engine::Result<Params> {
        with_active(|u| u.params(stage))
    }

    fn after_forward(&self, stage: Stage) -> anneal_engine::Result<()> {
        with_active(|u| u.after_forward(stage))
    }

    fn before_backward(&self, layer: usize) -> anneal_engine::Result<()> {
        with_active(|u| u.before_backward(layer))
    }

    fn expert_parallel(&self) -> Option<anneal_engine::ops::ExpertParallel> {
        crate::parallel::ep::current()
    }
}

/// A leaf's gradient became final: `unit`'s member `k` of leaf generation `generation`.
fn grad_final(unit: usize, generation: u64, k: usize) {
    let Some(units) = ACTIVE.with(|a| a.borrow().clone()) else {
        return;
    };
    // Hooks run between the driver's own calls, never inside one.
    let Ok(mut units) = units.try_borrow_mut() else {
        return;
    };
    let res = units.mark_final(unit, generation, k);
    if let (Err(e), Some(mb)) = (res, units.mb.as_mut()) {
        mb.failed.get_or_insert(e);
    }
}

impl Units {
    /// The units of `named` (the trainer's name-ordered full parameters) for `n_layers` blocks,
    /// `layer_of` giving each parameter's block, sharded over `ranks` with this rank `rank`
    /// (expert parameters as `experts` lays them out); the parameter gathers travel encoded by
    /// `codec`.
    pub fn new(
        named: &[(String, Tensor)],
        layer_of: impl Fn(&str) -> Option<usize>,
        n_layers: usize,
        (rank, ranks): (usize, usize),
        experts: Option<&Experts>,
        codec: GatherCodec,
    ) -> Units {
        let mut units: Vec<Vec<Member>> = (0..=n_layers).map(|_| Vec::new()).collect();
        for (index, (name, p)) in named.iter().enumerate() {
            let unit = layer_of(name).filter(|&l| l < n_layers).unwrap_or(n_layers);
            let (shape, shard, group) = match experts.and_then(|e| e.layout(name, p.shape())) {
                Some((_, local, shard)) => (local, shard, 1),
                None => (
                    p.shape().to_vec(),
                    Dim0Shard::new(p.shape(), rank, ranks),
                    0,
                ),
            };
            units[unit].push(Member {
                index,
                name: name.clone(),
                shape,
                dtype: p.dtype(),
                shard,
                group,
            });
        }
        Units {
            units,
            n_params: named.len(),
            comms: None,
            local: Vec::new(),
            buffers: Vec::new(),
            grad_rows: Vec::new(),
            got_grad: Vec::new(),
            full_bytes: 0,
            full_bytes_peak: 0,
            early_scatters: 0,
            codec,
            gather_bytes: 0,
            device: Device::Cpu,
            dev: None,
            local_dev: Vec::new(),
            grad_dev: Vec::new(),
            mb: None,
        }
    }

    fn n_layers(&self) -> usize {
        self.units.len() - 1
    }

    /// Bytes of unit `u`'s full parameters.
    fn unit_bytes(&self, u: usize) -> u64 {
        self.units[u]
            .iter()
            .map(|m| (m.shard.full_len() * m.dtype.size_in_bytes()) as u64)
            .sum()
    }

    /// The units in words: the outer unit's and the largest block's full bytes.
    pub fn summary(&self) -> String {
        let n = self.n_layers();
        let block = (0..n).map(|u| self.unit_bytes(u)).max().unwrap_or(0);
        format!(
            "fsdp: {n} block units (largest {block} bytes in full) and an outer unit of {} bytes; a step holds about the outer unit and two blocks in full",
            self.unit_bytes(n)
        )
    }

    /// Starts a step on `this`: `shards` are this rank's parameter shards (read once here; the
    /// optimizer changes them only after the step), `buffers` go to every stage as they are;
    /// `comm` is the `dp_shard` communicator and `efsdp` the expert-FSDP one under expert
    /// parallelism (collective at the first step, which splits them); `nccl`, NCCL gather and
    /// reduce-scatter communicators over `comm`'s ranks, replaces `comm`'s splits: on device
    /// buffers when the gathers are f32 and the shards live on its GPU, else with host buffers.
    /// The returned guard keeps the driver reachable from the hooks until dropped.
    pub fn activate(
        this: &Rc<RefCell<Units>>,
        comm: &dyn Collective,
        efsdp: Option<&dyn Collective>,
        nccl: Option<ShardNccl>,
        shards: &[(String, Tensor)],
        buffers: &[(String, Tensor)],
    ) -> Result<Active, TrainError> {
        {
            let mut u = this.borrow_mut();
            let device = shards.first().map_or(Device::Cpu, |(_, p)| p.device());
            if u.comms.is_none() {
                let mut comms = Vec::new();
                // `dp_shard`'s NCCL communicators when the job built them (every rank or none).
                let prebuilt = usize::from(nccl.is_some());
                match nccl {
                    // Every rank agrees: the same codec, shards on each rank's own GPU.
                    Some(n) if u.codec == GatherCodec::F32 && efsdp.is_none() => {
                        let group = device::DeviceGroup::new(n);
                        if group.device() != device {
                            return Err(TrainError::Engine(engine_err(format!(
                                "the shards live on {device}, NCCL on {}",
                                group.device()
                            ))));
                        }
                        u.dev = Some(group);
                    }
                    Some((g, s)) => comms.push((Box::new(g) as _, Box::new(s) as _)),
                    None => {}
                }
                for c in std::iter::once(comm).chain(efsdp).skip(prebuilt) {
                    let gather = c.split(0, c.rank() as u32)?;
                    let scatter = c.split(0, c.rank() as u32)?;
                    comms.push((gather, scatter));
                }
                u.comms = Some(comms);
            }
            u.device = device;
            if u.dev.is_some() {
                u.begin_step_device(shards)?;
            } else {
                u.local = shards.iter().map(|(_, p)| staged::flatten(&[p])).collect();
            }
            u.buffers = buffers.to_vec();
            u.grad_rows = shards.iter().map(|(_, p)| vec![0.0; p.numel()]).collect();
            u.got_grad = vec![false; u.n_params];
            u.full_bytes = 0;
            u.full_bytes_peak = 0;
            u.early_scatters = 0;
            u.gather_bytes = 0;
            u.mb = None;
        }
        ACTIVE.with(|a| *a.borrow_mut() = Some(this.clone()));
        Ok(Active(()))
    }

    /// Group `group`'s gather and reduce-scatter communicators.
    fn comms(&self, group: usize) -> Result<(&dyn Collective, &dyn Collective), TrainError> {
        let (g, s) = self
            .comms
            .as_ref()
            .and_then(|c| c.get(group))
            .ok_or_else(|| {
                TrainError::Engine(engine_err(format!(
                    "a collective of group {group} before the first step's activation, or without its communicator"
                )))
            })?;
        Ok((g.as_ref(), s.as_ref()))
    }

    /// The groups unit `u` has members in, and each one's members (positions in the unit).
    fn groups(&self, u: usize) -> Vec<(usize, Vec<usize>)> {
        let mut out: Vec<(usize, Vec<usize>)> = Vec::new();
        for (k, m) in self.units[u].iter().enumerate() {
            match out.iter_mut().find(|(g, _)| *g == m.group) {
                Some((_, ks)) => ks.push(k),
                None => out.push((m.group, vec![k])),
            }
        }
        out.sort_by_key(|(g, _)| *g);
        out
    }

    fn hold(&mut self, bytes: u64) {
        self.full_bytes += bytes;
        self.full_bytes_peak = self.full_bytes_peak.max(self.full_bytes);
    }

    fn let_go(&mut self, bytes: u64) {
        self.full_bytes = self.full_bytes.saturating_sub(bytes);
    }

    fn mb(&mut self) -> Result<&mut MicroBatch, TrainError> {
        self.mb.as_mut().ok_or_else(|| {
            TrainError::Engine(engine_err("a block was reached outside a micro-batch"))
        })
    }

    /// Starts unit `u`'s all-gathers: every member's rows, padded to its block, in one buffer
    /// per group. A group of one rank (experts not sharded further) sends nothing encoded.
    fn start_gather(&mut self, u: usize) -> Result<(), TrainError> {
        if self.dev.is_some() {
            return self.start_gather_device(u);
        }
        let mut started = Vec::new();
        for (g, ks) in self.groups(u) {
            let members = &self.units[u];
            let mut send: Vec<f32> = Vec::new();
            for &k in &ks {
                let m = &members[k];
                send.extend_from_slice(&self.local[m.index]);
                send.resize(send.len() + m.shard.block_len() - m.shard.len(), 0.0);
            }
            let send = if self.comms(g)?.0.size() > 1 {
                let send = self.codec.encode(send);
                self.gather_bytes += 4 * send.len() as u64;
                send
            } else {
                send
            };
            started.push((g, Flight::Host(self.comms(g)?.0.iall_gather(send)?)));
        }
        let bytes = self.unit_bytes(u);
        self.hold(bytes);
        self.mb()?.gathers.insert(u, started);
        Ok(())
    }

    /// Unit `u`'s full parameters from its gather (started now if it was not), as tensors of
    /// each member's shape and dtype.
    fn take_gather(&mut self, u: usize) -> Result<Vec<Tensor>, TrainError> {
        let pending = match self.mb()?.gathers.remove(&u) {
            Some(p) => p,
            None => {
                self.start_gather(u)?;
                self.mb()?.gathers.remove(&u).expect("just started")
            }
        };
        if self.dev.is_some() {
            return self.take_gather_device(u, pending);
        }
        let groups = self.groups(u);
        let members = &self.units[u];
        let mut out: Vec<Option<Tensor>> = vec![None; members.len()];
        for (g, pending) in pending {
            let words = pending.wait_host()?;
            let ks = groups
                .iter()
                .find(|(gg, _)| *gg == g)
                .map(|(_, ks)| ks.as_slice())
                .unwrap_or_default();
            let stride: usize = ks.iter().map(|&k| members[k].shard.block_len()).sum();
            // Each rank's run decoded back to its padded rows.
            let all: Vec<f32> = if self.comms(g)?.0.size() > 1 {
                let run = self.codec.words(stride);
                words
                    .chunks(run.max(1))
                    .flat_map(|w| self.codec.decode(w, stride))
                    .collect()
            } else {
                words
            };
            let mut at = 0;
            for &k in ks {
                let m = &members[k];
                let mut full = Vec::with_capacity(m.shard.block_len() * m.shard.ranks);
                for r in 0..m.shard.ranks {
                    let from = r * stride + at;
                    full.extend_from_slice(&all[from..from + m.shard.block_len()]);
                }
                full.truncate(m.shard.full_len());
                at += m.shard.block_len();
                out[k] = Some(staged::rebuild(full, &m.shape, m.dtype, self.device)?);
            }
        }
        out.into_iter()
            .map(|t| {
                t.ok_or_else(|| {
                    TrainError::Engine(engine_err(format!("unit {u}: a member was not gathered")))
                })
            })
            .collect()
    }

    /// Fresh leaves for unit `u` from `values`, each telling the driver when its gradient is
    /// final.
    fn new_leaves(&mut self, u: usize, values: Vec<Tensor>) -> Result<(), TrainError> {
        let mb = self.mb()?;
        let live = &mut mb.live[u];
        live.generation += 1;
        let generation = live.generation;
        live.leaves = values.into_iter().map(|t| t.requires_grad_()).collect();
        live.fired = vec![false; live.leaves.len()];
        live.released = false;
        for (k, leaf) in live.leaves.iter().enumerate() {
            leaf.register_grad_hook(Box::new(move |_| grad_final(u, generation, k)))?;
        }
        Ok(())
    }

    /// Starts a micro-batch: gathers the outer unit (kept until its backward ends).
    pub fn begin_micro_batch(&mut self) -> Result<(), TrainError> {
        let n = self.n_layers();
        self.mb = Some(MicroBatch {
            phase: Phase::Forward,
            live: (0..=n).map(|_| Live::default()).collect(),
            gathers: BTreeMap::new(),
            next_forward: 0,
            next_backward: n.checked_sub(1),
            scattered: 0,
            scatters: VecDeque::new(),
            failed: None,
        });
        let outer = self.take_gather(n)?;
        self.new_leaves(n, outer)
    }

    /// The map a stage reads: the outer unit, block `block`'s parameters, the buffers.
    fn map(&self, block: Option<usize>) -> Result<Params, TrainError> {
        let mb = self
            .mb
            .as_ref()
            .ok_or_else(|| TrainError::Engine(engine_err("a stage ran outside a micro-batch")))?;
        let n = self.n_layers();
        let units = std::iter::once(n).chain(block);
        let mut map = HashMap::new();
        for u in units {
            for (m, leaf) in self.units[u].iter().zip(&mb.live[u].leaves) {
                map.insert(m.name.clone(), leaf.clone());
            }
        }
        for (name, b) in &self.buffers {
            map.insert(name.clone(), b.clone());
        }
        Ok(Arc::new(map))
    }

    fn params(&mut self, stage: Stage) -> Result<Params, TrainError> {
        let n = self.n_layers();
        let phase = self.mb()?.phase;
        match (stage, phase) {
            (Stage::Layer(i), _) if i >= n => Err(TrainError::Engine(engine_err(format!(
                "block {i} of a model with {n} blocks"
            )))),
            (Stage::Layer(i), Phase::Forward) => {
                // Forward gathers start in block order, each block's with the next one's.
                while self.mb()?.next_forward <= (i + 1).min(n - 1) {
                    let next = self.mb()?.next_forward;
                    self.start_gather(next)?;
                    self.mb()?.next_forward += 1;
                }
                let values = self.take_gather(i)?;
                self.new_leaves(i, values)?;
                self.map(Some(i))
            }
            (Stage::Layer(i), Phase::Backward) => {
                // A recomputed block: fresh leaves collect its gradients.
                let values = self.backward_gather(i)?;
                let old = std::mem::take(&mut self.mb()?.live[i].leaves);
                let was_released = self.mb()?.live[i].released;
                if !was_released && !old.is_empty() {
                    let bytes = self.unit_bytes(i);
                    self.let_go(bytes);
                }
                self.new_leaves(i, values)?;
                self.map(Some(i))
            }
            (Stage::Embed, Phase::Forward) => {
                if n > 0 && self.mb()?.next_forward == 0 {
                    self.start_gather(0)?;
                    self.mb()?.next_forward = 1;
                }
                self.map(None)
            }
            _ => self.map(None),
        }
    }

    /// Unit `i`'s values for its backward: backward gathers start strictly from the last block
    /// down (so every rank starts them in one order), and the one after `i` is prefetched.
    fn backward_gather(&mut self, i: usize) -> Result<Vec<Tensor>, TrainError> {
        self.start_backward_gathers(Some(i.saturating_sub(1)))?;
        if self.mb()?.gathers.contains_key(&i) {
            self.take_gather(i)
        } else {
            Err(TrainError::Engine(engine_err(format!(
                "block {i}'s backward came twice or out of order"
            ))))
        }
    }

    /// Starts the backward gathers down to block `down_to` (all of them with `None`).
    fn start_backward_gathers(&mut self, down_to: Option<usize>) -> Result<(), TrainError> {
        while let Some(next) = self.mb()?.next_backward {
            if down_to.is_some_and(|d| next < d) {
                break;
            }
            self.start_gather(next)?;
            self.mb()?.next_backward = next.checked_sub(1);
        }
        Ok(())
    }

    fn after_forward(&mut self, stage: Stage) -> Result<(), TrainError> {
        let Stage::Layer(i) = stage else {
            return Ok(());
        };
        if self.mb()?.phase != Phase::Forward {
            return Ok(());
        }
        let live = &mut self.mb()?.live[i];
        if live.released {
            return Ok(());
        }
        for leaf in &live.leaves {
            leaf.release_storage();
        }
        live.released = true;
        let bytes = self.unit_bytes(i);
        self.let_go(bytes);
        Ok(())
    }

    fn before_backward(&mut self, i: usize) -> Result<(), TrainError> {
        if i >= self.n_layers() || !self.mb()?.live[i].released {
            return Ok(());
        }
        let values = self.backward_gather(i)?;
        let live = &mut self.mb()?.live[i];
        for (leaf, v) in live.leaves.iter().zip(&values) {
            leaf.restore_storage(v)?;
        }
        live.released = false;
        Ok(())
    }

    /// The forward is done: the backward is about to start (the last block's gather starts,
    /// overlapping the head's backward).
    pub fn begin_backward(&mut self) -> Result<(), TrainError> {
        self.mb()?.phase = Phase::Backward;
        let n = self.n_layers();
        self.start_backward_gathers(Some(n.saturating_sub(1)))
    }

    /// A forward without backward (evaluation) ended: waits for what it left in flight and
    /// lets go of its parameters.
    pub fn end_forward_only(&mut self) -> Result<(), TrainError> {
        let gathers = std::mem::take(&mut self.mb()?.gathers);
        for (_, g) in gathers.into_values().flatten() {
            self.settle(g)?;
        }
        self.mb = None;
        self.full_bytes = 0;
        Ok(())
    }

    /// The backward returned: issues what is left, waits for every collective of the
    /// micro-batch and lets go of its parameters.
    pub fn end_backward(&mut self) -> Result<(), TrainError> {
        self.issue_scatters(true)?;
        while !self.mb()?.scatters.is_empty() {
            self.finish_oldest_scatter()?;
        }
        // Gathers a rank's backward did not reach still run, so every rank ran the same ones.
        self.start_backward_gathers(None)?;
        let gathers = std::mem::take(&mut self.mb()?.gathers);
        for (u, g) in gathers {
            for (_, g) in g {
                self.settle(g)?;
            }
            let bytes = self.unit_bytes(u);
            self.let_go(bytes);
        }
        let mb = self.mb.take().expect("checked above");
        if let Some(e) = mb.failed {
            return Err(e);
        }
        self.full_bytes = 0;
        Ok(())
    }

    /// Waits for a collective in flight whose result is not needed.
    fn settle(&self, flight: Flight) -> Result<(), TrainError> {
        match (flight, &self.dev) {
            (Flight::Host(p), _) => drop(p.wait()?),
            (Flight::Device(b), Some(dev)) => {
                dev.synchronize()?;
                drop(b);
            }
            (Flight::Device(_), None) => {
                return Err(TrainError::Engine(engine_err(
                    "a device collective without its communicators",
                )))
            }
        }
        Ok(())
    }

    /// The step's gradients and figures; the step's copies of shards and buffers go.
    pub fn take_grads(&mut self) -> StepGrads {
        self.local = Vec::new();
        self.local_dev = Vec::new();
        self.buffers = Vec::new();
        let device_rows = self
            .dev
            .as_ref()
            .map(|_| std::mem::take(&mut self.grad_dev));
        StepGrads {
            device_rows,
            rows: std::mem::take(&mut self.grad_rows),
            got: std::mem::take(&mut self.got_grad),
            full_bytes_peak: self.full_bytes_peak,
            early_scatters: self.early_scatters,
            gather_bytes: self.gather_bytes,
        }
    }
}
