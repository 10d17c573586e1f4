//! `#[repr(C)]`, layout-checked types that cross the boundary. Nothing here is Rust-ABI: every
//! type derives `StableAbi`, which abi_stable compares between host and plugin at load time.

// `#[sabi_trait]` expands to impls inside a const block; the lint fires on generated code only.
#![allow(non_local_definitions)]

use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings, sabi_trait,
    sabi_types::VersionStrings,
    std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec},
    StableAbi,
};
use std::ffi::c_void;

/// An opaque reference to a tensor owned by the host.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle(pub u64);

/// A typed attribute of a host-op call (scalars, lists, names, optional tensors).
#[repr(C, u8)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub enum Attr {
    /// Absent optional argument.
    None,
    /// A flag.
    Bool(bool),
    /// An integer (dims, sizes, indices).
    Int(i64),
    /// A float (eps, scales).
    Float(f64),
    /// A list of integers (shapes, permutations).
    Ints(RVec<i64>),
    /// A string (dtype names, modes).
    Str(RString),
    /// An optional tensor argument.
    Tensor(Handle),
}

/// Whose problem an error across the boundary is, so the host can tell the user what to do.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The plugin refused its input (arguments, a flavor, a shape or setting it does not
    /// support): the user's to change.
    Input,
    /// The plugin failed by itself (a panic, a broken invariant): a bug in the plugin.
    Internal,
    /// A host op or lookup the plugin called failed, passed back unchanged.
    Host,
}

/// An error crossing the boundary, in either direction: its kind and its message.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct PluginError {
    /// Whose problem it is.
    pub kind: ErrorKind,
    /// What went wrong, for the user.
    pub message: RString,
}

impl PluginError {
    /// An error of `kind` saying `message`.
    pub fn new(kind: ErrorKind, message: impl Into<RString>) -> Self {
        PluginError {
            kind,
            message: message.into(),
        }
    }
}

/// The result of a call across the boundary.
pub type PluginResult<T> = RResult<T, PluginError>;

/// Whether a plugin is a model or an optimizer.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginKind {
    /// A model architecture.
    Model,
    /// An optimizer.
    Optimizer,
}

/// What a plugin says about itself before it is instantiated.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct PluginInfo {
    /// The interface version the plugin was built against ([`crate::API_VERSION`]).
    pub api_version: u32,
    /// Model or optimizer.
    pub kind: PluginKind,
    /// The name configs refer to (`llama`, `adamw`).
    pub name: RString,
    /// Named argument sets (`debugmodel`, `8B`).
    pub flavors: RVec<RString>,
    /// One line for `anneal plugins list`.
    pub description: RString,
    /// The Hugging Face `model_type`s (`config.json`) a model plugin builds models for, so the
    /// host can pick the plugin for a directory without being told; empty for optimizers.
    pub model_types: RVec<RString>,
}

/// The host's op table, passed to every plugin call. `ctx` is the host's state for the call;
/// the functions are only valid during that call.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct HostVTable {
    /// Host state the functions need (opaque to the plugin).
    pub ctx: *const c_void,
    /// Runs host op `op` on `inputs` with `attrs`; returns handles to its outputs.
    pub call: unsafe extern "C" fn(
        *const c_void,
        RStr<'_>,
        RSlice<'_, Handle>,
        RSlice<'_, Attr>,
    ) -> PluginResult<RVec<Handle>>,
    /// The shape of a tensor.
    pub shape: unsafe extern "C" fn(*const c_void, Handle) -> PluginResult<RVec<u64>>,
    /// The dtype name of a tensor (`f32`, `bf16`, ...).
    pub dtype: unsafe extern "C" fn(*const c_void, Handle) -> PluginResult<RString>,
    /// A handle to the parameter (or optimizer state) named `name`.
    pub param: unsafe extern "C" fn(*const c_void, RStr<'_>) -> PluginResult<Handle>,
    /// Another handle to the same tensor.
    pub retain: unsafe extern "C" fn(*const c_void, Handle) -> Handle,
    /// Gives a handle back; the tensor lives on while the host or other handles hold it.
    pub release: unsafe extern "C" fn(*const c_void, Handle),
    /// Hands the host a named output of the forward besides the logits (an auxiliary loss or a
    /// statistic), from any stage. Only model forwards accept them.
    pub emit: unsafe extern "C" fn(*const c_void, OutputKind, RStr<'_>, Handle) -> PluginResult<()>,
    /// The values of an integer tensor, row-major (a copy to host memory: meant for small
    /// index tensors, such as the token ids a vision-language model finds its image
    /// placeholders in). Since API version 5.
    pub read_ints: unsafe extern "C" fn(*const c_void, Handle) -> PluginResult<RVec<i64>>,
}

/// What a named forward output is for.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// A scalar the trainer adds to the loss (times its weight from `training.aux_loss_weights`),
    /// so gradients flow through it. Outputs of one name in one forward are summed.
    AuxLoss,
    /// A value (scalar or vector, no gradient) the trainer writes to `metrics.jsonl` under its
    /// name, averaged over the step's micro-batches.
    Stat,
}

