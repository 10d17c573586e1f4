//! Which parameters a rank holds, at which size, and the batch it trains on: the ground the
//! memory and communication figures stand on. Mirrors what the trainer does: pipeline stages
//! from [`crate::parallel::pp::layout::Layout`] (the embedding on the first stage, the other outer
//! parameters on the last), tensor-parallel slices of `Placement::tensor_parallel`, FSDP's
//! ceil-sized row blocks ([`anneal_dist::Dim0Shard`]) over `dp_shard × cp`, expert slices over
//! `ep`.

use crate::preflight::Degrees;
use crate::{BatchSplit, TrainError};
use anneal_config::JobConfig;
use anneal_engine::DType;
use anneal_plugin_api::spec::{ModelSpec, TensorParallel};
use std::ops::Range;

/// The part an outer (non-block) parameter plays, for the tensor-parallel collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outer {
    /// The token embedding (the first outer parameter the spec declares): stage 0.
    Embedding,
    /// Everything else outside the blocks (final norm, head): the last stage.
    Head,
}

/// One parameter (or buffer) as a rank holds it.
#[derive(Clone, Debug)]
pub struct Held {
    /// The global name.
    pub name: String,
    /// The global shape.
    pub shape: Vec<usize>,
    /// The rank's tensor-parallel slice's shape.
    pub local: Vec<usize>,
    /// Bytes per element.
    pub elem: u64,
    /// Its block, `None` outside the blocks.
    pub layer: Option<usize>,
    /// Its outer role, `None` in a block.
    pub outer: Option<Outer>,
    /// Its tensor-parallel split (`None` once `tp = 1`).
    pub split: Option<TensorParallel>,
    /// A per-head weight (its gradient summed over `tp`).
    pub per_head: bool,
    /// Trained (false for a buffer).
    pub trainable: bool,
    /// An expert stack (`expert_dim` set).
    pub expert: bool,
}

impl Held {
    /// Elements of the rank's slice (before FSDP).
    pub fn numel(&self) -> u64 {
        self.local.iter().map(|&d| d as u64).product()
    }

    /// Elements of one FSDP row block over `n` ranks, padded as on the wire: `ceil(rows / n)`
    /// rows of the slice.
    pub fn shard_numel(&self, n: usize) -> u64 {
        let rows = self.local.first().copied().unwrap_or(1) as u64;
        let row_len: u64 = self.local.iter().skip(1).map(|&d| d as u64).product();
        rows.div_ceil(n as u64) * row_len
    }
}

/// One rank's view of the job: rank 0's coordinates on every dimension but the pipeline's.
#[derive(Clone, Debug)]
pub struct RankView {
    /// The mesh.
    pub degrees: Degrees,
    /// Its pipeline rank.
    pub pp_rank: usize,
    /// Stages in the pipeline (`pp × pp_virtual_stages`).
    pub n_stages: usize,
    /// The stages it runs, each with its blocks, in chunk order (the schedule's `chunk` `c` is
    /// `stages[c]`).
    pub stages: Vec<(usize, Range<usize>)>,
    /// The pipeline's schedule, when there is one.
    pub schedule: Option<crate::parallel::pp::schedule::Schedule>,
    /// What it holds (trained parameters and buffers), in spec order.
    pub params: Vec<Held>,
    /// Trained parameters of the whole model (the pipeline's norm gathers a sum for each).
    pub all_trainable: usize,
    /// Micro-batches it trains on per step.
    pub micro_batches: usize,
    /// Tokens of each (rows × seq_len / cp).
    pub tokens: usize,
    /// The residual stream's width (the embedding's second dim).
    pub dim: usize,
    /// FSDP's shard group size (`dp_shard × cp`), 1 without FSDP.
    pub fsdp: usize,
    /// Sequence parallelism is on (`tp > 1` and `tp_sequence`).
    pub sequence: bool,
    /// The model's mixture of experts, `None` for a dense model.
    pub moe: Option<super::moe::Moe>,
}

impl RankView {
    /// The trained parameters it holds.
    pub fn trained(&self) -> impl Iterator<Item = &Held> {
        self.params.iter().filter(|p| p.trainable)
    }

    /// The ranks `p`'s rows are sharded over (1 without FSDP): `fsdp`, or for an expert stack
    /// under expert parallelism the expert-FSDP group (`fsdp / ep`, the ranks holding the same
    /// experts).
    pub fn shard_group(&self, p: &Held) -> usize {
        if p.expert && self.degrees.ep > 1 && self.fsdp > 1 {
            (self.fsdp / self.degrees.ep).max(1)
        } else {
            self.fsdp
        }
    }

    /// `p`'s elements on this rank: its FSDP rows (padded) over [`RankView::shard_group`] when
    /// sharded, its slice otherwise.
    pub fn rows(&self, p: &Held) -> u64 {
        if self.fsdp > 1 {
            p.shard_numel(self.shard_group(p))
        } else {
            p.numel()
        }
    }

    /// MoE layers among the blocks of its stages.
    pub fn moe_layers(&self) -> u64 {
        self.moe
            .as_ref()
            .map_or(0, |m| self.stages.iter().map(|(_, b)| m.layers_in(b)).sum())
    }

    /// Whether it holds the head (the last stage).
    pub fn has_head(&self) -> bool {
        self.stages.iter().any(|(s, _)| *s + 1 == self.n_stages)
    }

