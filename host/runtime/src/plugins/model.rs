//! Running a model plugin: parameters live in the host; the forward composes the plugin's
//! stages (`embed`, one `layer` per block, `head`), optionally recomputing each block in
//! backward.

use super::host::{Emitted, HostSession};
use super::kv_cache::KvCache;
use super::stage_params::{Stage, StageParams};
use super::PluginError;
use abi_stable::std_types::RVec;
use anneal_engine::autograd::{before_backward, checkpoint, RegionFn};
use anneal_engine::rng::RngKey;
use anneal_engine::{DType, Tensor};
use anneal_plugin_api::abi::{
    self, ErrorKind, ForwardCtx, Handle, ModelBox, OutputKind, PluginInstance,
};
use anneal_plugin_api::spec::{Init, ModelSpec, ParamSpec};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Where the stages of one forward put the named outputs the model emits.
type Sink = Mutex<Vec<Emitted>>;

/// A forward's logits and the named outputs the model emitted beside them.
pub struct ForwardOutput {
    /// `[B, T, V]`.
    pub logits: Tensor,
    /// Auxiliary losses (scalars, with gradients) by name, in the order first emitted; losses
    /// of one name are summed.
    pub aux_losses: Vec<(String, Tensor)>,
    /// Statistics (no gradient) by name, in the order emitted.
    pub stats: Vec<(String, Tensor)>,
}

/// Where a run of stages ([`PluginModel::forward_part`]) starts.
pub enum StageInput<'a> {
    /// Token ids `[B, T]`: the run starts with `embed`.
    Tokens(&'a Tensor),
    /// The hidden tensors the previous block returned.
    Hidden(Vec<Tensor>),
}

/// What a run of stages returned: its last stage's outputs and what its stages emitted.
pub struct PartOutput {
    /// The last block's hidden tensors, or `[logits]` when the run ended with `head`.
    pub hidden: Vec<Tensor>,
    /// Auxiliary losses by name (summed per name), as in [`ForwardOutput::aux_losses`].
    pub aux_losses: Vec<(String, Tensor)>,
    /// Statistics by name, as in [`ForwardOutput::stats`].
    pub stats: Vec<(String, Tensor)>,
}

/// Named parameter tensors (leaves that require grad when training).
pub type Params = Arc<HashMap<String, Tensor>>;

/// Options of one forward pass.
#[derive(Clone, Default)]
pub struct ForwardOpts {
    /// Training mode (passed to the plugin).
    pub training: bool,
    /// Recompute blocks during backward instead of keeping their activations: 0 = none,
    /// `k` = every block whose index is a multiple of `k` (1 = all).
    pub recompute_every: usize,
    /// Per block, whether to recompute it (a memory-budget plan, see
    /// [`super::recompute`]); blocks it marks are recomputed in addition to `recompute_every`.
    pub recompute_layers: Option<Arc<Vec<bool>>>,
    /// Per-layer KV cache for prefill/decode; positions then continue after the cached length.
    pub cache: Option<Arc<KvCache>>,
    /// Where each stage gets its parameters when they are not all resident (FSDP's per-block
    /// gathers); `None`: every stage reads the `params` passed to the forward.
    pub stage_params: Option<Arc<dyn StageParams>>,
    /// Context parallelism: the ring of ranks holding the other parts of the sequence. The
    /// tokens and positions given to the forward are then this rank's part, and the
    /// `attention` host op attends over every rank's keys with ring attention.
    pub ring: Option<Arc<dyn anneal_engine::ops::KvRing>>,
    /// The images of this forward (a vision-language model's), handed to every stage as
    /// `ForwardCtx::images`; the model's `embed` consumes them.
    pub images: Option<Arc<ImageInputs>>,
    /// The audio clips of this forward (an audio-language model's), handed to every stage as
    /// `ForwardCtx::audio`; the model's `embed` consumes them.
    pub audio: Option<Arc<AudioInputs>>,
    /// The rows pack several documents, each at positions from 0 (`[B, T]` positions, no
    /// cache): attention keeps to each run of consecutive positions, and host ops that carry
    /// state along the sequence without positions (linear attention, causal convolutions,
    /// compressed attention) refuse, since they would mix the documents.
    pub packed: bool,
}

