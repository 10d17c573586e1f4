//! The keys of the CPU fast paths: `training.dtype` (float32 or bfloat16) and the memory-budget
//! mode of `activation_checkpoint`, with their value checks.

use anneal_config::{resolve_with_env, RecomputeMode, Source};

fn resolve(set: &[&str]) -> Result<anneal_config::JobConfig, String> {
    let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    resolve_with_env(Source::Defaults, &set, &[]).map_err(|e| e.to_string())
}

#[test]
fn bf16_and_memory_budget_resolve_and_bad_values_name_the_key() {
    let c = resolve(&["training.dtype=\"bfloat16\""]).unwrap();
    assert_eq!(c.training.dtype, "bfloat16");
    let e = resolve(&["training.dtype=\"float16\""]).unwrap_err();
    assert!(
        e.contains("training.dtype") && e.contains("bfloat16"),
        "{e}"
    );

    let c = resolve(&[
        "activation_checkpoint.mode=\"budget\"",
        "activation_checkpoint.memory_budget=0.25",
    ])
    .unwrap();
    assert_eq!(c.activation_checkpoint.mode, RecomputeMode::Budget);
    assert_eq!(c.activation_checkpoint.memory_budget, 0.25);
    for bad in ["1.5", "-0.1"] {
        let e = resolve(&[
            "activation_checkpoint.mode=\"budget\"",
            &format!("activation_checkpoint.memory_budget={bad}"),
        ])
        .unwrap_err();
        assert!(e.contains("activation_checkpoint.memory_budget"), "{e}");
    }
}
