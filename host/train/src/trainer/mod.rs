//! The trainer: a model plugin, its parameters, an optimizer plugin, a schedule and a data
//! loader, advanced one optimizer step at a time. The parallel layouts it takes at setup are
//! in `layouts.rs`; saving and restoring its state in `state.rs`; the named steps of one
//! training step in `step.rs`.

mod chat_data;
mod data;
mod layouts;
mod state;
mod step;

pub use data::RunFiles;

use crate::harness::{clip_grads, Provenance};
use crate::parallel::dist::Dist;
use crate::parallel::ep::{ActiveGroup, ExpertGroup};
use crate::parallel::fsdp::{Active, Fsdp, Hook, Units};
use crate::schedule::LrSchedule;
use crate::TrainError;
use anneal_config::{JobConfig, RecomputeMode};
use anneal_data::{Batch, TextTokenizer};
use anneal_engine::ops::{cross_entropy, CrossEntropy};
use anneal_engine::{autograd, Device, Tensor};
use anneal_runtime::plugins::{
    ForwardOpts, ForwardOutput, Params, PluginModel, PluginOptimizer, StageParams,
};
use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

/// What one optimizer step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    /// The step just completed (counting from 1).
    pub step: u64,
    /// Mean loss over the step's micro-batches.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Tokens processed.
    pub tokens: u64,
    /// Wall-clock seconds of the step.
    pub seconds: f64,
    /// Mean weighted sum of the model's auxiliary losses (added to `loss` for backward), if
    /// it returned any.
    pub aux_loss: Option<f64>,
    /// The model's auxiliary losses (`aux_loss.<name>`, unweighted) and statistics, averaged
    /// over the step's micro-batches, as `metrics.jsonl` fields.
    pub outputs: std::collections::BTreeMap<String, serde_json::Value>,
    /// Bytes this rank handed to collectives during the step (`None` in a single process).
    pub comm_bytes: Option<u64>,
    /// Bytes of parameters, gradients and optimizer state this rank holds at the end of the
    /// step: what sharding divides by `dp_shard`.
    pub state_bytes: Option<u64>,
}

/// Everything a training run holds in memory.
pub struct Trainer {
    cfg: JobConfig,
    model: PluginModel,
    /// What the forward reads by name: the trained parameters and the buffers (under FSDP the
    /// gathered full parameters during a step, the buffers alone between steps).
    params: Params,
    /// The trained parameters sorted by name: the fixed order of norms and optimizer updates
    /// (under FSDP this rank's dim-0 shards of them, which the optimizer steps on).
    named: Vec<(String, Tensor)>,
    /// The model's buffers (not trained; updated by its `before_optimizer_step`), by name.
    buffers: Vec<(String, Tensor)>,
    /// Low-rank adapters (`[lora]`): `named` then holds the adapters, `frozen` the base.
    lora: Option<crate::lora::Adapters>,
    /// The frozen base parameters of a LoRA run (read by the forward, never trained or saved).
    frozen: Vec<(String, Tensor)>,
    /// DPO's reference model: a frozen copy of the starting parameters (a LoRA run's is its
    /// base, `params` without the adapters applied).
    reference: Option<Params>,
    optimizer: PluginOptimizer,
    schedule: LrSchedule,
    loader: data::Loader,
    val_batches: Vec<Batch>,
    /// Whether the data is conversations (held-out replies then give an accuracy).
    chat: bool,
    /// What the run dir records beside the tokenizer (a chat run's template and processor).
    run_files: RunFiles,
    positions: Tensor,
    /// Blocks a memory-budget plan recomputes (`activation_checkpoint.mode = "budget"`).
    recompute_plan: Option<Arc<Vec<bool>>>,
    step: u64,
    tokens: u64,
    last_lr: f64,
    tokenizer: TextTokenizer,
    tokenizer_path: PathBuf,
    provenance: Provenance,
    /// The job's processes: which micro-batches this rank trains on, the gradient all-reduce.
    dist: Dist,
    /// The sharding of `named` when `dp_shard > 1`.
    fsdp: Option<Fsdp>,
    /// The per-block gathers and reduce-scatters of a training step under FSDP.
    units: Option<Rc<RefCell<Units>>>,
    /// The expert group the MoE layers exchange rows over, under expert parallelism.
    experts: Option<Rc<ExpertGroup>>,
    /// This rank's stages when `pp > 1` (`named` then holds their parameters only).
    pipeline: Option<crate::parallel::pp::Pipeline>,
    /// This rank's part of every sequence and its attention ring, when `cp > 1`.
    cp: Option<crate::parallel::cp::Context>,
    /// The tensor-parallel layout when `tp > 1` (`named` then holds this rank's slices).
    tp: Option<crate::parallel::tp::TpLayout>,
    /// Where each trained parameter lives over the mesh: what the gradient norm adds by.
    placements: crate::parallel::Placements,
    /// Under tensor parallelism, the row-split tensors' rows the next checkpoint writes.
    save_rows: crate::parallel::checkpoint::SaveRows,
    /// Where parameters, buffers, gradients, optimizer state and each batch live
    /// (`job.device`); positions stay on the host, where RoPE and attention read them.
    device: Device,
}

