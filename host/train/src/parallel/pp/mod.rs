//! Pipeline parallelism: the model's stages (`embed`, blocks, `head`) split into contiguous
//! pipeline stages over the `pp` ranks ([`layout`]), a step's micro-batches run through them in
//! a 1F1B, interleaved-1F1B or zero-bubble order ([`schedule`], [`zb`]: backwards split into
//! input and weight passes by the autograd), hidden tensors forward and their gradients
//! backward point-to-point ([`wire`]). Each rank holds (and trains, and saves) only its stages'
//! parameters; the loss of each micro-batch is computed on the last stage and shared, so the
//! step's loss and gradients are bitwise those of one process.

pub mod layout;
pub mod p2p_plan;
pub mod schedule;
pub(crate) mod sharded;
pub(crate) mod tp;
pub(crate) mod whole;
pub mod wire;
pub mod zb;

use crate::outputs::{weighted_aux, StepOutputs};
use crate::TrainError;
use anneal_data::Batch;
use anneal_dist::Collective;
use anneal_engine::autograd::WeightGrads;
use anneal_engine::ops::{cross_entropy, CrossEntropy};
use anneal_engine::{DType, Tensor};
use anneal_runtime::plugins::{ForwardOpts, Params, PluginModel, StageInput};
use layout::Layout;
use schedule::Op;
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;
use wire::{Kind, Wire};

/// One rank's place in the pipeline.
pub struct Pipeline {
    /// The stages and their blocks.
    pub layout: Layout,
    /// This rank's coordinate along `pp`.
    rank: usize,
}

/// What a pipelined step needs from the trainer.
pub struct StepCtx<'a> {
    /// The model.
    pub model: &'a PluginModel,
    /// This rank's parameters and buffers.
    pub params: &'a Params,
    /// Positions `[T]`.
    pub positions: &'a Tensor,
    /// Forward options (recompute).
    pub opts: &'a ForwardOpts,
    /// The autocast dtype of the forward (`training.dtype`).
    pub amp: Option<DType>,
    /// `training.aux_loss_weights`.
    pub aux_weights: &'a BTreeMap<String, f64>,
    /// What each micro-batch's loss is scaled by (`1 / micro-batches of the step`), or `None`
    /// for one micro-batch.
    pub scale: Option<f32>,
}

impl StepCtx<'_> {
    /// Where this rank's stages compute (its parameters' device): token ids, targets and what
    /// arrives from a neighbour stage land there.
    fn device(&self) -> anneal_engine::Device {
        self.params
            .values()
            .next()
            .map_or(anneal_engine::Device::Cpu, |t| t.device())
    }
}

/// What a pipelined step did on this rank.
pub struct StepResult {
    /// Each of this data-parallel rank's micro-batches' loss (the same on every stage).
    pub losses: Vec<f32>,
    /// The auxiliary losses and statistics of this rank's stages.
    pub outputs: StepOutputs,
    /// Seconds spent waiting for a neighbour's activation or gradient.
    pub wait_s: f64,
    /// Seconds spent computing forwards and backwards.
    pub busy_s: f64,
}

/// What a forward left for its backward.
struct Stash {
    /// The received input (a leaf whose gradient goes back), except on the first stage.
    input: Option<Tensor>,
    /// What the backward starts from: the scaled loss on the last stage, else the packed output
    /// (with the scaled auxiliary loss appended when the stage emitted one).
    root: Tensor,
    /// Values of the packed output (what the next stage's gradient holds).
    out_len: usize,
    /// Whether `root` ends with an auxiliary loss (its seed gradient is 1).
    has_aux: bool,
}

impl Pipeline {
    /// The pipeline rank `rank` sees.
    pub fn new(layout: Layout, rank: usize) -> Pipeline {
        Pipeline { layout, rank }
    }

    /// The global stages this rank runs, by chunk.
    pub fn my_stages(&self) -> Vec<usize> {
        let mut stages: Vec<usize> = (0..self.layout.v)
            .map(|c| self.layout.stage_of(self.rank, c))
            .collect();
        // Evaluation runs them in pipeline order.
        stages.sort_unstable();
        stages
    }

