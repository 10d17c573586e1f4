//! The job's processes as the trainer sees them: the device mesh from `[parallelism]`, the
//! data-parallel communicator, and which slice of the global batch this rank trains on.
//!
//! Data parallelism by replicas (DDP) is what runs: every rank holds the whole model, reads
//! the same global batch from the same loader (so the data order does not depend on the number
//! of ranks) and trains on its consecutive share of the step's micro-batches (or, when their
//! count does not split over the ranks, on its consecutive rows of every one: [`BatchSplit`]);
//! the gradients are
//! summed (each micro-batch's loss already carries `1 / micro-batches`, so the sum is the
//! average) before the norm, clipping and the optimizer, so every replica applies the same update.
//! With `dp_shard > 1` the parameters are sharded ([`crate::parallel::fsdp`]); `dp_replicate` × `dp_shard`
//! is HSDP, and the data is split over all of their ranks. Expert parallelism (`ep`, which must
//! divide `dp_shard`) borrows the shard ranks: each keeps `1 / ep` of the experts
//! ([`crate::parallel::fsdp::Experts`]) and the MoE layers send token rows to them ([`crate::parallel::ep`]).
//! Pipeline parallelism (`pp`) splits the model's stages over its ranks ([`crate::parallel::pp`]); with
//! `dp_shard` as well, each stage is FSDP-sharded over its shard ranks (and with `ep`, a
//! stage's experts split over them, [`crate::parallel::pp::sharded`]).
//! Context parallelism (`cp`) splits each sequence over `cp` ranks ([`crate::parallel::cp`]): the batch
//! is still split over the data-parallel ranks only, but gradients, losses and statistics are
//! summed over data-parallel × `cp` ranks, and FSDP shards over `dp_shard` × `cp`.

use crate::TrainError;
use anneal_config::JobConfig;
use anneal_dist::{Collective, Mesh, MeshDim, Single};
use anneal_engine::{Device, Tensor};

/// The trainer's view of the job's processes.
pub struct Dist {
    mesh: Mesh,
    /// Every data-parallel rank (`dp_replicate` × `dp_shard`): the batch is split over it.
    dp: Box<dyn Collective>,
    /// How the global batch spreads over `dp`'s ranks.
    split: BatchSplit,
    /// The `dp_shard` communicator, when parameters are sharded.
    shard: Option<Box<dyn Collective>>,
    /// The `dp_replicate` communicator, when sharded parameters are also replicated (HSDP).
    replicate: Option<Box<dyn Collective>>,
    /// Under expert parallelism: the expert group (the ranks splitting the experts) and the
    /// expert-FSDP group (the ranks holding the same experts).
    experts: Option<anneal_dist::ExpertComms>,
    /// The `pp` communicator (this rank's pipeline), when `pp > 1`.
    pp: Option<Box<dyn Collective>>,
    /// The ranks that save a checkpoint together under pipeline parallelism (`pp` × `dp_shard`).
    pp_save: Option<Box<dyn Collective>>,
    /// Every rank of the job, when that is more than `dp` (pipeline stages, cp ranks): what the
    /// ranks agree on together (the step resumed from, a stop request).
    job: Option<Box<dyn Collective>>,
    /// Under context parallelism: this rank's `cp` group, and a second communicator over the
    /// same ranks for the attention ring (which installs it on the training thread).
    cp: Option<crate::parallel::cp::CpComms>,
    /// The `tp` communicator (this rank's tensor-parallel group), when `tp > 1`; shared with
    /// the forward's collectives while a step runs ([`crate::parallel::tp`]).
    tp: Option<std::rc::Rc<dyn Collective>>,
    /// Under TP × FSDP, the ranks of the first replica that save a checkpoint together
    /// (`dp_shard` × `cp` × `tp`: each holds rows no other rank of it holds); under PP × TP its
    /// `pp` × `tp` ranks (of the first `cp` coordinate under PP × TP × CP); under
    /// PP × TP × FSDP its `pp` × `dp_shard` × `cp` × `tp` ranks.
    tp_save: Option<Box<dyn Collective>>,
    /// NCCL on this rank's GPU for DDP's and FSDP's collectives, once
    /// [`Dist::start_device_collectives`] built them.
    device_comms: Option<crate::parallel::nccl::DeviceComms>,
    /// NCCL on this rank's GPU for the `tp`, `cp` and `ep` groups' collectives (installed on
    /// the training thread while this lives), once [`Dist::start_device_collectives`] built them.
    device_groups: Option<crate::parallel::nccl_groups::DeviceGroups>,
}