/// What keeps a step's per-block driver and expert group reachable from the model's hooks.
type Guards = (
    Option<Active>,
    Option<ActiveGroup>,
    Option<crate::parallel::tp::ActiveTp>,
);

impl Trainer {
    /// Prepares data (tokenizer, tokenized corpus, loader), the model and the optimizer, for a
    /// single process. `note` receives progress messages for the user.
    pub fn new(cfg: &JobConfig, note: &dyn Fn(&str)) -> Result<Self, TrainError> {
        Self::with_dist(cfg, Dist::single(), note)
    }

    /// [`Trainer::new`] for one rank of a data-parallel job: every rank builds the same model
    /// (initialisation depends on the seed only) and reads the same batches; `dist` says which
    /// share of each step this rank trains on.
    pub fn with_dist(cfg: &JobConfig, dist: Dist, note: &dyn Fn(&str)) -> Result<Self, TrainError> {
        let checked = crate::preflight::train(cfg, dist.mesh().world_size())?;
        Self::from_preflight(cfg, dist, checked, note)
    }

    /// [`Trainer::with_dist`] after its up-front checks ([`crate::preflight::train`]), going
    /// on with what they built: the device, the plugins and the corpus files.
    pub fn from_preflight(
        cfg: &JobConfig,
        dist: Dist,
        checked: crate::preflight::Preflight,
        note: &dyn Fn(&str),
    ) -> Result<Self, TrainError> {
        let t = &cfg.training;
        let crate::preflight::Preflight {
            device,
            model,
            optimizer,
            files,
        } = checked;
        anneal_engine::set_allow_tf32(t.allow_tf32);
        note(&format!(
            "data: {} file(s) under {}",
            files.len(),
            cfg.data.path
        ));
        let data = data::build(cfg, &files, model.spec(), note)?;
        let (tokenizer, tokenizer_path) = (data.tokenizer, data.tokenizer_path);
        let provenance = Provenance {
            tokenizer_sha256: tokenizer.sha256()?,
            data_sha256: data.data_sha256,
        };
        let spec = model.spec();
        crate::preflight::vocab(
            spec,
            tokenizer.vocab_size(),
            &tokenizer_path.to_string_lossy(),
        )?;
        let initial = match &cfg.checkpoint.init_from_hf {
            Some(dir) => {
                note(&format!(
                    "model: weights from the Hugging Face directory {dir}"
                ));
                anneal_runtime::hf::load_params(std::path::Path::new(dir), spec).map_err(|e| {
                    TrainError::Config(format!("config: `checkpoint.init_from_hf`: {e}"))
                })?
            }
            None => model.init_params(t.seed)?,
        };
        // Initialised on the host (the same values on any device), kept as f32 master weights
        // (compute runs in `training.dtype`), then placed.
        let initial = crate::device::place(crate::device::f32_masters(initial)?, device)?;
        let (named, buffers) = crate::harness::split_buffers(&model, initial);
        note(&format!(
            "model: {} {} ({} parameters, {} layers) on {device}",
            cfg.model.plugin,
            cfg.model.flavor,
            named.iter().map(|(_, p)| p.numel()).sum::<usize>(),
            spec.n_layers
        ));
        // LoRA: the adapters train, the base is frozen.
        let lora = crate::lora::Adapters::plan(&cfg.lora, spec)?;
        let (named, frozen) = match &lora {
            Some(l) => {
                note(&l.summary(named.iter().map(|(_, p)| p.numel()).sum()));
                let adapters = crate::device::place(l.init(t.seed)?, device)?;
                let adapters = adapters
                    .into_iter()
                    .map(|(n, p)| (n, p.requires_grad_()))
                    .collect();
                (adapters, l.freeze(named)?)
            }
            None => (named, Vec::new()),
        };
        let params: Params = Arc::new(
            named
                .iter()
                .chain(&buffers)
                .chain(&frozen)
                .cloned()
                .collect(),
        );
        // DPO against the starting model: a copy the optimizer never touches.
        let dpo = cfg.preference.loss == anneal_config::PreferenceLoss::Dpo;
        let reference = match dpo && lora.is_none() {
            true => Some(crate::preference::frozen_copy(&params, device)?),
            false => None,
        };

        let (loader, val_batches) = (data.loader, data.val_batches);
        if cfg.metrics.eval_freq > 0 && val_batches.is_empty() {
            note("data: the held-out split is shorter than one sequence; no validation loss");
        }
        let positions = Tensor::from_vec((0..t.seq_len as i64).collect(), &[t.seq_len])?;
        let ac = &cfg.activation_checkpoint;
        let recompute_plan = match ac.mode {
            RecomputeMode::Budget => {
                let amp = anneal_engine::DType::parse(&t.dtype);
                let plan = anneal_runtime::plugins::recompute::plan_for_training(
                    &model,
                    &params,
                    t.micro_batch_size,
                    t.seq_len,
                    amp,
                    ac.memory_budget,
                )?;
                note(&plan.summary());
                Some(Arc::new(plan.recompute))
            }
            _ => None,
        };
        let mut trainer = Trainer {
            recompute_plan,
            schedule: LrSchedule::new(cfg.optimizer.lr, t.steps, &cfg.lr_scheduler),
            cfg: cfg.clone(),
            model,
            params,
            named,
            buffers,
            lora,
            frozen,
            reference,
            optimizer,
            loader,
            val_batches,
            chat: data.chat,
            run_files: data.run_files,
            positions,
            step: 0,
            tokens: 0,
            last_lr: 0.0,
            tokenizer,
            tokenizer_path,
            provenance,
            dist,
            fsdp: None,
            units: None,
            experts: None,
            pipeline: None,
            cp: None,
            tp: None,
            placements: crate::parallel::Placements::replicated(std::iter::empty()),
            save_rows: Default::default(),
            device,
        };
        trainer.apply_layouts(cfg, note)?;
        Ok(trainer)
    }