    /// The pipeline rank that runs stage `s`.
    fn rank_of(&self, s: usize) -> usize {
        self.layout.rank_of(s)
    }

    /// Whether this rank holds a parameter of block `layer`, or (for `None`) one outside the
    /// blocks that `embed` (`in_embed`) or `head` (`in_head`) reads; one that neither reads
    /// stays on the first rank.
    pub fn owns(&self, layer: Option<usize>, in_embed: bool, in_head: bool) -> bool {
        let last = self.layout.n_stages() - 1;
        let stage = match layer {
            Some(l) => self.layout.stage_of_layer(l),
            None if in_head && !in_embed => last,
            None => 0,
        };
        self.rank_of(stage) == self.rank
    }

    /// One line for the log.
    pub fn summary(&self, micro_batches: usize) -> String {
        format!(
            "pipeline: {} stage(s) on {} rank(s) ({} per rank); this rank runs stage(s) {:?}; {}; bubble in theory {:.3} with {micro_batches} micro-batch(es)",
            self.layout.n_stages(),
            self.layout.p,
            self.layout.v,
            self.my_stages(),
            self.layout.describe(),
            self.theory_bubble(micro_batches)
        )
    }

    /// The schedule's idle fraction in theory for `m` micro-batches.
    pub fn theory_bubble(&self, m: usize) -> f64 {
        schedule::theory_bubble(self.layout.schedule, self.layout.p, self.layout.v, m)
    }

    /// Runs forward and backward of `batches` (this data-parallel rank's micro-batches, in
    /// order) through this rank's stages in the schedule's order; gradients accumulate on the
    /// parameters' leaves. Collective over `comm` (the `pp` communicator).
    pub fn step(
        &self,
        comm: &dyn Collective,
        ctx: &StepCtx<'_>,
        batches: &[Batch],
    ) -> Result<StepResult, TrainError> {
        self.step_with(comm, ctx, batches, None, &mut |_, out, b| {
            loss_of(out, b, ctx.opts)
        })
    }

