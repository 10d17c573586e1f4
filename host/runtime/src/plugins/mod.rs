//! Plugins: finding and loading them ([`loader`]), and serving their host-op calls over engine
//! tensors ([`host`]).

pub mod host;
mod kv_cache;
pub mod loader;
pub mod model;
mod ops;
mod ops_compressed;
mod ops_context;
mod ops_linear;
mod ops_moe;
mod ops_state;
mod ops_tp;
mod ops_vision;
pub mod optimizer;
pub mod recompute;
pub mod stage_params;

pub use host::{Emitted, HostSession};
pub use kv_cache::KvCache;
pub use loader::{
    discover, find, find_for_model_type, find_for_model_type_in, find_in, load, search_paths,
    LoadedPlugin, PluginError,
};
pub use model::{
    pack_hidden, unpack_hidden, AudioInputs, ForwardOpts, ForwardOutput, ImageInputs, Params,
    PartOutput, PluginModel, StageInput,
};
pub use ops_tp::{TensorParallelGroup, TensorParallelism, TpGroup};
pub use optimizer::PluginOptimizer;
pub use stage_params::{ResidentTensorParallel, Stage, StageParams};