    /// What the forward reads: the parameters and buffers, with LoRA's adapted weights in
    /// place of their base weights.
    fn forward_params(&self) -> Result<Params, TrainError> {
        match &self.lora {
            Some(l) => l.apply(&self.params),
            None => Ok(self.params.clone()),
        }
    }

    /// The preference loss of a batch of pairs (rows `2i`, `2i + 1`) from the policy's
    /// forward `out`, the reference's forward run here for DPO; the pairs' margin statistics
    /// join `out.stats` (`pref_margin`, `pref_accuracy`).
    fn pair_loss(
        &self,
        b: &Batch,
        (x, positions, opts): (&Tensor, &Tensor, &ForwardOpts),
        out: &mut ForwardOutput,
    ) -> Result<Tensor, TrainError> {
        use crate::preference::{margin_stats, pair_loss, row_lengths, row_logps};
        let p = &self.cfg.preference;
        let policy = row_logps(&out.logits, &b.targets)?;
        let reference = match p.loss {
            anneal_config::PreferenceLoss::Dpo => {
                let _g = autograd::no_grad();
                let params = self.reference.as_ref().unwrap_or(&self.params);
                let r = self.model.forward_full(params, x, positions, opts)?;
                let r = row_logps(&r.logits, &b.targets)?.to_device(Device::Cpu)?;
                Some(r.to_vec_f32())
            }
            _ => None,
        };
        let lengths = row_lengths(&b.targets, b.batch);
        let (loss, margins) = pair_loss(p, &policy, reference.as_deref(), &lengths)?;
        let (mean, right) = margin_stats(&margins);
        for (name, v) in [("pref_margin", mean), ("pref_accuracy", right)] {
            out.stats
                .push((name.into(), Tensor::from_vec(vec![v as f32], &[1])?));
        }
        Ok(loss)
    }