/// A forward's images: `pixel_values [patches, C·t·p·p]` (f32) and each image's `(t, h, w)`
/// grid in patches, as `anneal_data::image` (or transformers' processor) makes them.
#[derive(Clone, Debug)]
pub struct ImageInputs {
    /// Every image's patches, one image after another.
    pub pixel_values: Tensor,
    /// `(t, h, w)` per image.
    pub grid_thw: Vec<[usize; 3]>,
}

impl ImageInputs {
    /// The processor's outputs of a prompt's images, in order, as one forward's images (on the
    /// host): their patch rows one image after another, and each image's grid.
    pub fn from_processed(
        images: Vec<anneal_data::image::ProcessedImage>,
    ) -> anneal_engine::Result<ImageInputs> {
        let patch_dim = images.first().map_or(0, |im| im.patch_dim);
        let rows: usize = images.iter().map(|im| im.patches).sum();
        let grid_thw = images.iter().map(|im| im.grid_thw).collect();
        let mut pixels = Vec::with_capacity(rows * patch_dim);
        for image in images {
            pixels.extend_from_slice(&image.pixel_values);
        }
        Ok(ImageInputs {
            pixel_values: Tensor::from_vec(pixels, &[rows, patch_dim])?,
            grid_thw,
        })
    }
}

/// A forward's audio clips: mono waveforms at the model's rate, right-padded with zeros to one
/// length (`input_values [clips, samples]`, f32), and each clip's real length, as
/// `anneal_data::audio` (or transformers' feature extractor) makes them.
#[derive(Clone, Debug)]
pub struct AudioInputs {
    /// One padded waveform per row.
    pub input_values: Tensor,
    /// Each clip's length in samples, in the order of their placeholder tokens.
    pub lengths: Vec<usize>,
}

impl AudioInputs {
    /// The feature extractor's output of a prompt's clips as one forward's audio (on the host).
    pub fn from_processed(
        audio: anneal_data::audio::ProcessedAudio,
    ) -> anneal_engine::Result<AudioInputs> {
        let rows = audio.lengths.len();
        Ok(AudioInputs {
            input_values: Tensor::from_vec(audio.input_values, &[rows, audio.width])?,
            lengths: audio.lengths,
        })
    }
}

impl ForwardOpts {
    /// The parameters `stage` reads: from [`ForwardOpts::stage_params`] when set, else `params`.
    fn params_of(&self, params: &Params, stage: Stage) -> anneal_engine::Result<Params> {
        match &self.stage_params {
            Some(s) => s.params(stage),
            None => Ok(params.clone()),
        }
    }

    /// Tells [`ForwardOpts::stage_params`] that `stage`'s forward has ended.
    fn forward_done(&self, stage: Stage) -> anneal_engine::Result<()> {
        match &self.stage_params {
            Some(s) => s.after_forward(stage),
            None => Ok(()),
        }
    }
}

/// A model plugin instance and its spec.
pub struct PluginModel {
    name: String,
    inst: Arc<ModelBox>,
    spec: ModelSpec,
}

fn stage_err(name: &str, stage: &str, e: impl std::fmt::Display) -> anneal_engine::Error {
    anneal_engine::Error::Invalid {
        op: "plugin",
        msg: format!("{name}: {stage}: {e}"),
    }
}

