//! Memory-budget activation checkpointing on a real model (its own test binary: it reads the
//! process-wide allocator counters): the plan measures every block, a budget of 1 recomputes
//! nothing and 0 everything, what a forward keeps shrinks with the budget, and gradients do
//! not change.

use anneal_engine::{alloc, DType, Tensor};
use anneal_runtime::hf;
use anneal_runtime::plugins::recompute::{plan_for_training, plan_memory_budget};
use anneal_runtime::plugins::{ForwardOpts, PluginModel};
use std::collections::HashMap;
use std::sync::Arc;
mod common;

use common::{fixture, plugin};

#[test]
fn the_budget_picks_blocks_and_bounds_what_a_forward_keeps() {
    let dir = fixture("tiny_llama");
    let cfg = hf::read_config(&dir).unwrap();
    let inst = plugin("llama")
        .create(None, &serde_json::json!({ "hf_config": cfg }))
        .unwrap();
    let model = PluginModel::new("llama", inst).unwrap();
    let params: HashMap<String, Tensor> = hf::load_params(&dir, model.spec())
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k, v.requires_grad_()))
        .collect();
    let params = Arc::new(params);
    let n = model.spec().n_layers;
    assert!(n >= 2, "the fixture needs blocks to choose between");
    let (batch, t) = (8, 64);
    let tokens = Tensor::from_vec(
        (0..(batch * t) as i64).map(|i| i % 50).collect(),
        &[batch, t],
    )
    .unwrap();
    let positions = Tensor::from_vec((0..t as i64).collect(), &[t]).unwrap();

    let plan =
        |budget: f64| plan_memory_budget(&model, &params, &tokens, &positions, budget).unwrap();
    let keep_all = plan(1.0);
    assert_eq!(keep_all.recompute, vec![false; n]);
    assert!(
        keep_all.block_bytes.iter().all(|&b| b > 0),
        "{:?}",
        keep_all.block_bytes
    );
    assert!(
        keep_all.block_flops.iter().all(|&f| f > 0),
        "{:?}",
        keep_all.block_flops
    );
    assert_eq!(keep_all.recompute_flops(), 0);
    let none = plan(0.0);
    assert_eq!(none.recompute, vec![true; n]);
    assert_eq!(none.kept_bytes(), 0);
    let half = plan(0.5);
    assert!(half.kept_bytes() as f64 <= 0.5 * half.total_bytes() as f64);
    assert!(half.recompute.iter().any(|&r| r) && half.recompute.iter().any(|&r| !r));
    assert!(half.summary().contains("budget 0.50"), "{}", half.summary());
    // bf16 activations take less room than f32 ones.
    let bf = plan_for_training(&model, &params, batch, t, Some(DType::BF16), 1.0).unwrap();
    assert!(
        bf.total_bytes() < keep_all.total_bytes(),
        "{} vs {}",
        bf.total_bytes(),
        keep_all.total_bytes()
    );

    // Bytes a training forward keeps, and the gradients, under each plan.
    let run = |recompute: Option<Vec<bool>>| {
        let leaves: HashMap<String, Tensor> = params
            .iter()
            .map(|(k, v)| (k.clone(), v.detach().requires_grad_()))
            .collect();
        let leaves = Arc::new(leaves);
        let opts = ForwardOpts {
            training: true,
            recompute_layers: recompute.map(Arc::new),
            ..Default::default()
        };
        let before = alloc::memory_stats().current_bytes;
        let logits = model.forward(&leaves, &tokens, &positions, &opts).unwrap();
        let kept = alloc::memory_stats().current_bytes - before;
        logits
            .mul(&logits)
            .unwrap()
            .mean_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut names: Vec<&String> = leaves.keys().collect();
        names.sort();
        let grads: Vec<Vec<f32>> = names
            .into_iter()
            .map(|k| leaves[k].grad().unwrap().to_vec_f32())
            .collect();
        (kept, grads)
    };
    let (kept_full, g_full) = run(None);
    let (kept_half, g_half) = run(Some(half.recompute.clone()));
    let (kept_none, g_none) = run(Some(none.recompute.clone()));
    assert!(
        kept_none < kept_half && kept_half < kept_full,
        "{kept_none} < {kept_half} < {kept_full}"
    );
    assert!(
        g_full == g_half && g_full == g_none,
        "recompute changes no gradient"
    );
}