    /// Whether it holds the embedding (stage 0).
    pub fn has_embedding(&self) -> bool {
        self.stages.iter().any(|(s, _)| *s == 0)
    }
}

/// The view of every pipeline rank (one without pipeline), rank 0's first.
pub fn views(
    cfg: &JobConfig,
    spec: &ModelSpec,
    degrees: Degrees,
    processes: usize,
) -> Result<Vec<RankView>, TrainError> {
    let mesh = anneal_dist::Mesh::new(cfg.parallelism.degrees(), processes, 0)?;
    let t = &cfg.training;
    let n_micro = t.batch_size / t.micro_batch_size.max(1);
    let (micro_batches, rows) = match crate::parallel::dist::batch_split(cfg, &mesh)? {
        BatchSplit::MicroBatches => (n_micro / degrees.dp(), t.micro_batch_size),
        BatchSplit::Rows { rows } => (n_micro, rows),
    };
    let tokens = rows * t.seq_len / degrees.cp;
    let pipeline = (degrees.pp > 1)
        .then(|| {
            crate::parallel::pp::layout::Layout::new(
                cfg,
                spec.n_layers,
                &crate::parallel::pp::layout::block_costs(spec),
            )
        })
        .transpose()?;
    let n_stages = pipeline.as_ref().map_or(1, |l| l.n_stages());
    let embedding = spec
        .params
        .iter()
        .find(|p| p.layer.is_none())
        .map(|p| p.name.clone());
    let dim = spec
        .params
        .iter()
        .find(|p| Some(&p.name) == embedding.as_ref())
        .and_then(|p| p.shape.get(1).copied())
        .unwrap_or(0);
    let all_trainable = spec.params.iter().filter(|p| p.trainable).count();
    let mut out = Vec::with_capacity(degrees.pp);
    for pp_rank in 0..degrees.pp {
        let stages: Vec<(usize, Range<usize>)> = match &pipeline {
            // By chunk, as the schedule places them (ZBV's V puts stages 0 and 2p - 1 on the
            // first rank).
            Some(l) => (0..l.v)
                .map(|c| {
                    let s = l.stage_of(pp_rank, c);
                    (s, l.stages[s].clone())
                })
                .collect(),
            None => vec![(0, 0..spec.n_layers)],
        };
        let mut params = Vec::new();
        for p in &spec.params {
            let outer = match p.layer {
                Some(_) => None,
                None if Some(&p.name) == embedding.as_ref() => Some(Outer::Embedding),
                None => Some(Outer::Head),
            };
            let held = match (p.layer, outer) {
                (Some(l), _) => stages.iter().any(|(_, r)| r.contains(&l)),
                (None, Some(Outer::Embedding)) => stages.iter().any(|(s, _)| *s == 0),
                _ => stages.iter().any(|(s, _)| *s + 1 == n_stages),
            };
            if !held {
                continue;
            }
            let split = p.placement.tensor_parallel.filter(|_| degrees.tp > 1);
            let local = slice(&p.name, &p.shape, split, p.placement.expert_dim, degrees)?;
            params.push(Held {
                name: p.name.clone(),
                shape: p.shape.clone(),
                local,
                elem: DType::parse(&p.dtype).map_or(4, |d| d.size_in_bytes()) as u64,
                layer: p.layer,
                outer,
                split,
                per_head: p.placement.per_head,
                trainable: p.trainable,
                expert: p.placement.expert_dim.is_some(),
            });
        }
        out.push(RankView {
            degrees,
            pp_rank,
            n_stages,
            stages,
            params,
            all_trainable,
            micro_batches,
            tokens,
            dim,
            fsdp: if degrees.dp_shard > 1 {
                degrees.dp_shard * degrees.cp
            } else {
                1
            },
            sequence: degrees.tp > 1 && cfg.parallelism.tp_sequence,
            schedule: pipeline.as_ref().map(|l| l.schedule),
            moe: super::moe::Moe::of(spec),
        });
    }
    Ok(out)
}

/// The rank's slice of a parameter of `shape`: its tensor-parallel split (a dim that does not
/// divide is refused, naming `parallelism.tp`), then its experts over `ep`.
fn slice(
    name: &str,
    shape: &[usize],
    split: Option<TensorParallel>,
    expert_dim: Option<usize>,
    d: Degrees,
) -> Result<Vec<usize>, TrainError> {
    let mut local = shape.to_vec();
    let dim = match (split, shape.len()) {
        (None, _) | (_, 0) => None,
        (Some(TensorParallel::Column), 3) => Some(1),
        (Some(TensorParallel::Column | TensorParallel::Vocab), _) => Some(0),
        (Some(TensorParallel::Row), n) => Some(n - 1),
    };
    if let Some(i) = dim {
        if !local[i].is_multiple_of(d.tp) {
            return Err(TrainError::Config(format!(
                "config: `parallelism.tp` ({}) does not divide dim {i} ({}) of the parameter {name}; pick a tp that divides the model's heads and widths",
                d.tp, local[i]
            )));
        }
        local[i] /= d.tp;
    }
    if let (Some(e), true) = (expert_dim, d.ep > 1) {
        if let Some(n) = local.get_mut(e) {
            *n = n.div_ceil(d.ep);
        }
    }
    Ok(local)
}