impl Dist {
    /// One process: no MPI.
    pub fn single() -> Dist {
        Dist {
            mesh: Mesh::new([1; 6], 1, 0).expect("a mesh of ones fits one process"),
            dp: Box::new(Single::new()),
            split: BatchSplit::MicroBatches,
            shard: None,
            replicate: None,
            experts: None,
            pp: None,
            pp_save: None,
            job: None,
            cp: None,
            tp: None,
            tp_save: None,
            device_comms: None,
            device_groups: None,
        }
    }

    /// The mesh `cfg.parallelism` asks for over `world`'s processes, and its data-parallel
    /// communicator; a mesh that does not fit the world size, or that needs a dimension other
    /// than `dp_replicate`, `dp_shard` and `ep`, is a user error naming the keys. Collective
    /// over `world`.
    pub fn new(cfg: &JobConfig, world: &dyn Collective) -> Result<Dist, TrainError> {
        let mut dist = Dist::unbatched(cfg, world)?;
        dist.split = batch_split(cfg, &dist.mesh)?;
        Ok(dist)
    }

    /// [`Dist::new`] without the check that `training.batch_size` splits into whole
    /// micro-batches per rank: for `anneal rl`, whose ranks split a step's prompts instead.
    pub fn unbatched(cfg: &JobConfig, world: &dyn Collective) -> Result<Dist, TrainError> {
        let mesh = Mesh::new(cfg.parallelism.degrees(), world.size(), world.rank())?;
        check_mesh(cfg, &mesh)?;
        let (rep, shard) = (
            mesh.degree(MeshDim::DpReplicate),
            mesh.degree(MeshDim::DpShard),
        );
        let pp = mesh.degree(MeshDim::Pp);
        // Every rank splits the same communicators in the same order (collective calls).
        let dp = if world.size() == 1 {
            Box::new(Single::new()) as Box<dyn Collective>
        } else {
            mesh.comm_of(world, &[MeshDim::DpReplicate, MeshDim::DpShard])?
        };
        let shard = if shard > 1 {
            // Under context parallelism the `cp` ranks of a shard group hold its rows too
            // (TorchTitan's dp_shard_cp): they train on the same sequences.
            Some(mesh.comm_of(world, &[MeshDim::DpShard, MeshDim::Cp])?)
        } else {
            None
        };
        let replicate = if shard.is_some() && rep > 1 {
            Some(mesh.comm(world, MeshDim::DpReplicate)?)
        } else {
            None
        };
        let experts = if mesh.degree(MeshDim::Ep) > 1 {
            Some(mesh.expert_comms(world)?)
        } else {
            None
        };
        // Pipeline communicators after the data-parallel ones, in the same order on every rank.
        let (pp, pp_save, job) = if pp > 1 {
            // Under context parallelism FSDP's rows are split over dp_shard × cp, so every cp
            // rank saves its own; unsharded, the cp ranks hold copies and the first one saves.
            let (dims, saves) = match shard.is_some() {
                true => (&[MeshDim::Pp, MeshDim::DpShard, MeshDim::Cp][..], true),
                false => (
                    &[MeshDim::Pp, MeshDim::DpShard][..],
                    mesh.coord(MeshDim::Cp) == 0,
                ),
            };
            // Every rank takes part in the split; the other replicas' groups go unused.
            let save = mesh.comm_of(world, dims)?;
            let save = (saves && mesh.coord(MeshDim::DpReplicate) == 0).then_some(save);
            let pp = mesh.comm(world, MeshDim::Pp)?;
            (Some(pp), save, Some(mesh.comm_of(world, &MeshDim::ALL)?))
        } else {
            (None, None, None)
        };
        let cp = crate::parallel::cp::CpComms::new(&mesh, world)?;
        let job = match (job, &cp) {
            (None, Some(_)) => Some(mesh.comm_of(world, &MeshDim::ALL)?),
            (job, _) => job,
        };
        // Tensor-parallel communicators last, in the same order on every rank.
        let (tp, job) = if mesh.degree(MeshDim::Tp) > 1 {
            let tp = mesh.comm(world, MeshDim::Tp)?;
            let job = match job {
                Some(j) => j,
                None => mesh.comm_of(world, &MeshDim::ALL)?,
            };
            (Some(std::rc::Rc::from(tp)), Some(job))
        } else {
            (None, job)
        };
        // Every rank takes part in the split; the other replicas' groups go unused.
        let first_replica = mesh.coord(MeshDim::DpReplicate) == 0;
        let tp_save = match (tp.is_some(), shard.is_some(), pp.is_some()) {
            (true, true, false) => {
                Some(mesh.comm_of(world, &[MeshDim::DpShard, MeshDim::Cp, MeshDim::Tp])?)
                    .filter(|_| first_replica)
            }
            // FSDP inside tensor-parallel stages: every rank of the first replica holds rows
            // no other rank of it holds.
            (true, true, true) => Some(mesh.comm_of(
                world,
                &[MeshDim::Pp, MeshDim::DpShard, MeshDim::Cp, MeshDim::Tp],
            )?)
            .filter(|_| first_replica),
            // Pipeline stages beside tp: every stage's tp ranks write their slices (under
            // context parallelism the cp ranks hold copies: the first cp coordinate's write).
            (true, false, true) => Some(mesh.comm_of(world, &[MeshDim::Pp, MeshDim::Tp])?)
                .filter(|_| first_replica && mesh.coord(MeshDim::Cp) == 0),
            _ => None,
        };
        let dist = Dist {
            mesh,
            dp,
            split: BatchSplit::MicroBatches,
            shard,
            replicate,
            experts,
            pp,
            pp_save,
            job,
            cp,
            tp,
            tp_save,
            device_comms: None,
            device_groups: None,
        };
        Ok(dist)
    }