/// A plugin call's error as the engine's, by its kind: a refusal is the user's to fix, a
/// failure inside the plugin is its bug, a host op's failure stays the host's. (The SDK's
/// messages already begin with the call's name.)
pub(crate) fn call_err(name: &str, stage: &str, e: abi::PluginError) -> anneal_engine::Error {
    let msg = match e.message.starts_with(stage) {
        true => e.message.to_string(),
        false => format!("{stage}: {}", e.message),
    };
    match e.kind {
        ErrorKind::Input => anneal_engine::Error::PluginRefused {
            plugin: name.to_string(),
            msg,
        },
        ErrorKind::Internal => anneal_engine::Error::PluginBug {
            plugin: name.to_string(),
            msg,
        },
        ErrorKind::Host => stage_err(name, stage, e.message),
    }
}

impl PluginModel {
    /// Wraps an instance created by [`super::LoadedPlugin::create`].
    pub fn new(name: &str, inst: PluginInstance) -> Result<Self, PluginError> {
        let create_err = |msg: String| PluginError::Create {
            name: name.to_string(),
            msg,
        };
        let PluginInstance::Model(inst) = inst else {
            return Err(create_err("is an optimizer plugin, not a model".into()));
        };
        let json = inst.spec_json();
        let value: serde_json::Value = serde_json::from_str(json.as_str())
            .map_err(|e| create_err(format!("its model spec is not JSON: {e}")))?;
        // The SDK reports a spec that failed to build as `{"error": ..., "kind": ...}`.
        if let Some(e) = value.get("error").and_then(|e| e.as_str()) {
            let kind = match value.get("kind").and_then(|k| k.as_str()) {
                Some("input") | None => ErrorKind::Input,
                _ => ErrorKind::Internal,
            };
            return Err(PluginError::of(name, abi::PluginError::new(kind, e)));
        }
        // The spec itself is not shown: it lists every parameter (thousands of characters).
        let spec: ModelSpec = serde_json::from_value(value)
            .map_err(|e| create_err(format!("bad model spec: {e}")))?;
        // A slip in a declaration (a name twice, a mapping that does not fit its shape) fails
        // here, when the plugin loads, naming the parameter.
        spec.check().map_err(create_err)?;
        Ok(PluginModel {
            name: name.to_string(),
            inst: Arc::new(inst),
            spec,
        })
    }

    /// What the plugin declared.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Fresh parameters, each drawn from the stream named after it under `seed` (so values do
    /// not depend on parameter order, sharding or thread count).
    pub fn init_params(&self, seed: u64) -> anneal_engine::Result<HashMap<String, Tensor>> {
        self.spec
            .params
            .iter()
            .map(|p| Ok((p.name.clone(), init_param(p, seed)?)))
            .collect()
    }

    /// Logits `[B, T, V]` for token ids `[B, T]` at `positions` (i64 `[T]`). Auxiliary
    /// losses and statistics the model emits are not needed for inference and are left out;
    /// training uses [`PluginModel::forward_full`].
    pub fn forward(
        &self,
        params: &Params,
        tokens: &Tensor,
        positions: &Tensor,
        opts: &ForwardOpts,
    ) -> anneal_engine::Result<Tensor> {
        Ok(self.forward_full(params, tokens, positions, opts)?.logits)
    }

    /// [`PluginModel::forward`] with the auxiliary losses and statistics the model emitted.
    pub fn forward_full(
        &self,
        params: &Params,
        tokens: &Tensor,
        positions: &Tensor,
        opts: &ForwardOpts,
    ) -> anneal_engine::Result<ForwardOutput> {
        let part = self.forward_part(
            params,
            StageInput::Tokens(tokens),
            0..self.spec.n_layers,
            true,
            positions,
            opts,
        )?;
        let logits = part
            .hidden
            .into_iter()
            .next()
            .ok_or_else(|| stage_err(&self.name, "head", "returned nothing"))?;
        // Everything downstream indexes logits as [B, T, V]; another shape from a plugin is
        // the plugin's error, reported here rather than as an out-of-bounds index later.
        let tokens_shape = tokens.shape();
        // Under tensor parallelism the head is split by vocabulary: this rank's columns.
        let tp = opts.stage_params.as_ref().and_then(|s| s.tensor_parallel());
        let vocab = self.spec.vocab_size / tp.map_or(1, |tp| tp.group.group.ranks().max(1));
        let want = [
            tokens_shape.first().copied().unwrap_or(0),
            tokens_shape.get(1).copied().unwrap_or(0),
            vocab,
        ];
        if logits.shape() != want {
            return Err(stage_err(
                &self.name,
                "head",
                format!(
                    "returned logits of shape {:?} for tokens of shape {:?}; expected {:?} (batch, sequence, vocab_size)",
                    logits.shape(),
                    tokens_shape,
                    want
                ),
            ));
        }
        Ok(ForwardOutput {
            logits,
            aux_losses: part.aux_losses,
            stats: part.stats,
        })
    }

