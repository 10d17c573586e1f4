//! The runner's per-stage parameter hook (what FSDP gathers block by block through): with a
//! hook that hands out fresh copies per stage, frees a block's copies when its forward ends and
//! refills them when the backward reaches it, a training forward and backward give the plain
//! forward's logits bit for bit and the same gradients, with and without recompute, on a dense
//! and a mixture-of-experts model.

mod common;

use anneal_engine::Tensor;
use anneal_runtime::hf;
use anneal_runtime::plugins::{
    find_for_model_type_in, ForwardOpts, Params, PluginModel, Stage, StageParams,
};
use common::{fixture, plugin_dir};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

fn model_for(dir: &std::path::Path) -> (PluginModel, HashMap<String, Tensor>) {
    let cfg = hf::read_config(dir).unwrap();
    let model_type = hf::model_type(dir, &cfg).unwrap();
    let loaded = find_for_model_type_in(&[plugin_dir().to_path_buf()], model_type).unwrap();
    let inst = loaded
        .create(None, &serde_json::json!({ "hf_config": cfg }))
        .unwrap();
    let model = PluginModel::new(loaded.name(), inst).unwrap();
    let params = hf::load_params(dir, model.spec()).unwrap();
    (model, params)
}

/// A copy of `t` with storage of its own (releasing it must not touch `t`).
fn copy(t: &Tensor) -> Tensor {
    Tensor::from_vec(t.to_vec_f32(), t.shape())
        .unwrap()
        .to_dtype(t.dtype())
        .unwrap()
}

/// What the hook saw, in order.
#[derive(Debug, PartialEq, Clone)]
enum Event {
    Params(Stage),
    AfterForward(Stage),
    BeforeBackward(usize),
}

/// Hands each stage fresh leaves of the values it needs, like FSDP's gathers.
struct Copies {
    values: HashMap<String, Tensor>,
    layer_of: HashMap<String, Option<usize>>,
    n_layers: usize,
    /// The outer parameters' leaves (one set for the whole forward and backward).
    outer: HashMap<String, Tensor>,
    /// Every set of leaves handed out, per block (a recompute adds one).
    blocks: Mutex<Vec<Vec<HashMap<String, Tensor>>>>,
    events: Mutex<Vec<Event>>,
}

impl Copies {
    fn new(model: &PluginModel, values: HashMap<String, Tensor>) -> Copies {
        let n_layers = model.spec().n_layers;
        let layer_of: HashMap<String, Option<usize>> = model
            .spec()
            .params
            .iter()
            .map(|p| (p.name.clone(), p.layer.filter(|&l| l < n_layers)))
            .collect();
        let outer = values
            .iter()
            .filter(|(n, _)| layer_of[*n].is_none())
            .map(|(n, t)| (n.clone(), t.detach().requires_grad_()))
            .collect();
        Copies {
            values,
            layer_of,
            n_layers,
            outer,
            blocks: Mutex::new(vec![Vec::new(); n_layers]),
            events: Mutex::new(Vec::new()),
        }
    }

    /// Each parameter's gradient, summed over every copy handed out.
    fn grads(&self) -> HashMap<String, Vec<f32>> {
        let mut out: HashMap<String, Vec<f32>> = HashMap::new();
        let blocks = self.blocks.lock().unwrap();
        let copies = std::iter::once(&self.outer).chain(blocks.iter().flatten());
        for (n, t) in copies.flat_map(|m| m.iter()) {
            if let Some(g) = t.grad() {
                let g = g.to_vec_f32();
                match out.get_mut(n) {
                    Some(acc) => acc.iter_mut().zip(g).for_each(|(a, b)| *a += b),
                    None => {
                        out.insert(n.clone(), g);
                    }
                }
            }
        }
        out
    }
}

impl StageParams for Copies {
    fn params(&self, stage: Stage) -> anneal_engine::Result<Params> {
        self.events.lock().unwrap().push(Event::Params(stage));
        let mut map = self.outer.clone();
        if let Stage::Layer(i) = stage {
            let fresh: HashMap<String, Tensor> = self
                .values
                .iter()
                .filter(|(n, _)| self.layer_of[*n] == Some(i))
                .map(|(n, t)| (n.clone(), copy(t).requires_grad_()))
                .collect();
            map.extend(fresh.clone());
            self.blocks.lock().unwrap()[i].push(fresh);
        }
        Ok(Arc::new(map))
    }

