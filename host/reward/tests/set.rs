//! A reward set of real modules: the RL demo's exact match (reports `correct`) and position match
//! (partial credit, no details), plus a module that traps, combined by weight.

use anneal_reward::{ErrorKind, MemberSpec, RewardSet, Sandbox, SandboxConfig, ScoreInput};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../../reward-wasm/examples/{name}/reward.wat"))
}

fn input(completion: &str) -> ScoreInput {
    ScoreInput {
        prompt: "4213=".into(),
        completion: completion.into(),
        metadata: json!({"answer": "1234"}),
    }
}

#[test]
fn a_set_of_real_modules_sums_by_weight_and_reports_each_module() {
    let dir = std::env::temp_dir().join(format!("anneal-reward-set-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let trap = dir.join("trap.wat");
    std::fs::write(
        &trap,
        r#"(module (memory (export "memory") 1)
             (func (export "alloc") (param i32) (result i32) (i32.const 1024))
             (func (export "score") (param i32 i32 i32 i32 i32 i32) (result f64) unreachable))"#,
    )
    .expect("write");
    let sandbox = Arc::new(Sandbox::new(SandboxConfig::default()).expect("sandbox"));
    let spec = |path: PathBuf, name: &str, weight: f64| MemberSpec {
        path,
        name: name.into(),
        weight,
    };
    let set = RewardSet::load(
        sandbox.clone(),
        &[
            spec(example("exact_match"), "", 1.0),
            spec(example("position_match"), "positions", 0.5),
        ],
        -1.0,
    )
    .expect("load");
    assert_eq!(set.names().collect::<Vec<_>>(), ["reward.wat", "positions"]);

    let right = set.score(&input("1234"));
    assert_eq!(right.reward, 1.5);
    assert_eq!(right.correct, Some(true));
    let half = set.score(&input("1243"));
    assert_eq!(
        half.reward, 0.25,
        "position match gives 2 of 4 at weight 0.5"
    );
    assert_eq!(half.correct, Some(false));
    assert_eq!(half.modules[0].correct, Some(false));
    assert_eq!(half.modules[1].correct, None);
    assert_eq!(half.modules[1].result, Ok(0.5));

    let with_trap = RewardSet::load(
        sandbox,
        &[
            spec(example("exact_match"), "exact", 1.0),
            spec(trap, "trap", 2.0),
        ],
        -1.0,
    )
    .expect("load");
    let c = with_trap.score(&input("1234"));
    assert_eq!(c.reward, 1.0 - 2.0, "the trap counts as the error reward");
    assert_eq!(c.correct, Some(true), "a failed call does not vote");
    assert_eq!(c.modules[1].error_kind(), Some(ErrorKind::Trap));
    assert_eq!(c.errors().count(), 1);
}

#[test]
fn a_module_without_the_abi_is_refused_by_position() {
    let dir = std::env::temp_dir().join(format!("anneal-reward-set-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bad = dir.join("no_score.wat");
    std::fs::write(&bad, r#"(module (memory (export "memory") 1))"#).expect("write");
    let sandbox = Arc::new(Sandbox::new(SandboxConfig::default()).expect("sandbox"));
    let e = RewardSet::load(
        sandbox,
        &[
            MemberSpec {
                path: example("exact_match"),
                name: String::new(),
                weight: 1.0,
            },
            MemberSpec {
                path: bad,
                name: String::new(),
                weight: 1.0,
            },
        ],
        0.0,
    )
    .expect_err("no score export");
    assert_eq!(e.index(), Some(1));
    assert!(e.to_string().contains("reward ABI"), "{e}");
}