    /// The parameters, buffers and frozen base weights, by name: the forward's map when every
    /// parameter is resident.
    fn resident_params(&self) -> Params {
        Arc::new(
            self.named
                .iter()
                .chain(&self.buffers)
                .chain(&self.frozen)
                .cloned()
                .collect(),
        )
    }

    /// Under FSDP, lets go of the full parameters (the forward's map keeps the buffers only).
    fn release_full(&mut self) {
        if self.fsdp.is_some() {
            self.params = Arc::new(self.buffers.iter().cloned().collect());
        }
    }

    /// Whether the parameters are sharded (FSDP / HSDP) or split into pipeline stages:
    /// evaluation then needs every rank, so every rank must call [`Trainer::evaluate`];
    /// checkpoints are saved as one shard per rank of the first replica group.
    pub fn is_sharded(&self) -> bool {
        self.fsdp.is_some() || self.pipeline.is_some() || self.tp.is_some()
    }

    /// The digests of the tokenizer and the training stream that checkpoints record.
    pub fn provenance(&self) -> &Provenance {
        &self.provenance
    }

    /// Where the trainer computes (`job.device`).
    pub fn device(&self) -> Device {
        self.device
    }

    /// Optimizer steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The model's FLOPs per trained token (forward + backward) at the run's sequence length,
    /// for throughput figures.
    pub fn flops_per_token(&self) -> f64 {
        self.model
            .spec()
            .flops_per_token_at(self.cfg.training.seq_len)
    }

    /// The tokenizer and the `tokenizer.json` it came from.
    pub fn tokenizer(&self) -> (&TextTokenizer, &PathBuf) {
        (&self.tokenizer, &self.tokenizer_path)
    }

    /// Whether a validation split exists.
    pub fn has_validation(&self) -> bool {
        !self.val_batches.is_empty()
    }

    /// What the run dir records beside the tokenizer (empty for text data).
    pub fn run_files(&self) -> &RunFiles {
        &self.run_files
    }