    /// [`Pipeline::step`] with the last stage's loss of each micro-batch computed by `loss`
    /// (given the micro-batch's index, the head's outputs and the batch) instead of the
    /// cross-entropy: how `anneal rl` trains through the pipeline. The loss it returns is what
    /// [`StepResult::losses`] reports and what the backward starts from (plus the auxiliary
    /// losses, scaled by [`StepCtx::scale`] like the cross-entropy, and by `aux_scale` too:
    /// RL's losses carry the whole step's normalizers, its auxiliary losses are averaged).
    pub fn step_with(
        &self,
        comm: &dyn Collective,
        ctx: &StepCtx<'_>,
        batches: &[Batch],
        aux_scale: Option<f32>,
        loss: &mut LossFn<'_>,
    ) -> Result<StepResult, TrainError> {
        let (p, v, m) = (self.layout.p, self.layout.v, batches.len());
        let n_stages = self.layout.n_stages();
        let mut stash: HashMap<(usize, usize), Stash> = HashMap::new();
        // Split backwards' weight passes, waiting for their `Weight` op.
        let mut weights: HashMap<(usize, usize), WeightGrads> = HashMap::new();
        let split = self.layout.schedule.splits_backward();
        let device = ctx.device();
        let plan = p2p_plan::plan(&self.layout, m, self.rank);
        let mut wire = Wire::new(comm, device, plan);
        let mut losses = vec![0f32; m];
        let mut outputs = StepOutputs::default();
        // A micro-batch's named outputs over this rank's chunks, added once all ran.
        let mut per_mb: Vec<MbOutputs> = (0..m).map(|_| MbOutputs::default()).collect();
        let (mut wait_s, mut busy_s) = (0.0, 0.0);
        for op in schedule::ops(self.layout.schedule, p, v, m, self.rank) {
            match op {
                Op::Forward { mb, chunk } => {
                    let s = self.layout.stage_of(self.rank, chunk);
                    let last = s + 1 == n_stages;
                    let b = &batches[mb];
                    let x = Tensor::from_slice(&b.inputs, &[b.batch, b.seq_len])?;
                    let x = x.to_device(device)?;
                    let (input, hidden) = if s == 0 {
                        (None, None)
                    } else {
                        let t = Instant::now();
                        let tag = wire::tag(Kind::Activation, s, mb);
                        let (leaf, h) = wire.recv_hidden(self.rank_of(s - 1), tag)?;
                        wait_s += t.elapsed().as_secs_f64();
                        (Some(leaf), Some(h))
                    };
                    let t = Instant::now();
                    let input_of = match hidden {
                        Some(h) => StageInput::Hidden(h),
                        None => StageInput::Tokens(&x),
                    };
                    let (part, ce) = {
                        let _amp = anneal_engine::autocast::set_autocast(ctx.amp);
                        let part = ctx.model.forward_part(
                            ctx.params,
                            input_of,
                            self.layout.stages[s].clone(),
                            last,
                            ctx.positions,
                            ctx.opts,
                        )?;
                        let ce = match last {
                            true => Some(loss(mb, &part.hidden, b)?),
                            false => None,
                        };
                        (part, ce)
                    };
                    let aux = weighted_aux(ctx.aux_weights, &part.aux_losses)?;
                    per_mb[mb].add(aux.as_ref(), part.aux_losses, part.stats)?;
                    let aux = match (aux, aux_scale) {
                        (Some(a), Some(k)) => Some(a.mul_scalar(k)?),
                        (aux, _) => aux,
                    };
                    if chunk + 1 == v {
                        std::mem::take(&mut per_mb[mb]).flush(&mut outputs)?;
                    }
                    let scaled = |t: Tensor| match ctx.scale {
                        Some(k) => t.mul_scalar(k),
                        None => Ok(t),
                    };
                    let entry = match ce {
                        Some(ce) => {
                            losses[mb] = ce.item()?;
                            let total = match aux {
                                Some(a) => ce.add(&a)?,
                                None => ce,
                            };
                            Stash {
                                input,
                                root: scaled(total)?,
                                out_len: 0,
                                has_aux: false,
                            }
                        }
                        None => {
                            let tag = wire::tag(Kind::Activation, s + 1, mb);
                            let packed =
                                wire.send_hidden(&part.hidden, self.rank_of(s + 1), tag)?;
                            let out_len = packed.numel();
                            let (root, has_aux) = match aux {
                                Some(a) => {
                                    let a = scaled(a)?.reshape(&[1])?;
                                    (anneal_engine::ops::cat(&[packed, a], 0)?, true)
                                }
                                None => (packed, false),
                            };
                            Stash {
                                input,
                                root,
                                out_len,
                                has_aux,
                            }
                        }
                    };
                    stash.insert((mb, chunk), entry);
                    busy_s += t.elapsed().as_secs_f64();
                }
                Op::Backward { mb, chunk } => {
                    let s = self.layout.stage_of(self.rank, chunk);
                    let e = stash.remove(&(mb, chunk)).ok_or_else(|| {
                        TrainError::Pipeline(format!(
                            "the schedule runs the backward of micro-batch {mb} on stage {s} before its forward"
                        ))
                    })?;
                    // Under a zero-bubble schedule the weights' gradients wait for `Weight`.
                    let mut run_backward = |root: &Tensor, seed: Tensor| match split {
                        true => {
                            let now: Vec<&Tensor> = e.input.iter().collect();
                            weights.insert((mb, chunk), root.backward_split(seed, &now)?);
                            Ok::<_, TrainError>(())
                        }
                        false => Ok(root.backward_with(seed)?),
                    };
                    if s + 1 == n_stages {
                        let t = Instant::now();
                        // The scalar loss's seed, as `Tensor::backward` makes it.
                        let one = Tensor::ones(e.root.shape(), e.root.dtype())
                            .to_device(e.root.device())?;
                        run_backward(&e.root, one)?;
                        busy_s += t.elapsed().as_secs_f64();
                    } else {
                        let t = Instant::now();
                        let tag = wire::tag(Kind::Gradient, s + 1, mb);
                        let g = wire.recv_grad(e.out_len, self.rank_of(s + 1), tag)?;
                        wait_s += t.elapsed().as_secs_f64();
                        let t = Instant::now();
                        let seed = match e.has_aux {
                            true => anneal_engine::ops::cat(
                                &[g, Tensor::from_vec(vec![1f32], &[1])?.to_device(device)?],
                                0,
                            )?,
                            false => g,
                        };
                        run_backward(&e.root, seed)?;
                        busy_s += t.elapsed().as_secs_f64();
                    }
                    if let Some(leaf) = &e.input {
                        let tag = wire::tag(Kind::Gradient, s, mb);
                        wire.send_grad(leaf, self.rank_of(s - 1), tag)?;
                    }
                }
                Op::Weight { mb, chunk } => {
                    let w = weights.remove(&(mb, chunk)).ok_or_else(|| {
                        TrainError::Pipeline(format!(
                            "the schedule runs the weight pass of micro-batch {mb} on chunk {chunk} before its backward"
                        ))
                    })?;
                    let t = Instant::now();
                    w.run()?;
                    busy_s += t.elapsed().as_secs_f64();
                }
            }
        }
        wire.finish()?;
        // The last stage's losses reach every rank: the others add zeros, which is exact.
        comm.all_reduce_sum(&mut losses)?;
        Ok(StepResult {
            losses,
            outputs,
            wait_s,
            busy_s,
        })
    }

