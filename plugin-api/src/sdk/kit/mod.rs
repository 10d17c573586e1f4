//! The model kit: what every model plugin would otherwise write by hand.
//!
//! - [`ModelArgs`] (derived with `#[derive(ModelArgs)]`): a model-args struct declared once
//!   gives its `config.json` import and export and its per-field checks, with key paths;
//! - [`flavors!`](crate::flavors): the table of named flavors;
//! - [`decoder`]: the decoder skeleton (embedding → blocks → norm → head) a plugin fills with
//!   its attention and feed-forward, and [`blocks`]: the pieces families repeat;
//! - [`kda`] and [`mla`]: Kimi Delta Attention and multi-head latent attention, declared under
//!   a checkpoint's names and run with host ops.

mod args;
pub mod blocks;
pub mod check;
pub mod decoder;
pub mod kda;
pub mod mla;

pub use anneal_kit_derive::ModelArgs;
pub use args::{write_rope, HfField, ModelArgs};
pub use decoder::{nth_layer, BlockNorms, Decoder, Frame, LayerType, Norm, Sublayer};

/// The named flavors of a model plugin: `FLAVORS` (their names, in the order
/// `anneal plugins list` shows them) and a function from a name to its arguments.
///
/// ```ignore
/// anneal_plugin_api::flavors! {
///     /// The named flavors.
///     pub fn flavor -> LlamaArgs;
///     "debugmodel" => base(),
///     "llama3_8b" => LlamaArgs { dim: 4096, ..base() },
/// }
/// ```
#[macro_export]
macro_rules! flavors {
    ($(#[$m:meta])* $vis:vis fn $f:ident -> $ty:ty; $($name:literal => $e:expr),+ $(,)?) => {
        /// Flavor names, in the order `anneal plugins list` shows them.
        $vis const FLAVORS: &[&str] = &[$($name),+];

        $(#[$m])*
        $vis fn $f(name: &str) -> ::core::option::Option<$ty> {
            ::core::option::Option::Some(match name {
                $($name => $e,)+
                _ => return ::core::option::Option::None,
            })
        }
    };
}

/// `Factory` for a model plugin whose module `$config` holds its `FLAVORS`, `flavor` and
/// `from_hf_config` and whose `$model::new` builds it from its arguments: `args` may hold
/// `"hf_config": {..config.json..}` to build the model a Hugging Face directory describes, and
/// its other keys override single fields.
#[macro_export]
macro_rules! model_factory {
    ($model:ty, $config:path) => {
        impl $crate::sdk::Factory for $model {
            fn flavors() -> ::std::vec::Vec<::std::string::String> {
                use $config as config;
                config::FLAVORS.iter().map(|s| s.to_string()).collect()
            }

            fn create(
                flavor: ::core::option::Option<&str>,
                args: $crate::serde_json::Value,
            ) -> $crate::sdk::Result<Self> {
                use $config as config;
                <$model>::new($crate::sdk::model_args(
                    flavor,
                    args,
                    config::FLAVORS,
                    config::flavor,
                    config::from_hf_config,
                )?)
            }
        }
    };
}