    /// Under FSDP, activates the per-block driver (each block's parameters gathered and freed
    /// around its forward and its backward) and returns its guard with forward options that
    /// route the stages through it; plain options otherwise. Collective under FSDP.
    /// Under expert parallelism the expert group is activated too (the hook hands it to the
    /// MoE layers).
    fn block_forward(&self, training: bool) -> Result<(Guards, ForwardOpts), TrainError> {
        let mut opts = self.forward_opts(training);
        let efsdp = self.dist.experts().map(|(_, f)| f);
        let active = match (&self.units, self.dist.shard()) {
            (Some(u), Some(comm)) => {
                opts.stage_params = Some(Arc::new(Hook) as Arc<dyn StageParams>);
                Some(Units::activate(
                    u,
                    comm,
                    efsdp,
                    self.dist.take_shard_device_comms(),
                    &self.named,
                    &self.buffers,
                )?)
            }
            _ => None,
        };
        let group = match (&self.experts, self.dist.experts()) {
            (Some(g), Some((ep, _))) => Some(ExpertGroup::activate(g, ep)?),
            _ => None,
        };
        let tp = match (&self.tp, self.dist.tp()) {
            (Some(layout), Some(comm)) => {
                let tp = layout.context();
                opts.stage_params = Some(match &active {
                    // FSDP's per-block gathers hand out the local slices.
                    Some(_) => {
                        Arc::new(crate::parallel::tp_fsdp::Hook { tp }) as Arc<dyn StageParams>
                    }
                    None => Arc::new(crate::parallel::tp::TpHook {
                        params: self.params.clone(),
                        tp,
                    }),
                });
                Some(crate::parallel::tp::activate(comm))
            }
            _ => None,
        };
        Ok(((active, group, tp), opts))
    }

    /// The forward options of a pipelined step (or evaluation) whose stages read `params`,
    /// gathered from FSDP shards: the stage hook must then hand out those tensors, not the
    /// resting shards (expert parallelism's resident experts, or tensor parallelism's
    /// slices); `None` when `opts` already reads the right map.
    fn gathered_stage_opts(&self, opts: &ForwardOpts, params: &Params) -> Option<ForwardOpts> {
        if self.experts.is_some() {
            let tp = self.tp.as_ref().map(|layout| layout.context());
            return Some(crate::parallel::ep::resident_opts(opts, params, tp));
        }
        let (layout, _) = self.tp.as_ref().zip(self.fsdp.as_ref())?;
        let mut opts = opts.clone();
        opts.stage_params = Some(Arc::new(crate::parallel::tp::TpHook {
            params: params.clone(),
            tp: layout.context(),
        }));
        Some(opts)
    }

    fn forward_opts(&self, training: bool) -> ForwardOpts {
        let ac = &self.cfg.activation_checkpoint;
        ForwardOpts {
            training,
            recompute_every: match ac.mode {
                RecomputeMode::None | RecomputeMode::Budget => 0,
                RecomputeMode::Full => 1,
                RecomputeMode::Selective => ac.every,
            },
            recompute_layers: self.recompute_plan.clone(),
            cache: None,
            stage_params: None,
            ring: self.cp.as_ref().map(|c| c.ring()),
            images: None,
            audio: None,
            packed: false,
        }
    }