    /// This process's rank in the data-parallel group.
    pub fn rank(&self) -> usize {
        self.dp.rank()
    }

    /// Data-parallel ranks.
    pub fn size(&self) -> usize {
        self.dp.size()
    }

    /// The resolved mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The resolved mesh's degrees.
    pub fn degrees(&self) -> crate::preflight::Degrees {
        crate::preflight::Degrees::of(&self.mesh)
    }

    /// The data-parallel communicator.
    pub fn dp(&self) -> &dyn Collective {
        self.dp.as_ref()
    }

    /// The ranks whose gradients, losses and statistics are summed: the data-parallel ranks,
    /// times the `cp` ranks under context parallelism (each holds part of every sequence).
    pub fn grads(&self) -> &dyn Collective {
        match &self.cp {
            Some(cp) => cp.grads.as_ref(),
            None => self.dp.as_ref(),
        }
    }

    /// This rank's context-parallel group (`None` unless `cp > 1`).
    pub fn cp(&self) -> Option<&dyn Collective> {
        self.cp.as_ref().map(|c| c.cp.as_ref())
    }

    /// The communicator the attention ring runs over (taken once, by the trainer, which
    /// installs it on the training thread), under context parallelism.
    pub fn take_ring_comm(&mut self) -> Option<Box<dyn Collective>> {
        self.cp.as_mut().and_then(|c| c.ring.take())
    }

    /// The `dp_shard` communicator when parameters are sharded (FSDP / HSDP).
    pub fn shard(&self) -> Option<&dyn Collective> {
        self.shard.as_deref()
    }