    /// A contiguous run of the forward's stages (what one pipeline stage computes): from token
    /// ids through `embed`, or from the hidden tensors an earlier run of blocks returned,
    /// through blocks `layers` (recomputed and gathered as in [`PluginModel::forward_full`]),
    /// and through `head` when `head` is set. Returns the last stage's outputs (the hidden
    /// tensors, or `[logits]` after the head) with what the stages emitted.
    pub fn forward_part(
        &self,
        params: &Params,
        input: StageInput<'_>,
        layers: std::ops::Range<usize>,
        head: bool,
        positions: &Tensor,
        opts: &ForwardOpts,
    ) -> anneal_engine::Result<PartOutput> {
        let _phase = anneal_engine::profile::phase("forward");
        let sink = Sink::default();
        let mut hidden = match input {
            StageInput::Hidden(h) => h,
            StageInput::Tokens(tokens) => {
                let embed_params = opts.params_of(params, Stage::Embed)?;
                let hidden = run_stage(
                    &self.inst,
                    &self.name,
                    &embed_params,
                    positions,
                    opts,
                    &sink,
                    |inst, vt, ctx, s| {
                        let h = s.insert(tokens.clone());
                        inst.embed(vt, ctx, h).into_result()
                    },
                    "embed",
                )?;
                drop(embed_params);
                opts.forward_done(Stage::Embed)?;
                hidden
            }
        };
        for i in layers {
            let planned = opts
                .recompute_layers
                .as_ref()
                .is_some_and(|p| p.get(i) == Some(&true));
            let every = opts.recompute_every > 0 && i % opts.recompute_every == 0;
            hidden = if opts.training && (every || planned) {
                self.checkpointed_layer(params, positions, opts, i, hidden, &sink)?
            } else if opts.stage_params.is_some() {
                self.gathered_layer(params, positions, opts, i, &hidden, &sink)?
            } else {
                layer(
                    &self.inst, &self.name, params, positions, opts, i, &hidden, &sink,
                )?
            };
        }
        if head {
            let head_params = opts.params_of(params, Stage::Head)?;
            hidden = run_stage(
                &self.inst,
                &self.name,
                &head_params,
                positions,
                opts,
                &sink,
                |inst, vt, ctx, s| {
                    let hs: RVec<Handle> = hidden.iter().map(|t| s.insert(t.clone())).collect();
                    inst.head(vt, ctx, hs)
                        .into_result()
                        .map(|h| RVec::from(vec![h]))
                },
                "head",
            )?;
            drop(head_params);
            opts.forward_done(Stage::Head)?;
        }
        let emitted = sink.into_inner().expect("sink lock poisoned");
        let (aux_losses, stats) = gather_outputs(&self.name, emitted)?;
        Ok(PartOutput {
            hidden,
            aux_losses,
            stats,
        })
    }