    /// The cross-entropy of a batch, with everything else the model returned beside the
    /// logits.
    fn batch_forward(
        &self,
        b: &Batch,
        opts: &ForwardOpts,
    ) -> Result<(Tensor, ForwardOutput), TrainError> {
        let _amp = anneal_engine::autocast::set_autocast(anneal_engine::DType::parse(
            &self.cfg.training.dtype,
        ));
        // Under context parallelism this rank's part of each sequence.
        let (x, y, t) = match &self.cp {
            Some(cp) => {
                let (x, y, t) = cp.batch(b)?;
                (x.to_device(self.device)?, y.to_device(self.device)?, t)
            }
            None => (
                Tensor::from_slice(&b.inputs, &[b.batch, b.seq_len])?.to_device(self.device)?,
                Tensor::from_slice(&b.targets, &[b.batch * b.seq_len])?.to_device(self.device)?,
                b.seq_len,
            ),
        };
        let with_images;
        let opts = match b.images.is_empty() {
            true => opts,
            false => {
                let mut images =
                    anneal_runtime::plugins::ImageInputs::from_processed(b.images.clone())?;
                images.pixel_values = images.pixel_values.to_device(self.device)?;
                with_images = ForwardOpts {
                    images: Some(Arc::new(images)),
                    ..opts.clone()
                };
                &with_images
            }
        };
        // Packed rows: each token at its position in its own conversation, `[B, T]`.
        let packed;
        let (positions, opts) = match b.positions.is_empty() {
            true => (&self.positions, opts),
            false => {
                packed = (
                    Tensor::from_slice(&b.positions, &[b.batch, b.seq_len])?
                        .to_device(self.device)?,
                    ForwardOpts {
                        packed: true,
                        ..opts.clone()
                    },
                );
                (&packed.0, &packed.1)
            }
        };
        let params = self.forward_params()?;
        let mut out = self.model.forward_full(&params, &x, positions, opts)?;
        if self.cfg.preference.on() {
            let loss = self.pair_loss(b, (&x, positions, opts), &mut out)?;
            return Ok((loss, out));
        }
        let _phase = anneal_engine::profile::phase("loss");
        let v = out.logits.shape()[2];
        let logits = out.logits.reshape(&[b.batch * t, v])?;
        let ce = match opts.stage_params.as_ref().and_then(|s| s.tensor_parallel()) {
            // The logits are this rank's columns of the vocabulary: a loss that never gathers them.
            Some(tp) => anneal_engine::ops::vocab_parallel_cross_entropy(
                &logits,
                &y,
                CrossEntropy::default().ignore_index,
                &tp.group,
            )?,
            None => cross_entropy(&logits, &y, &CrossEntropy::default())?,
        };
        Ok((ce, out))
    }

    /// One optimizer step: accumulate gradients over the micro-batches, clip, update.
    /// A non-finite loss or gradient norm stops with [`TrainError::NonFinite`] before any
    /// parameter changes.
    pub fn train_step(&mut self) -> Result<StepOutcome, TrainError> {
        let started = Instant::now();
        // A copy: the step borrows `self` mutably to gather and release FSDP parameters.
        let t = &self.cfg.training.clone();
        let n_micro = t.batch_size / t.micro_batch_size;
        let step = self.step + 1;
        let _profiled = anneal_engine::profile::step(step);
        let comm_before = self.begin_step_counters();
        let (active, opts) = self.block_forward(true)?;
        let mut acc = self.micro_batches(t, n_micro, &opts)?;
        let pipeline = self.pipeline_schedule(t, &opts, &mut acc)?;
        let fsdp_figures = self.sync_grads(&mut acc, pipeline.shard_grads)?;
        drop(active);
        // The gradient norm's parts and the losses still on a device come back together (on
        // a GPU the step's one wait for the device, which the profile shows in this phase).
        let norm_phase = anneal_engine::profile::phase("grad_norm");
        // The model's auxiliary losses and statistics come back in the same copy.
        let losses_read = acc.pending_losses.len();
        let mut reading = acc.pending_losses.clone();
        reading.extend(acc.outputs.pending());
        let (grad_norm, values) =
            self.placements
                .grad_norm_reading(&self.dist, &self.named, &reading)?;
        drop(norm_phase);
        let (losses, outputs) = values.split_at(losses_read.min(values.len()));
        acc.take_losses(losses);
        acc.outputs.take_values(outputs);
        // Summed in micro-batch order whatever the layout, so the step's loss is bitwise the
        // same for any number of ranks.
        let loss = acc.losses.iter().map(|&l| l as f64).sum::<f64>() / n_micro as f64;
        let aux_loss = acc.outputs.aux_total()?;
        self.check_finite(step, [loss, aux_loss.unwrap_or(0.0), grad_norm])?;
        {
            let _phase = anneal_engine::profile::phase("clip");
            clip_grads(&self.named, t.max_grad_norm, grad_norm)?;
        }
        self.model
            .before_optimizer_step(&self.params, acc.outputs.stat_sums(), step)?;
        let lr = self.schedule.lr(step);
        let sharding = self.fsdp.as_ref().zip(self.dist.shard());
        let owner = crate::parallel::full_matrix::optimizer_step(
            &mut self.optimizer,
            sharding,
            &self.named,
            step,
            lr,
        )?;
        // Reported in one process too: the baseline the 1/N of sharding is measured against.
        let state_bytes = Some(Fsdp::resident_bytes(&self.named, self.optimizer.state()));
        self.zero_grad();
        self.step = step;
        self.last_lr = lr;
        self.tokens += (t.batch_size * t.seq_len) as u64;
        let talked = self.dist.grads().size() > 1 || self.pipeline.is_some() || self.tp.is_some();
        Ok(StepOutcome {
            step,
            loss,
            grad_norm,
            lr,
            tokens: (t.batch_size * t.seq_len) as u64,
            seconds: started.elapsed().as_secs_f64(),
            aux_loss,
            outputs: self.step_fields(acc.outputs, fsdp_figures, pipeline.figures, owner)?,
            comm_bytes: talked.then(|| self.dist.comm_bytes() - comm_before),
            state_bytes,
        })
    }