    /// The communicator over the ranks that differ from this one in `axis` alone, when the
    /// layout has one (`dp_replicate`'s: the replicas' under HSDP, every data-parallel rank's
    /// without FSDP).
    pub fn axis(&self, axis: crate::parallel::Axis) -> Option<&dyn Collective> {
        use crate::parallel::Axis;
        match axis {
            Axis::DpReplicate => match &self.shard {
                Some(_) => self.replicate(),
                None => Some(self.dp.as_ref()),
            },
            Axis::DpShard => self.shard(),
            Axis::Tp => self.tp().map(|c| c.as_ref()),
            Axis::Pp => self.pp(),
        }
    }

    /// The `pp` communicator (the ranks of this rank's pipeline, by stage) when `pp > 1`.
    pub fn pp(&self) -> Option<&dyn Collective> {
        self.pp.as_deref()
    }

    /// The ranks that write one checkpoint together, one shard each, when this rank is one of
    /// them: under pipeline parallelism every stage of the first replica; under FSDP / HSDP the
    /// `dp_shard` ranks of the first replica group; under TP × FSDP its `dp_shard` × `cp` × `tp`
    /// ranks (times `pp` with pipeline stages too); under PP × TP its `pp` × `tp` ranks. `None` when one rank saves it whole (or this
    /// rank's replica does not save).
    pub fn save_group(&self) -> Option<&dyn Collective> {
        if self.tp_save.is_some() {
            return self.tp_save.as_deref();
        }
        if let Some(tp) = &self.tp {
            // Tensor parallelism: each rank of the first replica's group saves its slices
            // (under context parallelism the cp ranks hold copies: the first one's group).
            let first =
                self.mesh.coord(MeshDim::DpReplicate) == 0 && self.mesh.coord(MeshDim::Cp) == 0;
            return first.then_some(tp.as_ref());
        }
        match &self.pp {
            Some(_) => self.pp_save.as_deref(),
            None if self.mesh.coord(MeshDim::DpReplicate) == 0 => self.shard(),
            None => None,
        }
    }

    /// The tensor-parallel degree (1 without tensor parallelism).
    pub fn tp_degree(&self) -> usize {
        self.mesh.degree(MeshDim::Tp)
    }

    /// The `tp` communicator when `tp > 1`.
    pub(crate) fn tp(&self) -> Option<&std::rc::Rc<dyn Collective>> {
        self.tp.as_ref()
    }

    /// The `dp_replicate` communicator of an HSDP mesh.
    pub fn replicate(&self) -> Option<&dyn Collective> {
        self.replicate.as_deref()
    }

    /// Under expert parallelism: the expert group (ranks ordered by the expert slice they
    /// hold) and the expert-FSDP group (the ranks holding this rank's slice).
    pub fn experts(&self) -> Option<(&dyn Collective, &dyn Collective)> {
        self.experts.as_ref().map(|(e, f)| (e.as_ref(), f.as_ref()))
    }

    /// Fails unless every data-parallel rank holds the same bits in `named` (tensors every rank
    /// keeps whole, such as the aux-loss-free balancing bias, which the ranks update from the
    /// same summed token counts); returns their digest.
    pub fn check_same(&self, named: &[(String, Tensor)]) -> Result<u64, TrainError> {
        self.check_same_over(self.grads(), named)
    }

    /// [`Dist::check_same`] over the ranks of `comm` (a tensor-parallel group, whose ranks keep
    /// the buffers whole and update them from the same whole-batch counts).
    pub fn check_same_over(
        &self,
        comm: &dyn Collective,
        named: &[(String, Tensor)],
    ) -> Result<u64, TrainError> {
        let h = digest(named);
        let mut bytes = h.to_le_bytes();
        comm.broadcast(&mut bytes, 0)?;
        let root = u64::from_le_bytes(bytes);
        if root != h {
            return Err(TrainError::Dist(anneal_dist::DistError::Diverged {
                rank: self.rank(),
                digest: h,
                root,
            }));
        }
        Ok(h)
    }

    /// For each parameter, whether any data-parallel rank has a gradient for it.
    pub fn any_grads(&self, named: &[(String, Tensor)]) -> Result<Vec<bool>, TrainError> {
        let mut flags: Vec<f32> = named
            .iter()
            .map(|(_, p)| p.grad().map_or(0.0, |_| 1.0))
            .collect();
        if self.grads().size() > 1 {
            self.grads().all_reduce_sum(&mut flags)?;
        }
        Ok(flags.into_iter().map(|f| f > 0.0).collect())
    }