    fn after_forward(&self, stage: Stage) -> anneal_engine::Result<()> {
        self.events.lock().unwrap().push(Event::AfterForward(stage));
        if let Stage::Layer(i) = stage {
            for t in self.blocks.lock().unwrap()[i].last().unwrap().values() {
                t.release_storage();
            }
        }
        Ok(())
    }

    fn before_backward(&self, layer: usize) -> anneal_engine::Result<()> {
        self.events
            .lock()
            .unwrap()
            .push(Event::BeforeBackward(layer));
        assert!(layer < self.n_layers);
        for (n, t) in self.blocks.lock().unwrap()[layer].last().unwrap() {
            t.restore_storage(&self.values[n])?;
        }
        Ok(())
    }
}

/// Logits and gradients of `sum(logits · w) + aux losses` for one training forward.
fn run(model: &PluginModel, params: &Params, tokens: &Tensor, opts: &ForwardOpts) -> Vec<f32> {
    let t = tokens.shape()[1];
    let positions = Tensor::from_vec((0..t as i64).collect(), &[t]).unwrap();
    let out = model
        .forward_full(params, tokens, &positions, opts)
        .unwrap();
    let w = Tensor::rand_normal(
        out.logits.shape(),
        0.0,
        1.0,
        &anneal_engine::rng::RngKey::new(3, "w"),
        0,
        anneal_engine::DType::F32,
    )
    .unwrap();
    let mut loss = out.logits.mul(&w).unwrap().sum_all().unwrap();
    for (_, a) in &out.aux_losses {
        loss = loss.add(a).unwrap();
    }
    loss.backward().unwrap();
    out.logits.to_vec_f32()
}

#[test]
fn a_hook_that_frees_blocks_between_forward_and_backward_changes_nothing() {
    for name in ["tiny_llama", "tiny_qwen3_moe", "tiny_deepseek_v3"] {
        let dir = fixture(name);
        let (model, values) = model_for(&dir);
        let exp = anneal_engine::io::load_safetensors(dir.join("expected.safetensors")).unwrap();
        let tokens = &exp["tokens"];
        for recompute in [0usize, 1] {
            eprintln!("{name}, recompute every {recompute}");
            let plain: HashMap<String, Tensor> = values
                .iter()
                .map(|(n, t)| (n.clone(), t.detach().requires_grad_()))
                .collect();
            let plain = Arc::new(plain);
            let opts = ForwardOpts {
                training: true,
                recompute_every: recompute,
                ..Default::default()
            };
            let logits = run(&model, &plain, tokens, &opts);

            let copies = Arc::new(Copies::new(&model, values.clone()));
            let hooked = ForwardOpts {
                stage_params: Some(copies.clone()),
                ..opts.clone()
            };
            let empty: Params = Arc::new(HashMap::new());
            let logits2 = run(&model, &empty, tokens, &hooked);
            assert_eq!(logits, logits2, "{name} recompute {recompute}: logits");

            let grads = copies.grads();
            for (n, p) in plain.iter() {
                let (Some(g), Some(g2)) = (p.grad(), grads.get(n)) else {
                    assert!(p.grad().is_none() && !grads.contains_key(n), "{name}: {n}");
                    continue;
                };
                let g = g.to_vec_f32();
                let scale = g.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
                let d = g
                    .iter()
                    .zip(g2)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    d <= 1e-5 * scale,
                    "{name} recompute {recompute}: {n}: {d} of {scale}"
                );
            }

            // Every block was asked for once per run of its forward (twice when recomputed),
            // freed after it, and (when not recomputed) refilled once, last block first.
            let events = copies.events.lock().unwrap().clone();
            let n = model.spec().n_layers;
            for i in 0..n {
                let asked = events
                    .iter()
                    .filter(|e| **e == Event::Params(Stage::Layer(i)))
                    .count();
                assert_eq!(
                    asked,
                    1 + recompute,
                    "{name}: block {i} asked {asked} times"
                );
                assert!(events.contains(&Event::AfterForward(Stage::Layer(i))));
            }
            let refills: Vec<usize> = events
                .iter()
                .filter_map(|e| match e {
                    Event::BeforeBackward(i) => Some(*i),
                    _ => None,
                })
                .collect();
            let expected: Vec<usize> = if recompute == 1 {
                vec![]
            } else {
                (0..n).rev().collect()
            };
            assert_eq!(refills, expected, "{name} recompute {recompute}");
        }
    }
}
