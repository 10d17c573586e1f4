//! The runtime of the Anneal host: loading plugins and running them over the engine.

pub mod checkpoint;
pub mod hf;
pub mod infer;
pub mod plugins;
pub mod rl;
pub mod train;
