//! The safe SDK plugin authors write against: [`Tensor`] (host ops as methods), the [`Model`]
//! and [`Optimizer`] traits, and [`export_plugin!`](crate::export_plugin).

pub mod checks;
mod compressed;
mod export;
mod hf_config;
pub mod kit;
mod linear_attention;
mod moe;
mod params;
mod tensor;
pub mod vision;

pub use compressed::{CompressedMaskOpts, GatheredAttentionOpts};
pub use export::{catch, ModelAdapter, OptimizerAdapter};
pub use hf_config::{HfConfig, HfRope};
pub use linear_attention::DeltaRuleOpts;
pub use moe::{tokens_per_expert_stat, MoeFfnOpts, MoeFfnOutput, Router, RouterScore};
pub use params::{Decl, LayerScope, Param, ParamTable};
pub use tensor::{AdamWStep, AttentionOpts, Host, Llama3Scaling, Rope, Tensor, YarnScaling};

pub use crate::abi::{Attr, ErrorKind, OutputKind, PluginError, PluginKind};
pub use crate::spec::*;

/// An error inside a plugin: a message for the user, which the host prefixes with the plugin
/// name, and whose problem it is ([`ErrorKind`]). Plugin code usually builds it from a string
/// (`Err(format!(..).into())`), which says the plugin refuses its input; a host op's error
/// keeps the host's kind, and a panic becomes [`ErrorKind::Internal`] at the boundary.
#[derive(Debug, Clone, PartialEq)]
pub struct Error {
    /// Whose problem it is.
    pub kind: ErrorKind,
    /// What went wrong.
    pub msg: String,
}

impl Error {
    /// The plugin refuses its input (arguments, flavor, a shape or setting it does not support).
    pub fn input(msg: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::Input,
            msg: msg.into(),
        }
    }

    /// The plugin broke by itself (an invariant of its own that does not hold): a bug.
    pub fn internal(msg: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::Internal,
            msg: msg.into(),
        }
    }

    /// An error the host returned, with its kind kept.
    pub(crate) fn from_host(e: PluginError) -> Self {
        Error {
            kind: e.kind,
            msg: e.message.into(),
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

impl From<String> for Error {
    fn from(s: String) -> Self {
        Error::input(s)
    }
}

impl From<&str> for Error {
    fn from(s: &str) -> Self {
        Error::input(s)
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::input(format!("bad plugin arguments: {e}"))
    }
}

/// Result type of plugin code.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The per-call context of a forward stage.
pub struct Ctx<'h> {
    /// The host's op table for this call.
    pub host: Host<'h>,
    /// Training (activations kept for backward) or inference.
    pub training: bool,
    /// Absolute positions of this call's tokens (i64 `[T]`, or `[B, T]` when each row is its own
    /// sequence at its own place; hand them to `rope` and `attention` unchanged).
    pub positions: Tensor<'h>,
    /// Whether attention should use the host's KV cache (and [`Ctx::cache_append`],
    /// [`Ctx::state`] keep state between calls).
    pub use_cache: bool,
    /// The images of this forward, for a vision-language model; `None` for text.
    pub images: Option<Images<'h>>,
    /// The audio clips of this forward, for an audio-language model; `None` without audio.
    pub audio: Option<Audio<'h>>,
}

/// The images of one forward: every image's patches one after another, and each image's grid.
pub struct Images<'h> {
    /// `pixel_values [patches, C·t·p·p]` (f32).
    pub pixel_values: Tensor<'h>,
    /// `(t, h, w)` in patches, one per image, in the order of their placeholder tokens.
    pub grids: Vec<[usize; 3]>,
}

/// The audio clips of one forward: mono waveforms right-padded to one length, and each clip's
/// real length.
pub struct Audio<'h> {
    /// `input_values [clips, samples]` (f32).
    pub input_values: Tensor<'h>,
    /// Each clip's length in samples, in the order of their placeholder tokens.
    pub lengths: Vec<usize>,
}

impl<'h> Ctx<'h> {
    /// The tensor of a declared parameter.
    pub fn w(&self, p: &Param) -> Result<Tensor<'h>> {
        self.host.w(p)
    }

    /// Adds a scalar auxiliary loss (a router's load-balancing loss): the trainer adds it to
    /// the loss, times `training.aux_loss_weights.<name>` (1 when unset). Losses of one name
    /// in one forward are summed.
    pub fn aux_loss(&self, name: &str, loss: &Tensor<'h>) -> Result<()> {
        self.host.emit(crate::abi::OutputKind::AuxLoss, name, loss)
    }

    /// Reports a named statistic (router load per expert, dropped tokens): a scalar or a
    /// vector that reaches `metrics.jsonl`. No gradient flows through it.
    pub fn stat(&self, name: &str, value: &Tensor<'h>) -> Result<()> {
        self.host.emit(crate::abi::OutputKind::Stat, name, value)
    }

    /// Appends `x` to layer `layer`'s inference cache `name` along `dim` and returns all that
    /// is cached for this sequence (MLA's latent cache, of any shape); without a cache in this
    /// forward (training), returns `x`. The host owns the cache, as it owns the KV cache.
    pub fn cache_append(
        &self,
        layer: usize,
        name: &str,
        x: &Tensor<'h>,
        dim: usize,
    ) -> Result<Tensor<'h>> {
        let attrs = crate::ops::CacheAppend {
            layer: layer as i64,
            name: name.into(),
            dim: dim as i64,
        };
        let [t]: [Tensor<'h>; 1] = self.host.call_op(&attrs, &[x])?.try_into().map_err(|_| {
            Error::internal("host op cache_append returned the wrong number of outputs")
        })?;
        Ok(t)
    }

    /// Layer `layer`'s inference state `name` from this sequence's previous call (a
    /// linear-attention recurrent state, of any shape); `None` at the sequence's start or
    /// without a cache.
    pub fn state(&self, layer: usize, name: &str) -> Result<Option<Tensor<'h>>> {
        let attrs = crate::ops::StateGet {
            layer: layer as i64,
            name: name.into(),
        };
        Ok(self.host.call_op(&attrs, &[])?.into_iter().next())
    }

    /// Keeps `x` as layer `layer`'s inference state `name` for this sequence's next call
    /// (dropped without a cache).
    pub fn set_state(&self, layer: usize, name: &str, x: &Tensor<'h>) -> Result<()> {
        let attrs = crate::ops::StateSet {
            layer: layer as i64,
            name: name.into(),
        };
        self.host.call_op(&attrs, &[x]).map(|_| ())
    }
}

