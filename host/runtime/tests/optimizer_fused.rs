//! The AdamW plugin updates every parameter with one fused host op per step (its own test
//! binary: the op profiler that counts the ops is process-wide), and optimizers that only
//! implement the per-parameter `step` still get every parameter updated.

use anneal_engine::profile::{self, Window};
use anneal_engine::Tensor;
mod common;

use anneal_runtime::plugins::PluginOptimizer;
use common::plugin;

fn params() -> Vec<(String, Tensor)> {
    (0..5)
        .map(|i| {
            let n = 3 + 1000 * i;
            let p = Tensor::from_vec((0..n).map(|j| j as f32 * 1e-3).collect(), &[n])
                .unwrap()
                .requires_grad_();
            p.set_grad(Some(Tensor::ones(&[n], anneal_engine::DType::F32)))
                .unwrap();
            (format!("w{i}"), p)
        })
        .collect()
}

#[test]
fn adamw_is_one_fused_op_per_step_and_sgd_updates_every_parameter() {
    let mut adamw = PluginOptimizer::new(
        "adamw",
        plugin("adamw")
            .create(None, &serde_json::json!({}))
            .unwrap(),
    )
    .unwrap();
    let named = params();
    let before: Vec<Vec<f32>> = named.iter().map(|(_, p)| p.to_vec_f32()).collect();
    profile::configure(Window { skip: 0, steps: 1 });
    {
        let _s = profile::step(1);
        adamw.step(&named, 1, 1e-2).unwrap();
    }
    let p = profile::finish().unwrap();
    let ops: Vec<_> = p
        .rows()
        .into_iter()
        .filter(|r| r.phase == "optimizer" && !r.name.starts_with('('))
        .collect();
    assert_eq!(ops.len(), 1, "one kind of op: {ops:?}");
    assert_eq!((ops[0].name.as_str(), ops[0].calls), ("adamw", 1.0));
    for ((_, p), b) in named.iter().zip(&before) {
        assert_ne!(&p.to_vec_f32(), b, "every parameter moved");
    }
    assert_eq!(adamw.state().len(), 2 * named.len());

    let mut sgd = PluginOptimizer::new(
        "sgd",
        plugin("sgd").create(None, &serde_json::json!({})).unwrap(),
    )
    .unwrap();
    let named = params();
    sgd.step(&named, 1, 0.5).unwrap();
    for (_, p) in &named {
        let v = p.to_vec_f32();
        assert_eq!(v[0], -0.5, "p - lr * g with g = 1");
        assert_eq!(v[2], 2e-3 - 0.5);
    }
}
