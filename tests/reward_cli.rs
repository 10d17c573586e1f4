//! `anneal reward test` end to end: scores the shared cases with the WAT example and reports
//! user errors as one line with exit code 2.

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn reward_wasm() -> PathBuf {
    anneal_tests::cli::root().join("reward-wasm")
}

fn anneal() -> Command {
    Command::new(anneal_tests::cli::anneal_bin())
}

/// `anneal reward test MODULE ARGS..` with `input` on standard input.
fn reward_test(module: &Path, args: &[&str], input: &[u8]) -> std::process::Output {
    let mut child = anneal()
        .args(["reward", "test"])
        .arg(module)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run anneal");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("write stdin");
    child.wait_with_output().expect("wait")
}

#[test]
fn scores_the_shared_cases_one_json_line_each() {
    let root = reward_wasm();
    let out = anneal()
        .args(["reward", "test"])
        .arg(root.join("examples/wat/reward.wat"))
        .arg("--input")
        .arg(root.join("cases.jsonl"))
        .output()
        .expect("run anneal");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cases = std::fs::read_to_string(root.join("cases.jsonl")).expect("cases");
    let lines: Vec<&str> = std::str::from_utf8(&out.stdout)
        .expect("utf-8")
        .lines()
        .collect();
    assert_eq!(lines.len(), cases.lines().count());
    for (line, case) in lines.iter().zip(cases.lines()) {
        let got: Value = serde_json::from_str(line).expect("json line");
        let case: Value = serde_json::from_str(case).expect("case");
        assert_eq!(got["score"], case["expected"]["score"], "{line}");
        assert_eq!(
            got["details"]["correct"], case["expected"]["correct"],
            "{line}"
        );
        assert!(got["fuel"].as_u64().is_some_and(|f| f > 0), "{line}");
        assert!(got["micros"].as_u64().is_some(), "{line}");
    }
}

#[test]
fn errors_are_reported_per_line_with_their_kind() {
    let dir = std::env::temp_dir().join(format!("anneal-reward-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let spin = dir.join("spin.wat");
    std::fs::write(
        &spin,
        r#"(module (memory (export "memory") 1)
          (func (export "alloc") (param i32) (result i32) (i32.const 0))
          (func (export "score") (param i32 i32 i32 i32 i32 i32) (result f64)
            (loop (br 0)) (f64.const 0)))"#,
    )
    .expect("write module");
    let out = reward_test(
        &spin,
        &["--fuel", "10000", "--error-reward", "-1"],
        b"{\"prompt\":\"p\",\"completion\":\"c\",\"metadata\":{}}\n",
    );
    assert!(out.status.success());
    let got: Value = serde_json::from_slice(&out.stdout).expect("json line");
    assert_eq!(got["error"], "fuel_exhausted");
    assert_eq!(got["reward"], -1.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn user_errors_exit_2_with_one_line() {
    let out = anneal()
        .args(["reward", "test", "/no/such/module.wasm"])
        .stdin(Stdio::null())
        .output()
        .expect("run anneal");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("/no/such/module.wasm"), "{stderr}");

    let out = reward_test(
        &reward_wasm().join("examples/wat/reward.wat"),
        &[],
        b"not json\n",
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 1"), "{stderr}");
}

/// Scores `(completion, answer)` pairs with one of the RL demo's `.wat` rewards.
fn demo_scores(module: &str, cases: &[(&str, &str)]) -> Vec<Value> {
    let input: String = cases
        .iter()
        .map(|(c, a)| {
            serde_json::json!({"prompt": "2118=", "completion": c, "metadata": {"answer": a}})
                .to_string()
                + "\n"
        })
        .collect();
    let out = reward_test(
        &reward_wasm().join(format!("examples/{module}/reward.wat")),
        &[],
        input.as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::str::from_utf8(&out.stdout)
        .expect("utf-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

#[test]
fn the_rl_demo_rewards_score_exact_and_partial_matches() {
    let cases = [
        ("1128", "1128"),
        (" 1128\n", "1128"),
        ("1288", "1128"),
        ("12", "1128"),
        ("112899", "1128"),
        ("", "1128"),
    ];
    let exact = demo_scores("exact_match", &cases);
    let want_exact = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
    for (got, want) in exact.iter().zip(want_exact) {
        assert_eq!(got["score"].as_f64(), Some(want), "{got}");
        assert_eq!(
            got["details"]["correct"].as_bool(),
            Some(want == 1.0),
            "{got}"
        );
    }
    // Matching positions over the longer of answer and (trimmed) completion.
    let partial = demo_scores("position_match", &cases);
    let want_partial = [1.0, 1.0, 0.5, 0.25, 4.0 / 6.0, 0.0];
    for (got, want) in partial.iter().zip(want_partial) {
        let score = got["score"].as_f64().expect("a score");
        assert!((score - want).abs() < 1e-12, "{got} vs {want}");
        assert!(got["details"].get("correct").is_none(), "{got}");
    }
}

#[test]
fn a_module_over_the_size_limit_is_refused_before_it_is_read() {
    // 200 MB that take no disk (a sparse file): refused from its size, naming file and limit.
    let dir = std::env::temp_dir().join(format!("anneal-reward-big-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let big = dir.join("big.wasm");
    std::fs::File::create(&big)
        .and_then(|f| f.set_len(200 << 20))
        .expect("sparse file");
    let out = anneal()
        .args(["reward", "test"])
        .arg(&big)
        .stdin(Stdio::null())
        .output()
        .expect("run anneal");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&*big.to_string_lossy())
            && stderr.contains("209715200 bytes")
            && stderr.contains("over the limit of 67108864 bytes (64 MiB)"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}