    /// The `embed` stage alone: the hidden state for token ids `[B, T]`.
    pub fn embed(
        &self,
        params: &Params,
        tokens: &Tensor,
        positions: &Tensor,
        opts: &ForwardOpts,
    ) -> anneal_engine::Result<Vec<Tensor>> {
        // A partial forward (cost measurements): named outputs have no one to go to.
        run_stage(
            &self.inst,
            &self.name,
            params,
            positions,
            opts,
            &Sink::default(),
            |inst, vt, ctx, s| {
                let h = s.insert(tokens.clone());
                inst.embed(vt, ctx, h).into_result()
            },
            "embed",
        )
    }

    /// Runs the model's `before_optimizer_step` hook: it reaches every parameter and buffer of
    /// `params` by name and each of `stats` as `stats.<name>`, and updates buffers in place
    /// (without recording gradients).
    pub fn before_optimizer_step(
        &self,
        params: &Params,
        stats: &[(String, Tensor)],
        step: u64,
    ) -> anneal_engine::Result<()> {
        let mut named: HashMap<String, Tensor> = (**params).clone();
        for (n, t) in stats {
            named.insert(format!("stats.{n}"), t.clone());
        }
        let session = HostSession::new(named);
        let vt = session.vtable();
        let _no_grad = anneal_engine::autograd::no_grad();
        self.inst
            .before_optimizer_step(&vt, step)
            .into_result()
            .map_err(|e| call_err(&self.name, "before_optimizer_step", e))
    }

    /// Block `i` alone on `hidden` (never recomputed).
    pub fn layer(
        &self,
        params: &Params,
        positions: &Tensor,
        opts: &ForwardOpts,
        i: usize,
        hidden: &[Tensor],
    ) -> anneal_engine::Result<Vec<Tensor>> {
        let sink = Sink::default();
        layer(
            &self.inst, &self.name, params, positions, opts, i, hidden, &sink,
        )
    }

    /// Block `i` recomputed in backward. The recompute region has one output, so the block's
    /// floating hidden tensors and the auxiliary losses it emits travel packed into one flat f32
    /// tensor and are unpacked after it: the losses keep their gradient into the block (the
    /// recompute in backward differentiates the packed whole). Integer hidden tensors (token
    /// ids passed through) and statistics come from the first run; the recompute's own emitted
    /// outputs are dropped.
    fn checkpointed_layer(
        &self,
        params: &Params,
        positions: &Tensor,
        opts: &ForwardOpts,
        i: usize,
        hidden: Vec<Tensor>,
        sink: &Sink,
    ) -> anneal_engine::Result<Vec<Tensor>> {
        let first: FirstRun = Arc::default();
        // Whether the first (forward) run ended: `first` is emptied before the recompute runs.
        let ran = Arc::new(AtomicBool::new(false));
        let (inst, name, params, positions, opts, first2) = (
            self.inst.clone(),
            self.name.clone(),
            params.clone(),
            positions.clone(),
            opts.clone(),
            first.clone(),
        );
        let f: RegionFn = Arc::new(move |xs: &[Tensor]| {
            let local = Sink::default();
            // Under FSDP the first run and the recompute in backward each ask for the block's
            // parameters: the recompute's fresh copies collect its gradients.
            let block_params = opts.params_of(&params, Stage::Layer(i))?;
            let out = layer(
                &inst,
                &name,
                &block_params,
                &positions,
                &opts,
                i,
                xs,
                &local,
            )?;
            drop(block_params);
            let emitted = local.into_inner().expect("sink lock poisoned");
            let packed = pack(&out, &emitted)?;
            if !ran.swap(true, Ordering::SeqCst) {
                opts.forward_done(Stage::Layer(i))?;
            }
            let mut f = first2.lock().expect("first-run lock poisoned");
            if f.is_none() {
                *f = Some((out, emitted));
            }
            Ok(packed)
        });
        let packed = checkpoint(&hidden, f)?;
        let (outs, emitted) = first
            .lock()
            .expect("first-run lock poisoned")
            .take()
            .ok_or_else(|| stage_err(&self.name, "layer", "returned nothing"))?;
        let (outs, aux) = unpack(&packed, outs, &emitted)?;
        let mut aux = aux.into_iter();
        let mut sink = sink.lock().expect("sink lock poisoned");
        for e in emitted {
            let tensor = match e.kind {
                OutputKind::AuxLoss => aux.next().unwrap_or(e.tensor),
                OutputKind::Stat => e.tensor,
            };
            sink.push(Emitted { tensor, ..e });
        }
        Ok(outs)
    }
}

