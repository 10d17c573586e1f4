//! The DeepSeek-V4 plugin: compressed sparse attention (CSA) and heavily compressed attention
//! (HCA) blocks over a sliding window with sinks (`attention.rs`), manifold-constrained
//! hyper-connections and hash- or learned-routed experts (`model.rs`), with a debug flavor that
//! trains on the built-in corpus in minutes and the released shapes for FLOP and memory
//! accounting. A plugin of its own rather than part of deepseek-v3: V4 keeps no MLA latent,
//! carries several residual streams and lays its checkpoint out differently; what it shares
//! with V3 (the expert ops) lives in the SDK.

pub mod attention;
pub mod config;
pub mod hf;
pub mod model;
pub mod spec;

use anneal_plugin_api::sdk::{model_args, Factory, Result};
pub use config::DeepseekV4Args;
pub use model::DeepseekV4;

impl Factory for DeepseekV4 {
    fn flavors() -> Vec<String> {
        config::FLAVORS.iter().map(|s| s.to_string()).collect()
    }

    /// `args` may hold `"hf_config": {..config.json..}` to build the model a Hugging Face
    /// directory describes; its other keys override single fields.
    fn create(flavor: Option<&str>, args: serde_json::Value) -> Result<Self> {
        DeepseekV4::new(model_args(
            flavor,
            args,
            config::FLAVORS,
            config::flavor,
            config::from_hf_config,
        )?)
    }
}

anneal_plugin_api::export_plugin!(model DeepseekV4, name = "deepseek_v4", model_types = ["deepseek_v4"], description = "DeepSeek-V4 decoder (compressed sparse / heavily compressed attention with a lightning indexer, sliding window and sinks, grouped low-rank output, manifold-constrained hyper-connections, hash- and learned-routed experts)");