/// Per-call context of a model forward: what kind of pass, and where in the sequence.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct ForwardCtx {
    /// Training (dropout on, activations kept for backward) or not.
    pub training: bool,
    /// Absolute positions of the tokens of this call (i64 `[T]`); with a KV cache these start
    /// at the cache length. When the rows of a batch are separate sequences at their own places
    /// (continuous batching) they are `[B, T]`; models pass them to `rope` and `attention` as
    /// they are.
    pub positions: Handle,
    /// Whether attention layers should read and append the host's per-layer KV cache.
    pub use_cache: bool,
    /// The images of this forward (vision-language models), in the order their placeholder
    /// tokens appear; `None` for text. Since API version 5.
    pub images: ROption<ImageInputs>,
    /// The audio clips of this forward (audio-language models), in the order their
    /// placeholder tokens appear; `None` without audio. Since API version 6.
    pub audio: ROption<AudioInputs>,
}

/// The images of one forward, as the processor made them (`anneal_data::image`, or
/// transformers' Qwen2-VL / Qwen3-VL image processor).
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct ImageInputs {
    /// `pixel_values [patches, C·t·p·p]` (f32), every image's patches one after another.
    pub pixel_values: Handle,
    /// `image_grid_thw`: three numbers per image (temporal, height, width in patches).
    pub grid_thw: RVec<u64>,
}

/// The audio clips of one forward, as the feature extractor made them (`anneal_data::audio`, or
/// transformers' raw-waveform extractors): mono waveforms at the model's rate, right-padded with
/// zeros to one length.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct AudioInputs {
    /// `input_values [clips, samples]` (f32), one padded waveform per row.
    pub input_values: Handle,
    /// Each clip's real length in samples (the rest of its row is padding).
    pub lengths: RVec<u64>,
}

/// A model instance (one flavor with its arguments), as seen by the host.
#[sabi_trait]
pub trait ModelPlugin: Send + Sync {
    /// The model's [`crate::spec::ModelSpec`] as JSON.
    fn spec_json(&self) -> RString;
    /// Token ids (i64 `[B, T]`) to the hidden state (one or more tensors).
    fn embed(
        &self,
        host: &HostVTable,
        ctx: &ForwardCtx,
        tokens: Handle,
    ) -> PluginResult<RVec<Handle>>;
    /// One block: hidden state in, hidden state out.
    fn layer(
        &self,
        host: &HostVTable,
        ctx: &ForwardCtx,
        index: u64,
        hidden: RVec<Handle>,
    ) -> PluginResult<RVec<Handle>>;
    /// The hidden state to logits `[B, T, V]`.
    #[sabi(last_prefix_field)]
    fn head(
        &self,
        host: &HostVTable,
        ctx: &ForwardCtx,
        hidden: RVec<Handle>,
    ) -> PluginResult<Handle>;
    /// Updates the model's buffers once per optimizer step, after backward and before the
    /// update. `host.param` reaches every parameter and buffer by name, and `"stats.<name>"`:
    /// each statistic the step's forwards emitted, summed over its micro-batches.
    fn before_optimizer_step(&self, host: &HostVTable, step: u64) -> PluginResult<()>;
}

/// An optimizer instance, as seen by the host.
#[sabi_trait]
pub trait OptimizerPlugin: Send + Sync {
    /// The optimizer's [`crate::spec::OptimizerSpec`] as JSON (state per parameter, needs).
    fn spec_json(&self) -> RString;
    /// Updates one parameter in place. Its gradient and state are reachable through
    /// `host.param` as `"<name>"`, `"<name>.grad"` and `"<name>.<state>"`.
    #[sabi(last_prefix_field)]
    fn step(&self, host: &HostVTable, name: RStr<'_>, step: u64, lr: f64) -> PluginResult<()>;
    /// Updates every parameter in `names` (reached as in `step`) in one call, so an optimizer
    /// can fuse them into one host op. Since API version 2; it sits after the prefix so that
    /// an older plugin still loads far enough for the version check to name the mismatch.
    fn step_all(
        &self,
        host: &HostVTable,
        names: RSlice<'_, RStr<'_>>,
        step: u64,
        lr: f64,
    ) -> PluginResult<()>;
}

/// An owned model instance across the boundary.
pub type ModelBox = ModelPlugin_TO<'static, RBox<()>>;
/// An owned optimizer instance across the boundary.
pub type OptimizerBox = OptimizerPlugin_TO<'static, RBox<()>>;

/// An instance of either kind.
#[repr(C, u8)]
#[derive(StableAbi)]
pub enum PluginInstance {
    /// A model.
    Model(ModelBox),
    /// An optimizer.
    Optimizer(OptimizerBox),
}

/// The root module every plugin exports.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(panic))]
pub struct PluginMod {
    /// Describes the plugin (name, kind, flavors, API version).
    pub info: extern "C" fn() -> PluginInfo,
    /// Instantiates `flavor` (or none) with JSON `args` overriding the flavor's.
    #[sabi(last_prefix_field)]
    pub create: extern "C" fn(
        flavor: ROption<RStr<'_>>,
        args_json: RStr<'_>,
    ) -> PluginResult<PluginInstance>,
}

impl RootModule for PluginModRef {
    declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "anneal_plugin";
    const NAME: &'static str = "anneal_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

impl std::fmt::Debug for PluginInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PluginInstance::Model(_) => "PluginInstance::Model",
            PluginInstance::Optimizer(_) => "PluginInstance::Optimizer",
        })
    }
}