/// A model architecture, written with host ops. One implementation serves training,
/// evaluation, prefill and decode.
pub trait Model: Send + Sync + 'static {
    /// Parameters, module tree and costs.
    fn spec(&self) -> ModelSpec;
    /// Token ids (i64 `[B, T]`) to the hidden state.
    fn embed<'h>(&self, ctx: &Ctx<'h>, tokens: Tensor<'h>) -> Result<Vec<Tensor<'h>>>;
    /// Block `index`.
    fn layer<'h>(
        &self,
        ctx: &Ctx<'h>,
        index: usize,
        hidden: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>>;
    /// The hidden state to logits `[B, T, V]`.
    fn head<'h>(&self, ctx: &Ctx<'h>, hidden: Vec<Tensor<'h>>) -> Result<Tensor<'h>>;
    /// Updates buffers ([`Decl::buffer`]) once per optimizer step, before the update: read the
    /// step's statistics (summed over micro-batches) with `host.param("stats.<name>")` and
    /// write buffers in place with `assign`. The default changes nothing.
    fn before_optimizer_step(&self, host: Host<'_>, step: u64) -> Result<()> {
        let _ = (host, step);
        Ok(())
    }
}

/// An optimizer, written with host ops.
pub trait Optimizer: Send + Sync + 'static {
    /// State per parameter and needs.
    fn spec(&self) -> OptimizerSpec;
    /// Updates parameter `name` in place (reach it, its gradient and its state with
    /// `host.param(name)`, `host.param(&format!("{name}.grad"))`, ...).
    fn step(&self, host: Host<'_>, name: &str, step: u64, lr: f64) -> Result<()>;
    /// Updates every parameter in `names` (the host calls this once per optimizer step). The
    /// default runs [`Optimizer::step`] on each in order; override it to update all of them
    /// with one fused host op.
    fn step_all(&self, host: Host<'_>, names: &[&str], step: u64, lr: f64) -> Result<()> {
        for name in names {
            self.step(host, name, step, lr).map_err(|e| Error {
                msg: format!("{name}: {e}"),
                ..e
            })?;
        }
        Ok(())
    }
}

/// How a plugin is instantiated from a flavor and JSON arguments.
pub trait Factory: Sized {
    /// The named flavors.
    fn flavors() -> Vec<String>;
    /// Builds an instance of `flavor` (default when `None`), with `args` overriding its fields.
    fn create(flavor: Option<&str>, args: serde_json::Value) -> Result<Self>;
}

/// Reads plugin arguments into `T`; an error names the key it is about (`betas[1]: invalid
/// type: string "x", expected f64`), so the user can find it in `model.args` / `optimizer.args`.
pub fn from_args<T: serde::de::DeserializeOwned>(args: serde_json::Value) -> Result<T> {
    serde_path_to_error::deserialize(args).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            Error::input(format!("bad plugin arguments: {inner}"))
        } else {
            Error::input(format!("bad plugin arguments: {path}: {inner}"))
        }
    })
}

/// The arguments a model plugin builds its model from, as every `Factory::create` wants them:
/// with `"hf_config"` in `args` (a Hugging Face directory's `config.json`), what `from_hf` reads
/// from it; otherwise the flavor `flavor` (the first of `flavors` when `None`) that `flavor_of`
/// names, an unknown name listing the known ones. The other keys of `args` then override single
/// fields, and an unknown key is an error naming it.
pub fn model_args<A: serde::Serialize + serde::de::DeserializeOwned>(
    flavor: Option<&str>,
    mut args: serde_json::Value,
    flavors: &[&str],
    flavor_of: impl Fn(&str) -> Option<A>,
    from_hf: impl Fn(&serde_json::Value) -> Result<A, String>,
) -> Result<A> {
    let base = match args.as_object_mut().and_then(|o| o.remove("hf_config")) {
        Some(hf) => from_hf(&hf)?,
        None => {
            let name = flavor.or(flavors.first().copied()).unwrap_or("default");
            flavor_of(name)
                .ok_or_else(|| format!("unknown flavor '{name}' (known: {})", flavors.join(", ")))?
        }
    };
    let mut merged = serde_json::to_value(base)?;
    merge_args(&mut merged, args);
    from_args(merged)
}

/// Merges `overrides` (a JSON object) into `base`, so `args` in a config can change single
/// fields of a flavor.
pub fn merge_args(base: &mut serde_json::Value, overrides: serde_json::Value) {
    match (base, overrides) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                merge_args(b.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, o) => *b = o,
    }
}