impl PluginModel {
    /// Block `i` (not recomputed) with its parameters from [`ForwardOpts::stage_params`]: once
    /// its forward ends they may be freed, so every output that carries a gradient back into
    /// the block (its new floating outputs and its auxiliary losses) passes through an identity
    /// op whose backward asks for them again before any of the block's own backward runs.
    /// Outputs that share storage with an input (passed through) lead into no parameter of the
    /// block and are left as they are.
    fn gathered_layer(
        &self,
        params: &Params,
        positions: &Tensor,
        opts: &ForwardOpts,
        i: usize,
        hidden: &[Tensor],
        sink: &Sink,
    ) -> anneal_engine::Result<Vec<Tensor>> {
        let block_params = opts.params_of(params, Stage::Layer(i))?;
        let local = Sink::default();
        let outs = layer(
            &self.inst,
            &self.name,
            &block_params,
            positions,
            opts,
            i,
            hidden,
            &local,
        )?;
        drop(block_params);
        opts.forward_done(Stage::Layer(i))?;
        let Some(stages) = opts.stage_params.clone() else {
            return Err(stage_err(&self.name, "layer", "no stage parameters"));
        };
        // Several outputs lead into the block; the first gradient to arrive restores it.
        let entered = Arc::new(AtomicBool::new(false));
        let restore: anneal_engine::autograd::BeforeBackwardFn = Arc::new(move || {
            if entered.swap(true, Ordering::SeqCst) {
                return Ok(());
            }
            stages.before_backward(i)
        });
        let guard = |t: Tensor| -> Tensor {
            let passed_through = hidden.iter().any(|h| h.shares_storage_with(&t));
            if t.requires_grad() && !passed_through {
                before_backward(&t, restore.clone())
            } else {
                t
            }
        };
        let outs = outs.into_iter().map(guard).collect();
        let emitted = local.into_inner().expect("sink lock poisoned");
        let mut sink = sink.lock().expect("sink lock poisoned");
        for e in emitted {
            let tensor = match e.kind {
                OutputKind::AuxLoss => guard(e.tensor),
                OutputKind::Stat => e.tensor,
            };
            sink.push(Emitted { tensor, ..e });
        }
        Ok(outs)
    }
}

/// What a recomputed block's first (forward) run produced: its outputs and what it emitted.
type FirstRun = Arc<Mutex<Option<(Vec<Tensor>, Vec<Emitted>)>>>;

/// Whether a recomputed block's output travels through the packed tensor (floating point).
fn packed_kind(t: &Tensor) -> bool {
    t.dtype().is_float()
}

/// A block's floating outputs, then its auxiliary losses, flattened into one f32 tensor.
fn pack(outs: &[Tensor], emitted: &[Emitted]) -> anneal_engine::Result<Tensor> {
    let parts = outs
        .iter()
        .filter(|t| packed_kind(t))
        .chain(
            emitted
                .iter()
                .filter(|e| e.kind == OutputKind::AuxLoss)
                .map(|e| &e.tensor),
        )
        .map(|t| t.to_dtype(DType::F32)?.reshape(&[t.numel()]))
        .collect::<anneal_engine::Result<Vec<_>>>()?;
    match parts.len() {
        0 => Ok(Tensor::zeros(&[0], DType::F32)),
        1 => Ok(parts.into_iter().next().expect("one part")),
        _ => anneal_engine::ops::cat(&parts, 0),
    }
}