    /// How the step's global batch spreads over the data-parallel ranks.
    pub fn batch_split(&self) -> BatchSplit {
        self.split
    }

    /// How many micro-batches of a step of `n_micro` this rank trains on.
    pub fn local_micro_batches(&self, n_micro: usize) -> usize {
        match self.split {
            BatchSplit::MicroBatches => n_micro / self.size(),
            BatchSplit::Rows { .. } => n_micro,
        }
    }

    /// This rank's rows of the step's micro-batch `i` (of `n_micro`, in loader order, `rows`
    /// rows each): all of them when it is one of this rank's consecutive micro-batches, its
    /// consecutive rows under a row split, none when another rank trains on it. The loader
    /// reads only these ([`crate::trainer`]'s `Loader::next_rows`).
    pub fn local_rows(&self, i: usize, n_micro: usize, rows: usize) -> std::ops::Range<usize> {
        match self.split {
            BatchSplit::MicroBatches => {
                let per = n_micro / self.size();
                match (self.rank() * per..(self.rank() + 1) * per).contains(&i) {
                    true => 0..rows,
                    false => 0..0,
                }
            }
            BatchSplit::Rows { rows } => self.rank() * rows..(self.rank() + 1) * rows,
        }
    }

    /// How many equal parts of the step one rank's micro-batch is (each part's mean loss
    /// carries `1 / parts`, so the sum over ranks and micro-batches is the step's mean): the
    /// step's micro-batches, times the ranks sharing each under a row split.
    pub fn loss_parts(&self, n_micro: usize) -> usize {
        match self.split {
            BatchSplit::MicroBatches => n_micro,
            BatchSplit::Rows { .. } => n_micro * self.size(),
        }
    }

    /// The step's micro-batch losses, in loader order, from every data-parallel rank's losses
    /// of its micro-batches (`gathered`: rank by rank): as they are when each rank trained on
    /// whole micro-batches, each micro-batch's ranks' means averaged (in rank order) under a
    /// row split.
    pub fn micro_batch_losses(&self, gathered: Vec<f32>) -> Vec<f32> {
        match self.split {
            BatchSplit::MicroBatches => gathered,
            BatchSplit::Rows { .. } => {
                let ranks = self.size();
                let per = gathered.len() / ranks.max(1);
                (0..per)
                    .map(|i| {
                        let sum: f64 = (0..ranks).map(|r| f64::from(gathered[r * per + i])).sum();
                        (sum / ranks as f64) as f32
                    })
                    .collect()
            }
        }
    }

    /// Sums the parameters' gradients over the data-parallel ranks, in f32, in one buffer. A
    /// parameter that got no gradient on any rank keeps none (so an optimizer skips it as in a
    /// single process); one that got a gradient on some rank gets the sum on every rank.
    pub fn all_reduce_grads(&self, named: &[(String, Tensor)]) -> Result<(), TrainError> {
        if self.grads().size() == 1 {
            return Ok(());
        }
        if let Some(nccl) = self.device_comms.as_ref().and_then(|d| d.grads.as_ref()) {
            if crate::parallel::nccl::all_reduce_grads(nccl, named)? {
                return Ok(());
            }
        }
        let total: usize = named.iter().map(|(_, p)| p.numel()).sum();
        let mut buf = Vec::with_capacity(total + named.len());
        for (_, p) in named {
            match p.grad() {
                Some(g) => buf.extend(g.to_vec_f32()),
                None => buf.resize(buf.len() + p.numel(), 0.0),
            }
        }
        // One flag per parameter: how many ranks had a gradient for it.
        buf.extend(named.iter().map(|(_, p)| p.grad().map_or(0.0, |_| 1.0)));
        sum_identically(self.grads(), &mut buf)?;
        let flags = &buf[total..];
        let mut at = 0;
        for ((_, p), &flag) in named.iter().zip(flags) {
            let n = p.numel();
            if flag > 0.0 {
                let g = Tensor::from_slice(&buf[at..at + n], p.shape())?;
                let g = match p.grad() {
                    Some(old) if old.dtype() != g.dtype() => g.to_dtype(old.dtype())?,
                    _ => g,
                };
                let g = super::staged::place(g, p.device())?;
                p.set_grad(Some(g))?;
            }
            at += n;
        }
        Ok(())
    }

