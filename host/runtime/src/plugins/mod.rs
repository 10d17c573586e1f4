//! Plugins: finding and loading them ([`loader`]), and serving their host-op calls over engine
//! tensors ([`host`]).

pub mod host;
pub mod loader;
pub mod model;
mod ops;
pub mod optimizer;
pub mod recompute;

pub use host::{HostSession, KvCache};
pub use loader::{discover, find, load, search_paths, LoadedPlugin, PluginError};
pub use model::{ForwardOpts, Params, PluginModel};
pub use optimizer::PluginOptimizer;
