//! The job's processes as the trainer sees them: the device mesh from `[parallelism]`, the
//! data-parallel communicator, and which slice of the global batch this rank trains on.
//!
//! Data parallelism by replicas (DDP) is what runs: every rank holds the whole model, reads
//! the same global batch from the same loader (so the data order does not depend on the number
//! of ranks) and trains on its consecutive share of the step's micro-batches; the gradients are
//! summed (each micro-batch's loss already carries `1 / micro-batches`, so the sum is the
//! average) before the norm, clipping and the optimizer, so every replica applies the same update.

use crate::TrainError;
use anneal_config::JobConfig;
use anneal_dist::{Collective, Mesh, MeshDim, Single};
use anneal_engine::Tensor;
use std::ops::Range;

/// The trainer's view of the job's processes.
pub struct Dist {
    mesh: Mesh,
    /// The data-parallel communicator (the `dp_replicate` dimension).
    dp: Box<dyn Collective>,
}

impl Dist {
    /// One process: no MPI.
    pub fn single() -> Dist {
        Dist {
            mesh: Mesh::new([1; 6], 1, 0).expect("a mesh of ones fits one process"),
            dp: Box::new(Single::new()),
        }
    }

    /// The mesh `cfg.parallelism` asks for over `world`'s processes, and its data-parallel
    /// communicator; a mesh that does not fit the world size, or that needs a dimension other
    /// than `dp_replicate`, is a user error naming the keys. Collective over `world`.
    pub fn new(cfg: &JobConfig, world: &dyn Collective) -> Result<Dist, TrainError> {
        let mesh = Mesh::new(cfg.parallelism.degrees(), world.size(), world.rank())?;
        for dim in MeshDim::ALL {
            if dim != MeshDim::DpReplicate && mesh.degree(dim) > 1 {
                return Err(TrainError::Config(format!(
                    "config: `parallelism.{}` resolves to {}: only dp_replicate (DDP) runs across processes so far; set parallelism.{} = 1",
                    dim.key(),
                    mesh.degree(dim),
                    dim.key()
                )));
            }
        }
        let dp = if world.size() == 1 {
            Box::new(Single::new()) as Box<dyn Collective>
        } else {
            mesh.comm(world, MeshDim::DpReplicate)?
        };
        let dist = Dist { mesh, dp };
        dist.check_batch(cfg)?;
        Ok(dist)
    }

    /// The global batch must split into whole micro-batches per data-parallel rank.
    fn check_batch(&self, cfg: &JobConfig) -> Result<(), TrainError> {
        let t = &cfg.training;
        let n = self.dp.size();
        let micro = t.batch_size / t.micro_batch_size;
        if !micro.is_multiple_of(n) {
            return Err(TrainError::Config(format!(
                "config: `training.batch_size` ({}) / `training.micro_batch_size` ({}) = {micro} micro-batches per step do not split evenly over {n} data-parallel ranks (parallelism.dp_replicate); make the micro-batch count a multiple of {n}",
                t.batch_size, t.micro_batch_size
            )));
        }
        Ok(())
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

    /// The data-parallel communicator.
    pub fn dp(&self) -> &dyn Collective {
        self.dp.as_ref()
    }

    /// The step's micro-batches (of `n_micro`, in loader order) this rank trains on.
    pub fn my_micro_batches(&self, n_micro: usize) -> Range<usize> {
        let per = n_micro / self.size();
        self.rank() * per..(self.rank() + 1) * per
    }

    /// Sums the parameters' gradients over the data-parallel ranks, in f32, in one buffer. A
    /// parameter that got no gradient on any rank keeps none (so an optimizer skips it as in a
    /// single process); one that got a gradient on some rank gets the sum on every rank.
    pub fn all_reduce_grads(&self, named: &[(String, Tensor)]) -> Result<(), TrainError> {
        if self.size() == 1 {
            return Ok(());
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
        self.sum_identically(&mut buf)?;
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
                p.set_grad(Some(g))?;
            }
            at += n;
        }
        Ok(())
    }

    /// Sums `buf` over the ranks so that every rank holds the very same bits: a reduce-scatter
    /// (each block summed once, by its owner) then an all-gather of the blocks. An all-reduce
    /// may round differently on different ranks, which would let the replicas drift apart.
    fn sum_identically(&self, buf: &mut Vec<f32>) -> Result<(), TrainError> {
        let n = self.size();
        let len = buf.len();
        buf.resize(len.div_ceil(n) * n, 0.0);
        let mut block = vec![0f32; buf.len() / n];
        self.dp.reduce_scatter_sum(buf, &mut block)?;
        self.dp
            .all_gather((&block[..]).into(), (&mut buf[..]).into())?;
        buf.truncate(len);
        Ok(())
    }

    /// Fails when the replicas' parameters differ (they must stay bitwise equal: the same
    /// start, the same summed gradients, the same update): every rank compares its digest
    /// of `named` with rank 0's. Returns the digest.
    pub fn check_replicas(&self, named: &[(String, Tensor)]) -> Result<u64, TrainError> {
        // FNV-1a over the parameters' bytes in name order: cheap, and any differing bit shows.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for (_, p) in named {
            for b in p.to_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        let root = self.broadcast_u64(h, 0)?;
        if root != h {
            return Err(TrainError::Dist(anneal_dist::DistError::Diverged {
                rank: self.rank(),
                digest: h,
                root,
            }));
        }
        Ok(h)
    }

    /// Every rank's values of `local`, concatenated in rank order.
    pub fn gather_f32(&self, local: &[f32]) -> Result<Vec<f32>, TrainError> {
        let mut out = vec![0f32; local.len() * self.size()];
        self.dp.all_gather(local.into(), (&mut out[..]).into())?;
        Ok(out)
    }

    /// The largest of every rank's `v`.
    pub fn max_u64(&self, v: u64) -> Result<u64, TrainError> {
        let mut out = vec![0i64; self.size()];
        let local = [i64::try_from(v).unwrap_or(i64::MAX)];
        self.dp
            .all_gather((&local[..]).into(), (&mut out[..]).into())?;
        Ok(out.into_iter().max().unwrap_or(0).max(0) as u64)
    }

    /// Whether any rank's `flag` is set (a stop request reaches ranks at different steps; they
    /// must stop at the same one).
    pub fn any(&self, flag: bool) -> Result<bool, TrainError> {
        if self.size() == 1 {
            return Ok(flag);
        }
        let mut v = [f32::from(u8::from(flag))];
        self.dp.all_reduce_sum(&mut v)?;
        Ok(v[0] > 0.0)
    }

    /// `root`'s `v` on every rank.
    pub fn broadcast_u64(&self, v: u64, root: usize) -> Result<u64, TrainError> {
        let mut bytes = v.to_le_bytes();
        self.dp.broadcast(&mut bytes, root)?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// Bytes this rank has handed to collectives so far.
    pub fn comm_bytes(&self) -> u64 {
        self.dp.comm_bytes()
    }
}