    /// Fails when the replicas' parameters differ (they must stay bitwise equal: the same
    /// start, the same summed gradients, the same update): every rank compares its digest
    /// of `named` (its shards, under FSDP) with that of the first rank of its replica group.
    /// Returns the digest, or `None` when no rank holds a replica of this one's parameters
    /// (pure FSDP).
    pub fn check_replicas(&self, named: &[(String, Tensor)]) -> Result<Option<u64>, TrainError> {
        let h = digest(named);
        let group = match (&self.shard, &self.replicate) {
            (None, _) => self.grads(),
            (Some(_), Some(rep)) => rep.as_ref(),
            // Pure FSDP: each rank's shard is its own; nothing to compare.
            (Some(_), None) => return Ok(None),
        };
        let mut bytes = h.to_le_bytes();
        group.broadcast(&mut bytes, 0)?;
        let root = u64::from_le_bytes(bytes);
        if root != h {
            return Err(TrainError::Dist(anneal_dist::DistError::Diverged {
                rank: self.rank(),
                digest: h,
                root,
            }));
        }
        Ok(Some(h))
    }

    /// At job start, on a job of several processes on GPUs: builds NCCL communicators on this
    /// rank's GPU for DDP's gradient sum (or FSDP's gathers and reduce-scatters) when
    /// `ANNEAL_COLLECTIVES` and the machine allow it ([`crate::parallel::nccl`]), and returns
    /// the console note saying which path runs (`None` on the CPU or a single process, where
    /// nothing changes). Every rank agrees on the path; `nccl` asked for where some rank cannot
    /// run it is an error naming the variable. Collective over the job.
    pub fn start_device_collectives(
        &mut self,
        device: Device,
    ) -> Result<Option<String>, TrainError> {
        use crate::parallel::nccl::{self, Choice, DeviceComms, ENV};
        if self.job().size() == 1 || !matches!(device, Device::Cuda(_)) {
            return Ok(None);
        }
        let choice = nccl::choice()?;
        let why_not = match choice {
            Choice::Staged => Some(format!("{ENV} = staged")),
            _ => nccl::unavailable(device),
        };
        // One rank without NCCL keeps every rank staged (their collectives must match).
        let staged = self.any(why_not.is_some())?;
        if staged {
            let why = why_not.unwrap_or_else(|| "another rank cannot run NCCL".into());
            if choice == Choice::Nccl {
                return Err(TrainError::Config(format!(
                    "environment: `{ENV}` = nccl, but NCCL cannot run on this job's GPUs: {why}"
                )));
            }
            return Ok(Some(format!(
                "collectives: staged through host memory over MPI ({why})"
            )));
        }
        let Device::Cuda(ordinal) = device else {
            unreachable!("checked above")
        };
        let groups = [MeshDim::Tp, MeshDim::Cp, MeshDim::Ep]
            .into_iter()
            .any(|d| self.mesh.degree(d) > 1);
        let mut what = Vec::new();
        // Beside tp, cp or ep groups, FSDP's units keep their staged communicators.
        let data_parallel = self.shard.is_some() || self.grads().size() > 1;
        if data_parallel && !(groups && self.shard.is_some()) {
            let comms = DeviceComms::new(self.grads(), self.shard(), self.replicate(), ordinal)?;
            what.push(match (comms.grads.is_some(), comms.replicate.is_some()) {
                (true, _) => "DDP's gradient sum on device buffers",
                (false, false) => "FSDP's gathers and reduce-scatters on device buffers (f32 gathers; quantized or bf16 ones staged)",
                (false, true) => "FSDP's gathers and reduce-scatters and HSDP's replica sum on device buffers (f32 gathers; quantized or bf16 ones staged)",
            });
            self.device_comms = Some(comms);
        }
        let mesh_groups = crate::parallel::nccl_groups::DeviceGroups::install(
            self.tp().map(|c| c.as_ref()),
            self.cp(),
            self.experts().map(|(ep, _)| ep),
            self.pp(),
            ordinal,
        )?;
        let described = mesh_groups.describe();
        if !described.is_empty() {
            what.push(&described);
        }
        let note = format!(
            "collectives: NCCL on {device} for {}; every other collective staged through host memory over MPI{}",
            what.join(", "),
            crate::parallel::nccl_groups::still_staged(groups, self.shard.is_some())
        );
        self.device_groups = Some(mesh_groups);
        Ok(Some(note))
    }