    /// Checks that every data-parallel replica holds the same parameters (see
    /// [`Dist::check_replicas`]); returns their digest, if this rank has replicas.
    pub fn check_replicas(&self) -> Result<Option<u64>, TrainError> {
        self.dist.check_replicas(&self.named)
    }

    /// Checks that every data-parallel and tensor-parallel rank holds the same buffers (the
    /// aux-loss-free balancing bias, updated from the whole batch's token counts); returns
    /// their digest, `None` without buffers or in one process.
    pub fn check_buffers(&self) -> Result<Option<u64>, TrainError> {
        if self.buffers.is_empty() {
            return Ok(None);
        }
        let mut checked = None;
        if self.dist.grads().size() > 1 {
            checked = Some(self.dist.check_same(&self.buffers)?);
        }
        // Every rank of a tensor-parallel group routes the whole batch and keeps the buffers
        // (a router's balancing bias) whole: they must agree too.
        if let Some(tp) = self.dist.tp() {
            checked = Some(self.dist.check_same_over(tp.as_ref(), &self.buffers)?);
        }
        Ok(checked)
    }

    /// Builds NCCL on this rank's GPU for the data-parallel collectives where it can run
    /// ([`Dist::start_device_collectives`]); the console note says which path runs. Collective
    /// over the job: every rank calls it, after every rank built its trainer.
    pub fn start_device_collectives(&mut self) -> Result<Option<String>, TrainError> {
        let device = self.device();
        self.dist.start_device_collectives(device)
    }

    /// The job's processes as this trainer sees them.
    pub fn dist(&self) -> &Dist {
        &self.dist
    }