    /// The loss of each of `batches` without gradients (evaluation), on every rank: each
    /// batch runs through the stages in order, forwards only. Collective over `comm`.
    pub fn evaluate(
        &self,
        comm: &dyn Collective,
        ctx: &StepCtx<'_>,
        batches: &[Batch],
    ) -> Result<Vec<f32>, TrainError> {
        let _no_grad = anneal_engine::autograd::no_grad();
        let n_stages = self.layout.n_stages();
        let mut losses = vec![0f32; batches.len()];
        let plan = p2p_plan::evaluation(&self.layout, batches.len(), self.rank);
        let mut wire = Wire::new(comm, ctx.device(), plan);
        for (mb, b) in batches.iter().enumerate() {
            for s in self.my_stages() {
                let x = Tensor::from_slice(&b.inputs, &[b.batch, b.seq_len])?
                    .to_device(ctx.device())?;
                let input = if s == 0 {
                    StageInput::Tokens(&x)
                } else {
                    let tag = wire::tag(Kind::Activation, s, mb % 512);
                    StageInput::Hidden(wire.recv_hidden(self.rank_of(s - 1), tag)?.1)
                };
                let last = s + 1 == n_stages;
                let _amp = anneal_engine::autocast::set_autocast(ctx.amp);
                let part = ctx.model.forward_part(
                    ctx.params,
                    input,
                    self.layout.stages[s].clone(),
                    last,
                    ctx.positions,
                    ctx.opts,
                )?;
                if last {
                    losses[mb] = loss_of(&part.hidden, b, ctx.opts)?.item()?;
                } else {
                    let tag = wire::tag(Kind::Activation, s + 1, mb % 512);
                    wire.send_hidden(&part.hidden, self.rank_of(s + 1), tag)?;
                }
            }
        }
        wire.finish()?;
        comm.all_reduce_sum(&mut losses)?;
        Ok(losses)
    }
}

/// The cross-entropy of the last stage's `[logits]` against `b`'s targets (under tensor
/// parallelism the logits are this rank's vocabulary columns: [`tp::cross_entropy`]).
fn loss_of(out: &[Tensor], b: &Batch, opts: &ForwardOpts) -> Result<Tensor, TrainError> {
    let logits = out
        .first()
        .ok_or_else(|| TrainError::Pipeline("the head returned nothing".into()))?;
    let y = Tensor::from_slice(&b.targets, &[b.batch * b.seq_len])?;
    let y = y.to_device(logits.device())?;
    let v = logits.shape().last().copied().unwrap_or(0);
    let logits = logits.reshape(&[b.batch * b.seq_len, v])?;
    if let Some(ce) = tp::cross_entropy(&logits, &y, opts)? {
        return Ok(ce);
    }
    Ok(cross_entropy(&logits, &y, &CrossEntropy::default())?)
}

