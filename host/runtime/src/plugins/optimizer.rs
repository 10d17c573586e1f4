//! Running an optimizer plugin over the host's parameters: the host owns parameters, gradients
//! and state; the plugin's `step` reaches them by name through a [`HostSession`].

use super::{HostSession, PluginError};
use abi_stable::std_types::{RSlice, RStr};
use anneal_engine::{DType, Tensor};
use anneal_plugin_api::abi::{OptimizerBox, PluginInstance};
use anneal_plugin_api::spec::{Init, OptimizerSpec};
use std::collections::{BTreeMap, HashMap};

/// An optimizer plugin instance with the state it keeps per parameter.
pub struct PluginOptimizer {
    name: String,
    inst: OptimizerBox,
    spec: OptimizerSpec,
    state: BTreeMap<String, Tensor>,
}

impl PluginOptimizer {
    /// Wraps an instance created by [`super::LoadedPlugin::create`].
    pub fn new(name: &str, inst: PluginInstance) -> Result<Self, PluginError> {
        let create_err = |msg: String| PluginError::Create {
            name: name.to_string(),
            msg,
        };
        let PluginInstance::Optimizer(inst) = inst else {
            return Err(create_err("is a model plugin, not an optimizer".into()));
        };
        let json = inst.spec_json();
        let spec: OptimizerSpec = serde_json::from_str(json.as_str())
            .map_err(|e| create_err(format!("bad optimizer spec: {e}")))?;
        Ok(PluginOptimizer {
            name: name.to_string(),
            inst,
            spec,
            state: BTreeMap::new(),
        })
    }

    /// What the plugin declared.
    pub fn spec(&self) -> &OptimizerSpec {
        &self.spec
    }

    /// State tensors by `"<param>.<state>"` (for checkpoints).
    pub fn state(&self) -> &BTreeMap<String, Tensor> {
        &self.state
    }

    /// Replaces the state (from a checkpoint), keyed like [`PluginOptimizer::state`]. Each
    /// entry must match the shape of its parameter in `params`, and every parameter needs every
    /// state the plugin declares, unless `state` is empty (a checkpoint before the first step).
    pub fn load_state(
        &mut self,
        params: &[(String, Tensor)],
        state: BTreeMap<String, Tensor>,
    ) -> Result<(), String> {
        if !state.is_empty() {
            for (pname, p) in params {
                for s in &self.spec.state {
                    let key = format!("{pname}.{}", s.name);
                    match state.get(&key) {
                        Some(t) if t.shape() == p.shape() => {}
                        Some(t) => {
                            return Err(format!(
                                "optimizer state {key} has shape {:?}, the parameter {:?}",
                                t.shape(),
                                p.shape()
                            ))
                        }
                        None => return Err(format!("optimizer state {key} is missing")),
                    }
                }
            }
        }
        self.state = state;
        Ok(())
    }

    /// State tensors by `"<param>.<state>"`, to replace single entries: under FSDP with an
    /// optimizer that steps full matrices, the caller keeps this rank's rows of each one.
    pub fn state_mut(&mut self) -> &mut BTreeMap<String, Tensor> {
        &mut self.state
    }

    /// Applies one update to every parameter that has a gradient. `step` counts from 1.
    pub fn step(
        &mut self,
        params: &[(String, Tensor)],
        step: u64,
        lr: f64,
    ) -> Result<(), PluginError> {
        let mut state = std::mem::take(&mut self.state);
        let done = self.step_with_state(params, &mut state, step, lr);
        self.state = state;
        done
    }

    /// [`PluginOptimizer::step`] with `state` (keyed like [`PluginOptimizer::state`]) in place
    /// of the optimizer's own: entries missing from it are created with the plugin's initial
    /// values. For a caller that assembles a parameter's full state from shards.
    pub fn step_with_state(
        &self,
        params: &[(String, Tensor)],
        state: &mut BTreeMap<String, Tensor>,
        step: u64,
        lr: f64,
    ) -> Result<(), PluginError> {
        let _phase = anneal_engine::profile::phase("optimizer");
        // One session and one plugin call for all parameters, so the plugin can fuse the
        // update into one host op.
        let mut named = HashMap::new();
        let mut names = Vec::new();
        for (pname, p) in params {
            let Some(grad) = p.grad() else { continue };
            named.insert(pname.clone(), p.detach());
            named.insert(format!("{pname}.grad"), grad);
            for s in &self.spec.state {
                let key = format!("{pname}.{}", s.name);
                if !state.contains_key(&key) {
                    let t = init_state(p, &s.init).map_err(|e| PluginError::Create {
                        name: self.name.clone(),
                        msg: format!("state {key}: {e}"),
                    })?;
                    state.insert(key.clone(), t);
                }
                named.insert(key.clone(), state[&key].clone());
            }
            names.push(RStr::from(pname.as_str()));
        }
        if names.is_empty() {
            return Ok(());
        }
        let session = HostSession::new(named);
        let vt = session.vtable();
        self.inst
            .step_all(&vt, RSlice::from(&names[..]), step, lr)
            .into_result()
            .map_err(|e| PluginError::of(&self.name, e))
    }
}

/// A parameter's new optimizer state, f32 of its shape on its device.
fn init_state(p: &Tensor, init: &Init) -> anneal_engine::Result<Tensor> {
    match init {
        Init::Ones => Tensor::ones(p.shape(), DType::F32).to_device(p.device()),
        // Optimizer state starts deterministic; random state inits are not used by any optimizer.
        _ => Tensor::zeros_on(p.shape(), DType::F32, p.device()),
    }
}
