//! Adapters from the SDK traits to the boundary's trait objects, with panics caught, and the
//! `export_plugin!` macro that writes a plugin's root module.

use super::{Ctx, Error, Host, Model, Optimizer, Result};
use crate::abi::{ForwardCtx, Handle, HostVTable, ModelPlugin, OptimizerPlugin};
use abi_stable::std_types::{RErr, ROk, RResult, RSlice, RStr, RString, RVec};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs plugin code so that neither an error nor a panic crosses the boundary as anything but
/// an error message.
pub fn catch<T>(what: &str, f: impl FnOnce() -> Result<T>) -> RResult<T, RString> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => ROk(v),
        Ok(Err(Error(e))) => RErr(format!("{what}: {e}").into()),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            RErr(format!("{what}: plugin panicked: {msg}").into())
        }
    }
}

/// A spec as JSON, or `{"error": ...}` if building it failed or panicked.
fn spec_to_json<S: serde::Serialize>(spec: impl FnOnce() -> S) -> RString {
    match catch("spec", || {
        serde_json::to_string(&spec()).map_err(Error::from)
    }) {
        ROk(s) => s.into(),
        RErr(e) => serde_json::json!({ "error": e.as_str() })
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
    ) -> RResult<RVec<Handle>, RString> {
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
    ) -> RResult<RVec<Handle>, RString> {
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
    ) -> RResult<Handle, RString> {
        catch("head", || {
            let h = Host::new(host);
            let hidden = hidden.into_iter().map(|x| h.adopt(x)).collect();
            Ok(self.0.head(&make_ctx(h, ctx), hidden)?.into_handle())
        })
    }

    fn before_optimizer_step(&self, host: &HostVTable, step: u64) -> RResult<(), RString> {
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

    fn step(&self, host: &HostVTable, name: RStr<'_>, step: u64, lr: f64) -> RResult<(), RString> {
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
    ) -> RResult<(), RString> {
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
            ) -> ::abi_stable::std_types::RResult<$crate::abi::PluginInstance, ::abi_stable::std_types::RString> {
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
    fn panics_and_errors_become_messages() {
        let r: RResult<(), RString> = catch("create", || panic!("boom {}", 7));
        assert_eq!(
            r.into_result().unwrap_err().as_str(),
            "create: plugin panicked: boom 7"
        );
        let r: RResult<(), RString> = catch("step", || Err(Error("bad lr".into())));
        assert_eq!(r.into_result().unwrap_err().as_str(), "step: bad lr");
        assert_eq!(catch("x", || Ok(3)).into_result().unwrap(), 3);
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
