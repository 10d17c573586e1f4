//! The plugin boundary of Anneal.
//!
//! A plugin is a `cdylib` exporting one abi_stable root module ([`abi::PluginModRef`]). The host
//! loads it, checks [`API_VERSION`], and hands it a table of **host ops** ([`abi::HostVTable`])
//! over opaque tensor handles: the plugin says *what* to compute, the host decides *how*.
//!
//! Host ops are called by name with handle inputs and typed attributes, so the host can add ops
//! without changing any layout: an old plugin keeps working, and a plugin that calls an op this
//! host lacks gets an error naming the op.
//!
//! Plugin authors use [`sdk`]: a `Tensor` wrapper whose methods are host ops, spec types, and the
//! [`export_plugin!`] macro, which also turns panics into errors so none crosses the boundary.

// The model kit's derive names this crate by its path, inside it too.
extern crate self as anneal_plugin_api;

pub mod abi;
mod hf_map;
pub mod ops;
pub mod sdk;
pub mod spec;

pub use serde_json;

/// The version of this interface. The host refuses plugins built for another one.
/// 2: optimizers update all parameters in one call (`OptimizerPlugin::step_all`).
/// 3: plugins declare the Hugging Face model types they serve (`PluginInfo::model_types`);
/// parameters carry their Hugging Face mapping (`ParamSpec::hf`); host-op attributes are the
/// typed structs of [`ops`].
/// 4: errors across the boundary are typed ([`abi::PluginError`]: refused input, a plugin's
/// own failure, or a host op's failure passed back).
/// 5: a forward may carry images (`ForwardCtx::images`: pixel values and their grids) for
/// vision-language models; plugins may read an integer tensor's values (`HostVTable::read_ints`).
/// 6: a forward may carry audio clips (`ForwardCtx::audio`: padded waveforms and their lengths)
/// for audio-language models.
pub const API_VERSION: u32 = 6;
