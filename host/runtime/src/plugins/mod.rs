//! Plugins: finding and loading them ([`loader`]), and serving their host-op calls over engine
//! tensors ([`host`]).

pub mod host;
pub mod loader;
mod ops;
pub mod optimizer;

pub use host::HostSession;
pub use loader::{discover, find, load, search_paths, LoadedPlugin, PluginError};
pub use optimizer::PluginOptimizer;
