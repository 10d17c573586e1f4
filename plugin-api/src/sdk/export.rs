//! Adapters from the SDK traits to the boundary's trait objects, with panics caught, and the
//! `export_plugin!` macro that writes a plugin's root module.

use super::{Ctx, Error, Host, Model, Optimizer, Result};
use crate::abi::{
    ErrorKind, ForwardCtx, Handle, HostVTable, ModelPlugin, OptimizerPlugin, PluginError,
    PluginResult,
};
use abi_stable::std_types::{RErr, ROk, RSlice, RStr, RString, RVec};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs plugin code so that neither an error nor a panic crosses the boundary as anything but
/// a typed error: the plugin's own errors keep their kind, a panic is
/// [`ErrorKind::Internal`](crate::abi::ErrorKind::Internal).
pub fn catch<T>(what: &str, f: impl FnOnce() -> Result<T>) -> PluginResult<T> {
    quiet_panics();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => ROk(v),
        Ok(Err(e)) => RErr(PluginError::new(e.kind, format!("{what}: {}", e.msg))),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            let at = PANIC_AT
                .with(|a| a.borrow_mut().take())
                .map(|l| format!(" (at {l})"))
                .unwrap_or_default();
            RErr(PluginError::new(
                ErrorKind::Internal,
                format!("{what}: panic in the plugin: {msg}{at}"),
            ))
        }
    }
}

thread_local! {
    /// Where the last panic on this thread happened, for the error that reports it.
    static PANIC_AT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Replaces the plugin's panic hook (its own: a plugin links its own standard library) with one
/// that only notes where the panic happened, so a caught panic reaches the user once, as the
/// error [`catch`] returns, instead of also as a message and backtrace on stderr. With
/// `RUST_BACKTRACE` set the default hook still prints, for whoever debugs the plugin.
fn quiet_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        let verbose = std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0");
        std::panic::set_hook(Box::new(move |info| {
            let at = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()));
            PANIC_AT.with(|a| *a.borrow_mut() = at);
            if verbose {
                default(info);
            }
        }));
    });
}

/// A spec as JSON, or `{"error": ..., "kind": ...}` if building it failed or panicked.
fn spec_to_json<S: serde::Serialize>(spec: impl FnOnce() -> S) -> RString {
    match catch("spec", || {
        serde_json::to_string(&spec()).map_err(|e| Error::internal(e.to_string()))
    }) {
        ROk(s) => s.into(),
        RErr(e) => serde_json::json!({
            "error": e.message.as_str(),
            "kind": match e.kind {
                ErrorKind::Input => "input",
                ErrorKind::Internal => "internal",
                ErrorKind::Host => "host",
            },
        })
        .to_string()
        .into(),
    }
}

fn handles(ts: Vec<super::Tensor<'_>>) -> RVec<Handle> {
    ts.into_iter().map(|t| t.into_handle()).collect()
}

fn make_ctx<'h>(host: Host<'h>, ctx: &ForwardCtx) -> Ctx<'h> {
    Ctx {
        host,
        training: ctx.training,
        positions: host.adopt(ctx.positions),
        use_cache: ctx.use_cache,
        images: ctx
            .images
            .as_ref()
            .map(|im| super::Images {
                pixel_values: host.adopt(im.pixel_values),
                grids: im
                    .grid_thw
                    .chunks(3)
                    .map(|g| [g[0] as usize, g[1] as usize, g[2] as usize])
                    .collect(),
            })
            .into_option(),
        audio: ctx
            .audio
            .as_ref()
            .map(|au| super::Audio {
                input_values: host.adopt(au.input_values),
                lengths: au.lengths.iter().map(|&l| l as usize).collect(),
            })
            .into_option(),
    }
}

/// Exposes a [`Model`] through the boundary's [`ModelPlugin`] trait.
pub struct ModelAdapter<M>(pub M);

impl<M: Model> ModelPlugin for ModelAdapter<M> {
    fn spec_json(&self) -> RString {
        spec_to_json(|| self.0.spec())
    }

    fn embed(
        &self,
        host: &HostVTable,
        ctx: &ForwardCtx,
        tokens: Handle,
    ) -> PluginResult<RVec<Handle>> {
        catch("embed", || {
            let h = Host::new(host);
            Ok(handles(self.0.embed(&make_ctx(h, ctx), h.adopt(tokens))?))
        })
    }

    fn layer(
        &self,
        host: &HostVTable,
        ctx: &ForwardCtx,
        index: u64,
        hidden: RVec<Handle>,
    ) -> PluginResult<RVec<Handle>> {
        catch("layer", || {
            let h = Host::new(host);
            let hidden = hidden.into_iter().map(|x| h.adopt(x)).collect();
            Ok(handles(self.0.layer(
                &make_ctx(h, ctx),
                index as usize,
                hidden,
            )?))
        })
    }

    fn head(
        &self,
        host: &HostVTable,
        ctx: &ForwardCtx,
        hidden: RVec<Handle>,
    ) -> PluginResult<Handle> {
        catch("head", || {
            let h = Host::new(host);
            let hidden = hidden.into_iter().map(|x| h.adopt(x)).collect();
            Ok(self.0.head(&make_ctx(h, ctx), hidden)?.into_handle())
        })
    }

    fn before_optimizer_step(&self, host: &HostVTable, step: u64) -> PluginResult<()> {
        catch("before_optimizer_step", || {
            self.0.before_optimizer_step(Host::new(host), step)
        })
    }
}

/// Exposes an [`Optimizer`] through the boundary's [`OptimizerPlugin`] trait.
pub struct OptimizerAdapter<O>(pub O);

impl<O: Optimizer> OptimizerPlugin for OptimizerAdapter<O> {
    fn spec_json(&self) -> RString {
        spec_to_json(|| self.0.spec())
    }