    /// FSDP's gather and reduce-scatter NCCL communicators over the shard ranks, once (the
    /// units take them at their first step), when [`Dist::start_device_collectives`] built them.
    pub(crate) fn take_shard_device_comms(&self) -> Option<crate::parallel::nccl::ShardNccl> {
        self.device_comms.as_ref()?.shard.borrow_mut().take()
    }

    /// HSDP's NCCL communicator over the `dp_replicate` ranks (the replica sum of the gradient
    /// rows on device), when [`Dist::start_device_collectives`] built it.
    pub(crate) fn replicate_device_comm(&self) -> Option<&anneal_dist::nccl::Nccl> {
        self.device_comms.as_ref()?.replicate.as_ref()
    }

    /// Every rank's values of `local`, concatenated in rank order.
    pub fn gather_f32(&self, local: &[f32]) -> Result<Vec<f32>, TrainError> {
        let mut out = vec![0f32; local.len() * self.size()];
        self.dp.all_gather(local.into(), (&mut out[..]).into())?;
        Ok(out)
    }

    /// Every rank of the job (the data-parallel ranks unless there are pipeline stages).
    fn job(&self) -> &dyn Collective {
        self.job.as_deref().unwrap_or(self.dp.as_ref())
    }

    /// The largest of every rank's `v`.
    pub fn max_u64(&self, v: u64) -> Result<u64, TrainError> {
        let mut out = vec![0i64; self.job().size()];
        let local = [i64::try_from(v).unwrap_or(i64::MAX)];
        self.job()
            .all_gather((&local[..]).into(), (&mut out[..]).into())?;
        Ok(out.into_iter().max().unwrap_or(0).max(0) as u64)
    }

    /// Whether any rank's `flag` is set (a stop request reaches ranks at different steps; they
    /// must stop at the same one).
    pub fn any(&self, flag: bool) -> Result<bool, TrainError> {
        if self.job().size() == 1 {
            return Ok(flag);
        }
        let mut v = [f32::from(u8::from(flag))];
        self.job().all_reduce_sum(&mut v)?;
        Ok(v[0] > 0.0)
    }

    /// Rank 0's `result` of work it did while the others waited, shared with every rank of the
    /// job: a failure there fails them all ([`anneal_dist::led_by_rank0`]).
    pub fn led_by_rank0<T>(&self, result: Result<T, TrainError>) -> Result<T, TrainError> {
        anneal_dist::led_by_rank0(self.job(), result)
    }

    /// `root`'s `v` on every rank.
    pub fn broadcast_u64(&self, v: u64, root: usize) -> Result<u64, TrainError> {
        let mut bytes = v.to_le_bytes();
        self.job().broadcast(&mut bytes, root)?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// Bytes this rank has handed to collectives so far (every communicator split from the
    /// world shares one counter, so the pipeline's sends are in it too).
    pub fn comm_bytes(&self) -> u64 {
        self.dp.comm_bytes()
    }
}

/// How a step's global batch (`training.batch_size` rows in micro-batches of
/// `training.micro_batch_size`) spreads over the data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchSplit {
    /// Each rank trains on its consecutive share of the step's whole micro-batches (the step's
    /// losses then add up in the single process's order).
    MicroBatches,
    /// The micro-batches do not split over the ranks but their rows do (TorchTitan's local
    /// batch): every rank trains on every micro-batch, on its `rows` consecutive rows of it.
    Rows {
        /// Rows of each micro-batch per rank: `micro_batch_size / ranks`.
        rows: usize,
    },
}