    /// Tokens trained on so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    fn zero_grad(&self) {
        for (_, p) in &self.named {
            p.zero_grad();
        }
    }

    /// Mean loss over the held-out batches (`None` without a validation split). Under FSDP it
    /// gathers the parameters block by block: every rank must call it.
    pub fn evaluate(&mut self) -> Result<Option<f64>, TrainError> {
        Ok(self.evaluate_full()?.map(|e| e.loss))
    }

    /// [`Trainer::evaluate`] with, for chat data, the share of held-out conversations whose
    /// replies greedy decoding writes exactly (every reply token the arg-max).
    pub fn evaluate_full(&mut self) -> Result<Option<Evaluation>, TrainError> {
        if self.val_batches.is_empty() {
            return Ok(None);
        }
        if let (Some(pipe), Some(comm)) = (&self.pipeline, self.dist.pp()) {
            // The stages' hook and group under tensor parallelism, as in training; the expert
            // group under expert parallelism (no FSDP units here).
            let (_active, opts) = self.block_forward(false)?;
            let stage = self.gather_stage(false)?;
            let params = stage.as_ref().map_or(&self.params, |g| &g.params);
            let stage_opts = self.gathered_stage_opts(&opts, params);
            let ctx = crate::parallel::pp::StepCtx {
                model: &self.model,
                params,
                positions: &self.positions,
                opts: stage_opts.as_ref().unwrap_or(&opts),
                amp: anneal_engine::DType::parse(&self.cfg.training.dtype),
                aux_weights: &self.cfg.training.aux_loss_weights,
                scale: None,
            };
            let losses = match &self.cp {
                Some(cp) => {
                    let local: Vec<Batch> =
                        self.val_batches.iter().map(|b| cp.local_batch(b)).collect();
                    let parts = pipe.evaluate(comm, &ctx, &local)?;
                    let cp_comm = self.dist.cp().ok_or_else(|| {
                        TrainError::Pipeline("context parallelism without a cp group".into())
                    })?;
                    cp.sum_parts(cp_comm, &parts)?
                }
                None => pipe.evaluate(comm, &ctx, &self.val_batches)?,
            };
            let sum: f64 = losses.iter().map(|&l| l as f64).sum();
            return Ok(Some(Evaluation {
                loss: sum / self.val_batches.len() as f64,
                accuracy: None,
                margin: None,
            }));
        }
        // Under FSDP block by block, as in training (one micro-batch per held-out batch).
        let (active, opts) = self.block_forward(false)?;
        let _g = autograd::no_grad();
        let mut losses = Vec::with_capacity(self.val_batches.len());
        // Replies exact and replies seen; sequences split over cp ranks give no whole rows.
        let mut replies = (self.chat && self.cp.is_none() && self.tp.is_none()).then_some((0, 0));
        // Preference pairs: the margins' sum, the pairs on the chosen side, the pairs.
        let mut pairs = self.cfg.preference.on().then_some((0.0, 0.0, 0.0));
        for b in &self.val_batches {
            if let Some(u) = &self.units {
                u.borrow_mut().begin_micro_batch()?;
            }
            let (loss, out) = self.batch_forward(b, &opts)?;
            losses.push(loss.item()?);
            if let Some((margin, right, n)) = &mut pairs {
                let stat = |name: &str| {
                    out.stats
                        .iter()
                        .find(|(n, _)| n == name)
                        .map_or(Ok(0.0), |(_, t)| t.item().map(f64::from))
                };
                let count = (b.batch / 2) as f64;
                *margin += stat("pref_margin")? * count;
                *right += stat("pref_accuracy")? * count;
                *n += count;
            }
            if let Some((right, seen)) = &mut replies {
                let logits = out
                    .logits
                    .to_device(Device::Cpu)?
                    .to_dtype(anneal_engine::DType::F32)?;
                let (r, s) = chat_data::exact_replies(&logits.to_vec::<f32>(), b);
                *right += r;
                *seen += s;
            }
            if let Some(u) = &self.units {
                u.borrow_mut().end_forward_only()?;
            }
        }
        drop(active);
        if let (Some(cp), Some(comm)) = (&self.cp, self.dist.cp()) {
            losses = cp.sum_parts(comm, &losses)?;
        }
        let sum: f64 = losses.iter().map(|&l| l as f64).sum();
        let pairs = pairs.filter(|&(_, _, n)| n > 0.0);
        Ok(Some(Evaluation {
            loss: sum / self.val_batches.len() as f64,
            accuracy: match pairs {
                Some((_, right, n)) => Some(right / n),
                None => replies
                    .filter(|&(_, seen)| seen > 0)
                    .map(|(right, seen)| right as f64 / seen as f64),
            },
            margin: pairs.map(|(margin, _, n)| margin / n),
        }))
    }
}

/// What one evaluation measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// Mean held-out loss.
    pub loss: f64,
    /// For chat data, the share of held-out conversations whose replies greedy decoding writes
    /// exactly; for preference pairs, the share whose margin favours the chosen completion.
    pub accuracy: Option<f64>,
    /// For preference pairs, the mean margin of the held-out pairs (`val_margin`).
    pub margin: Option<f64>,
}