    fn step(&self, host: &HostVTable, name: RStr<'_>, step: u64, lr: f64) -> PluginResult<()> {
        catch("step", || {
            self.0.step(Host::new(host), name.as_str(), step, lr)
        })
    }

    fn step_all(
        &self,
        host: &HostVTable,
        names: RSlice<'_, RStr<'_>>,
        step: u64,
        lr: f64,
    ) -> PluginResult<()> {
        catch("step", || {
            let names: Vec<&str> = names.iter().map(|n| n.as_str()).collect();
            self.0.step_all(Host::new(host), &names, step, lr)
        })
    }
}

/// Writes the root module of a plugin crate (a `cdylib` that depends on `abi_stable` and this
/// crate).
///
/// ```ignore
/// anneal_plugin_api::export_plugin!(model Llama, name = "llama", model_types = ["llama", "qwen3"],
///     description = "Llama 3 / Qwen3");
/// anneal_plugin_api::export_plugin!(optimizer AdamW, name = "adamw", description = "AdamW");
/// ```
/// `model_types` lists the Hugging Face `model_type`s the model is built for from a
/// `config.json`, so `anneal logprobs --model-dir` and friends find the plugin by itself.
#[macro_export]
macro_rules! export_plugin {
    (@root $kind:ident, $ty:ty, $name:expr, $desc:expr, [$($mt:expr),*], $wrap:expr) => {
        #[::abi_stable::export_root_module]
        pub fn anneal_plugin_root() -> $crate::abi::PluginModRef {
            extern "C" fn info() -> $crate::abi::PluginInfo {
                $crate::abi::PluginInfo {
                    api_version: $crate::API_VERSION,
                    kind: $crate::abi::PluginKind::$kind,
                    name: ($name).into(),
                    flavors: <$ty as $crate::sdk::Factory>::flavors().into_iter().map(Into::into).collect(),
                    description: ($desc).into(),
                    model_types: ::std::vec![$(::abi_stable::std_types::RString::from($mt)),*].into_iter().collect(),
                }
            }
            extern "C" fn create(
                flavor: ::abi_stable::std_types::ROption<::abi_stable::std_types::RStr<'_>>,
                args: ::abi_stable::std_types::RStr<'_>,
            ) -> $crate::abi::PluginResult<$crate::abi::PluginInstance> {
                $crate::sdk::catch("create", || {
                    let args: $crate::serde_json::Value = if args.as_str().trim().is_empty() {
                        $crate::serde_json::Value::Object(Default::default())
                    } else {
                        $crate::serde_json::from_str(args.as_str())?
                    };
                    let flavor = flavor.into_option().map(|s| s.as_str());
                    let inst = <$ty as $crate::sdk::Factory>::create(flavor, args)?;
                    Ok(($wrap)(inst))
                })
            }
            use ::abi_stable::prefix_type::PrefixTypeTrait;
            $crate::abi::PluginMod { info, create }.leak_into_prefix()
        }
    };
    (model $ty:ty, name = $name:expr, description = $desc:expr) => {
        $crate::export_plugin!(model $ty, name = $name, model_types = [], description = $desc);
    };
    (model $ty:ty, name = $name:expr, model_types = [$($mt:expr),* $(,)?], description = $desc:expr) => {
        $crate::export_plugin!(@root Model, $ty, $name, $desc, [$($mt),*], |m: $ty| $crate::abi::PluginInstance::Model(
            $crate::abi::ModelPlugin_TO::from_value($crate::sdk::ModelAdapter(m), ::abi_stable::sabi_trait::TD_Opaque)
        ));
    };
    (optimizer $ty:ty, name = $name:expr, description = $desc:expr) => {
        $crate::export_plugin!(@root Optimizer, $ty, $name, $desc, [], |o: $ty| $crate::abi::PluginInstance::Optimizer(
            $crate::abi::OptimizerPlugin_TO::from_value($crate::sdk::OptimizerAdapter(o), ::abi_stable::sabi_trait::TD_Opaque)
        ));
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_are_internal_and_errors_keep_their_kind() {
        let e = catch::<()>("create", || panic!("boom {}", 7)).unwrap_err();
        assert!(
            e.message
                .starts_with("create: panic in the plugin: boom 7 (at "),
            "{}",
            e.message
        );
        assert_eq!(e.kind, ErrorKind::Internal);
        let e = catch::<()>("step", || Err("bad lr".into())).unwrap_err();
        assert_eq!(e.message.as_str(), "step: bad lr");
        assert_eq!(e.kind, ErrorKind::Input);
        let e = catch::<()>("layer", || Err(Error::internal("lost a tensor"))).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Internal);
        assert_eq!(catch("x", || Ok(3)).into_result().unwrap(), 3);
    }

    #[test]
    fn a_failed_spec_says_its_kind() {
        let json = spec_to_json(|| -> serde_json::Value { panic!("no spec") });
        let v: serde_json::Value = serde_json::from_str(json.as_str()).unwrap();
        assert_eq!(v["kind"], "internal");
        let msg = v["error"].as_str().unwrap();
        assert!(
            msg.starts_with("spec: panic in the plugin: no spec"),
            "{msg}"
        );
    }

    #[test]
    fn args_merge_field_by_field() {
        let mut base =
            serde_json::json!({"betas": [0.9, 0.95], "eps": 1e-8, "nested": {"a": 1, "b": 2}});
        crate::sdk::merge_args(
            &mut base,
            serde_json::json!({"eps": 1e-6, "nested": {"b": 3}}),
        );
        assert_eq!(
            base,
            serde_json::json!({"betas": [0.9, 0.95], "eps": 1e-6, "nested": {"a": 1, "b": 3}})
        );
    }
}