/// The checks of the mesh against the rest of the config that need no process: the
/// pipeline's gathers, context parallelism's sequence cut. User errors naming the keys.
pub(crate) fn check_mesh(cfg: &JobConfig, mesh: &Mesh) -> Result<(), TrainError> {
    let (shard, pp) = (mesh.degree(MeshDim::DpShard), mesh.degree(MeshDim::Pp));
    if pp > 1 && shard > 1 && cfg.parallelism.fsdp_all_gather_dtype != "float32" {
        return Err(TrainError::Config(format!(
            "config: `parallelism.fsdp_all_gather_dtype` = \"{}\" with `parallelism.pp` ({pp}): pipeline stages gather their shards in float32; set parallelism.fsdp_all_gather_dtype = \"float32\"",
            cfg.parallelism.fsdp_all_gather_dtype
        )));
    }
    crate::parallel::cp::check_mesh(cfg, mesh)
}

/// How `mesh`'s data-parallel ranks split the global batch: by whole micro-batches when their
/// count divides by the ranks, else by rows when `training.micro_batch_size` does; neither is
/// a user error naming the keys that set the ranks.
pub(crate) fn batch_split(cfg: &JobConfig, mesh: &Mesh) -> Result<BatchSplit, TrainError> {
    let t = &cfg.training;
    let n = mesh.degree(MeshDim::DpReplicate) * mesh.degree(MeshDim::DpShard);
    let micro = t.batch_size / t.micro_batch_size;
    if micro.is_multiple_of(n) {
        return Ok(BatchSplit::MicroBatches);
    }
    if t.micro_batch_size.is_multiple_of(n) {
        return Ok(BatchSplit::Rows {
            rows: t.micro_batch_size / n,
        });
    }
    Err(TrainError::Config(format!(
        "config: `training.batch_size` ({}) / `training.micro_batch_size` ({}) = {micro} micro-batch(es) per step, and neither they nor the {} rows of a micro-batch split evenly over the {n} data-parallel ranks ({}); make the micro-batch count or training.micro_batch_size a multiple of {n}",
        t.batch_size,
        t.micro_batch_size,
        t.micro_batch_size,
        dp_keys(cfg, mesh)
    )))
}

/// The keys that make the data-parallel ranks, as set: `parallelism.dp_shard = 2`, with a
/// `-1` shown with what it resolved to.
fn dp_keys(cfg: &JobConfig, mesh: &Mesh) -> String {
    let p = &cfg.parallelism;
    let keys: Vec<String> = [
        ("dp_replicate", p.dp_replicate, MeshDim::DpReplicate),
        ("dp_shard", p.dp_shard, MeshDim::DpShard),
    ]
    .into_iter()
    .filter(|&(_, _, dim)| mesh.degree(dim) > 1)
    .map(|(key, set, dim)| match set {
        -1 => format!("parallelism.{key} = -1, here {}", mesh.degree(dim)),
        _ => format!("parallelism.{key} = {set}"),
    })
    .collect();
    keys.join(" × ")
}

/// FNV-1a over the tensors' bytes in name order: cheap, and any differing bit shows.
fn digest(named: &[(String, Tensor)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, p) in named {
        for b in p.to_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Sums `buf` over `comm`'s ranks so that every rank holds the very same bits: a reduce-scatter
/// (each block summed once, by its owner) then an all-gather of the blocks. An all-reduce may
/// round differently on different ranks, which would let replicas drift apart.
pub(crate) fn sum_identically(comm: &dyn Collective, buf: &mut Vec<f32>) -> Result<(), TrainError> {
    let n = comm.size();
    let len = buf.len();
    buf.resize(len.div_ceil(n) * n, 0.0);
    let mut block = vec![0f32; buf.len() / n];
    comm.reduce_scatter_sum(buf, &mut block)?;
    comm.all_gather((&block[..]).into(), (&mut buf[..]).into())?;
    buf.truncate(len);
    Ok(())
}
