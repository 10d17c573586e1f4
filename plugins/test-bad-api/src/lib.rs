//! A deliberately broken plugin for the loader's tests: it reports API version
//! `API_VERSION + 1`, and its `create` panics, so tests can see both reported cleanly.

use abi_stable::export_root_module;
use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::std_types::{ROption, RStr, RVec};
use anneal_plugin_api::abi::{
    PluginInfo, PluginInstance, PluginKind, PluginMod, PluginModRef, PluginResult,
};

extern "C" fn info() -> PluginInfo {
    PluginInfo {
        api_version: anneal_plugin_api::API_VERSION + 1,
        kind: PluginKind::Optimizer,
        name: "bad-api".into(),
        flavors: RVec::new(),
        description: "test plugin with a future API version".into(),
        model_types: RVec::new(),
    }
}

extern "C" fn create(_flavor: ROption<RStr<'_>>, _args: RStr<'_>) -> PluginResult<PluginInstance> {
    anneal_plugin_api::sdk::catch("create", || panic!("deliberate panic in create"))
}

/// The root module.
#[export_root_module]
pub fn anneal_plugin_root() -> PluginModRef {
    PluginMod { info, create }.leak_into_prefix()
}