/// One micro-batch's named outputs over this rank's chunks (interleaving runs it through
/// several), added to the step's once.
#[derive(Default)]
struct MbOutputs {
    aux_total: Option<Tensor>,
    aux: Vec<(String, Tensor)>,
    stats: Vec<(String, Tensor)>,
}

impl MbOutputs {
    fn add(
        &mut self,
        total: Option<&Tensor>,
        aux: Vec<(String, Tensor)>,
        stats: Vec<(String, Tensor)>,
    ) -> Result<(), TrainError> {
        if let Some(t) = total {
            let t = t.detach();
            self.aux_total = Some(match self.aux_total.take() {
                Some(sum) => sum.add(&t)?,
                None => t,
            });
        }
        for (name, t) in aux {
            let t = t.detach();
            match self.aux.iter_mut().find(|(n, _)| *n == name) {
                Some((_, sum)) => *sum = sum.add(&t)?,
                None => self.aux.push((name, t)),
            }
        }
        self.stats.extend(stats);
        Ok(())
    }

    fn flush(self, outputs: &mut StepOutputs) -> Result<(), TrainError> {
        outputs.add(self.aux_total.as_ref(), &self.aux, &self.stats)?;
        Ok(())
    }
}

/// The last stage's loss of one micro-batch: from its index in the step, the head's outputs
/// (`[logits]`) and the batch, a scalar on the autograd graph.
pub type LossFn<'a> = dyn FnMut(usize, &[Tensor], &Batch) -> Result<Tensor, TrainError> + 'a;

/// What rank `rank` of a pipeline keeps: the pipeline, and its stages' trained parameters
/// and buffers.
pub type Staged = (Pipeline, Vec<(String, Tensor)>, Vec<(String, Tensor)>);

/// Sets up rank `rank` of the pipeline `cfg` asks for: the stage layout, the checks that need
/// the model (its layer count, tied parameters) and the step's micro-batch count
/// (`micro_batches`, per data-parallel rank), and what this rank keeps of `named` (every
/// trained parameter, sorted) and of `buffers`: its stages' own, the others dropped. A block's
/// buffers (a router's balancing bias) live with its parameters, so the stage that runs the
/// block holds the statistics its `before_optimizer_step` reads and updates them there.
pub fn setup(
    cfg: &anneal_config::JobConfig,
    model: &PluginModel,
    rank: usize,
    named: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    micro_batches: usize,
) -> Result<Staged, TrainError> {
    let spec = model.spec();
    let layout = Layout::new(cfg, spec.n_layers, &layout::block_costs(spec))?;
    let par = &cfg.parallelism;
    if layout.v > 1 && !micro_batches.is_multiple_of(layout.p) {
        return Err(TrainError::Config(format!(
            "config: `training.batch_size` / `training.micro_batch_size` gives {micro_batches} micro-batch(es) per data-parallel rank, but parallelism.pp_schedule = \"{}\" needs a multiple of parallelism.pp ({}); raise training.batch_size or lower training.micro_batch_size",
            par.pp_schedule, layout.p
        )));
    }
    wire::check_counts(micro_batches)?;
    let layer_of: HashMap<&str, Option<usize>> = spec
        .params
        .iter()
        .map(|p| (p.name.as_str(), p.layer))
        .collect();
    let outer: Vec<(String, Tensor)> = named
        .iter()
        .filter(|(n, _)| layer_of.get(n.as_str()).copied().flatten().is_none())
        .cloned()
        .collect();
    let (in_embed, in_head) = layout::outer_owners(model, &outer)?;
    let pipeline = Pipeline::new(layout, rank);
    let owned = |n: &String| {
        pipeline.owns(
            layer_of.get(n.as_str()).copied().flatten(),
            in_embed.contains(n),
            in_head.contains(n),
        )
    };
    let mine = named.into_iter().filter(|(n, _)| owned(n)).collect();
    let my_buffers = buffers.into_iter().filter(|(n, _)| owned(n)).collect();
    Ok((pipeline, mine, my_buffers))
}
