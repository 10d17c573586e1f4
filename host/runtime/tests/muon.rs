//! The Muon plugin against its PyTorch reference (plugins/muon/tests/reference/
//! muon_reference.py, which writes the fixture): a wide and a tall matrix and a stack of expert
//! matrices (Muon), a vector and an excluded embedding and router (AdamW), several steps, five
//! argument sets, Newton–Schulz in f32 (within 2e-6) and in bf16 (within 1e-3).

mod common;

use anneal_engine::Tensor;
use anneal_runtime::plugins::PluginOptimizer;
use common::plugin;
use serde_json::Value;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("a list of numbers")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

#[test]
fn muon_steps_match_the_pytorch_reference() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../plugins/muon/tests/fixtures/muon_steps.json");
    let text = std::fs::read_to_string(&path).expect("fixture (run muon_reference.py)");
    let fixture: Value = serde_json::from_str(&text).expect("fixture JSON");
    for (ci, case) in fixture["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .enumerate()
    {
        let inst = plugin("muon").create(None, &case["args"]).expect("create");
        // f32 on both sides differs only in the order of the sums; in bf16 a product's
        // rounding may land one bf16 step apart, which the small learning rate scales down.
        let tol = if case["args"]["ns_dtype"] == "bfloat16" {
            1e-3
        } else {
            2e-6
        };
        let mut opt = PluginOptimizer::new("muon", inst).expect("an optimizer");
        assert!(opt.spec().needs_full_matrix);
        let shapes = case["shapes"].as_object().expect("shapes");
        let named: Vec<(String, Tensor)> = shapes
            .iter()
            .map(|(n, s)| {
                let shape: Vec<usize> = s
                    .as_array()
                    .expect("shape")
                    .iter()
                    .map(|d| d.as_u64().expect("dim") as usize)
                    .collect();
                let p = Tensor::from_vec(floats(&case["init"][n]), &shape)
                    .expect("init")
                    .requires_grad_();
                (n.clone(), p)
            })
            .collect();
        for (t, step) in case["steps"].as_array().expect("steps").iter().enumerate() {
            for (n, p) in &named {
                let g = Tensor::from_vec(floats(&step["grads"][n]), p.shape()).expect("grad");
                p.set_grad(Some(g)).expect("set grad");
            }
            let lr = step["lr"].as_f64().expect("lr");
            opt.step(&named, t as u64 + 1, lr).expect("step");
            for (n, p) in &named {
                let want = floats(&step["params"][n]);
                let worst = p
                    .to_vec_f32()
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(worst < tol, "case {ci} step {} {n}: off by {worst}", t + 1);
            }
        }
    }
}