/// The inverse of [`pack`] on `packed` (shaped and typed like the first run's `outs` and
/// auxiliary losses): the block's outputs in order (integer ones from `outs` as they are) and
/// its auxiliary losses, both carrying `packed`'s gradient.
fn unpack(
    packed: &Tensor,
    outs: Vec<Tensor>,
    emitted: &[Emitted],
) -> anneal_engine::Result<(Vec<Tensor>, Vec<Tensor>)> {
    let mut at = 0;
    let mut take = |like: &Tensor| take_part(packed, &mut at, like.shape(), like.dtype());
    let outs = outs
        .iter()
        .map(|t| {
            if packed_kind(t) {
                take(t)
            } else {
                Ok(t.clone())
            }
        })
        .collect::<anneal_engine::Result<Vec<_>>>()?;
    let aux = emitted
        .iter()
        .filter(|e| e.kind == OutputKind::AuxLoss)
        .map(|e| take(&e.tensor))
        .collect::<anneal_engine::Result<Vec<_>>>()?;
    Ok((outs, aux))
}

/// The next `shape` values of `packed` from `at` (advanced past them), as `dtype`.
fn take_part(
    packed: &Tensor,
    at: &mut usize,
    shape: &[usize],
    dtype: DType,
) -> anneal_engine::Result<Tensor> {
    let n: usize = shape.iter().product();
    let t = packed.narrow(0, *at, n)?.reshape(shape)?;
    *at += n;
    if dtype == DType::F32 {
        Ok(t)
    } else {
        t.to_dtype(dtype)
    }
}

/// A block's floating hidden tensors flattened into one f32 tensor, as a recomputed block
/// packs them: what a pipeline stage sends to the next (one message, one gradient back).
/// Integer hidden tensors are left out.
pub fn pack_hidden(outs: &[Tensor]) -> anneal_engine::Result<Tensor> {
    pack(outs, &[])
}

/// The inverse of [`pack_hidden`]: the floating hidden tensors of shapes and dtypes `parts`,
/// as views of `packed` (so a gradient into them reaches `packed`).
pub fn unpack_hidden(
    packed: &Tensor,
    parts: &[(Vec<usize>, DType)],
) -> anneal_engine::Result<Vec<Tensor>> {
    let mut at = 0;
    parts
        .iter()
        .map(|(shape, dtype)| take_part(packed, &mut at, shape, *dtype))
        .collect()
}

/// Named outputs of a forward, in order.
type Named = Vec<(String, Tensor)>;

/// Auxiliary losses summed by name, and statistics by name; a statistic emitted twice in one
/// forward is the plugin's error (two layers must name theirs apart).
fn gather_outputs(name: &str, emitted: Vec<Emitted>) -> anneal_engine::Result<(Named, Named)> {
    let (mut aux, mut stats): (Named, Named) = (vec![], vec![]);
    for e in emitted {
        match e.kind {
            OutputKind::AuxLoss => match aux.iter_mut().find(|(n, _)| *n == e.name) {
                Some((_, t)) => *t = t.add(&e.tensor)?,
                None => aux.push((e.name, e.tensor)),
            },
            OutputKind::Stat => {
                if stats.iter().any(|(n, _)| *n == e.name) {
                    return Err(stage_err(
                        name,
                        "forward",
                        format!(
                            "the statistic '{}' was emitted twice in one forward",
                            e.name
                        ),
                    ));
                }
                stats.push((e.name, e.tensor.detach()));
            }
        }
    }
    Ok((aux, stats))
}

#[allow(clippy::too_many_arguments)]
fn layer(
    inst: &ModelBox,
    name: &str,
    params: &Params,
    positions: &Tensor,
    opts: &ForwardOpts,
    i: usize,
    hidden: &[Tensor],
    sink: &Sink,
) -> anneal_engine::Result<Vec<Tensor>> {
    run_stage(
        inst,
        name,
        params,
        positions,
        opts,
        sink,
        |inst, vt, ctx, s| {
            let hs: RVec<Handle> = hidden.iter().map(|t| s.insert(t.clone())).collect();
            inst.layer(vt, ctx, i as u64, hs).into_result()
        },
        "layer",
    )
}

/// One plugin call of a forward: gets the instance, the op table, the context and the session.
type StageResult = Result<RVec<Handle>, abi::PluginError>;

#[allow(clippy::too_many_arguments)]
fn run_stage(
    inst: &ModelBox,
    name: &str,
    params: &Params,
    positions: &Tensor,
    opts: &ForwardOpts,
    sink: &Sink,
    f: impl FnOnce(
        &ModelBox,
        &anneal_plugin_api::abi::HostVTable,
        &ForwardCtx,
        &HostSession,
    ) -> StageResult,
    what: &str,
) -> anneal_engine::Result<Vec<Tensor>> {
    let experts = opts.stage_params.as_ref().and_then(|s| s.expert_parallel());
    let tp = opts.stage_params.as_ref().and_then(|s| s.tensor_parallel());
    let session = HostSession::with_cache(params.clone(), opts.cache.clone())
        .accepting_outputs()
        .with_experts(experts)
        .with_ring(opts.ring.clone())
        .with_tensor_parallel(tp)
        .with_packed(opts.packed);
    let vt = session.vtable();
    let ctx = ForwardCtx {
        training: opts.training,
        positions: session.insert(positions.clone()),
        use_cache: opts.cache.is_some(),
        images: opts
            .images
            .as_ref()
            .map(|im| abi::ImageInputs {
                pixel_values: session.insert(im.pixel_values.clone()),
                grid_thw: im.grid_thw.iter().flatten().map(|&d| d as u64).collect(),
            })
            .into(),
        audio: opts
            .audio
            .as_ref()
            .map(|au| abi::AudioInputs {
                input_values: session.insert(au.input_values.clone()),
                lengths: au.lengths.iter().map(|&l| l as u64).collect(),
            })
            .into(),
    };
    let out = f(inst, &vt, &ctx, &session).map_err(|e| call_err(name, what, e))?;
    sink.lock()
        .expect("sink lock poisoned")
        .extend(session.take_emitted());
    out.into_iter()
        .map(|h| session.take(h).map_err(|e| stage_err(name, what, e)))
        .collect()
}

/// Draws one parameter's initial values.
pub fn init_param(p: &ParamSpec, seed: u64) -> anneal_engine::Result<Tensor> {
    let dtype = DType::parse(&p.dtype).ok_or_else(|| anneal_engine::Error::Invalid {
        op: "init",
        msg: format!("{}: unknown dtype {}", p.name, p.dtype),
    })?;
    let key = RngKey::new(seed, &p.name);
    let n: usize = p.shape.iter().product();
    let values: Vec<f32> = match &p.init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Normal { std } => key
            .normal_vec(0, n)
            .into_iter()
            .map(|z| z * *std as f32)
            .collect(),
        Init::Uniform { lo, hi } => key
            .uniform_vec(0, n)
            .into_iter()
            .map(|u| *lo as f32 + (*hi - *lo) as f32 * u)
            .collect(),
        Init::TruncNormal { std, a, b } => {
            // Exact truncation by redrawing: element i tries offsets i, i + n, i + 2n, ...
            let mut v: Vec<f32> = key
                .normal_vec(0, n)
                .into_iter()
                .map(|z| z * *std as f32)
                .collect();
            let (lo, hi) = (*a as f32, *b as f32);
            for round in 1..64u64 {
                let bad: Vec<usize> = (0..n).filter(|&i| v[i] < lo || v[i] > hi).collect();
                if bad.is_empty() {
                    break;
                }
                for i in bad {
                    v[i] = key.normal_vec(round * n as u64 + i as u64, 1)[0] * *std as f32;
                }
            }
            v.into_iter().map(|x| x.clamp(lo, hi)).collect()
        }
    };
    Tensor::from_vec(values, &p.shape)?.to_dtype(dtype)
}
