//! RL runs through `anneal serve`, end to end: a real server, real `anneal train` and `anneal rl`
//! children on the tiny Llama, reward modules uploaded over HTTP. An RL config is recognized by
//! its `[rl]` section, validated with the picked modules loaded as the run will load them,
//! started as `anneal rl` from a training run's checkpoint, and resumed as one; its metrics,
//! latest values and samples (with filters and pages) come back over the API; several modules
//! score inputs combined by the RL rule.

use anneal_tests::serve as serve_common;

use serde_json::{json, Value};
use serve_common::{add_rl_config, temp_home, tiny_configs, Server, LENGTH_PARITY_WAT};
use std::time::Duration;

const MINUTES: Duration = Duration::from_secs(180);

fn upload(server: &Server, name: &str, bytes: &[u8]) -> i64 {
    let (code, body) = server.raw(
        "POST",
        &format!("/api/rewards?name={name}"),
        Some(bytes),
        "application/octet-stream",
    );
    let body: Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(code, 201, "{body}");
    body["id"].as_i64().expect("an id")
}

fn samples(server: &Server, id: i64, query: &str) -> Value {
    let (code, page) = server.get(&format!("/api/runs/{id}/samples?{query}"));
    assert_eq!(code, 200, "{page}");
    page
}

fn list(page: &Value) -> Vec<Value> {
    page["samples"].as_array().cloned().unwrap_or_default()
}

#[test]
fn rl_runs_start_from_configs_with_uploaded_rewards_and_serve_their_samples() {
    let home = temp_home("rl");
    let configs = tiny_configs(&home);
    add_rl_config(&configs);
    let server = Server::start(&home, &["--configs", configs.to_str().expect("utf-8")]);
    let root = serve_common::repo();
    let position = std::fs::read(root.join("reward-wasm/examples/position_match/reward.wat"))
        .expect("position_match example");
    let position_id = upload(&server, "position_match.wat", &position);
    let parity_id = upload(&server, "length_parity.wat", LENGTH_PARITY_WAT.as_bytes());

    // A short training run: its checkpoint starts the policy.
    let (code, body) = server.post(
        "/api/runs",
        &json!({ "name": "warm-start", "config_path": "configs/tiny.toml" }),
    );
    assert_eq!(code, 201, "{body}");
    assert_eq!(body["run"]["kind"], "train");
    let train_id = body["id"].as_i64().expect("id");
    server.wait_status(train_id, &["completed"], MINUTES);
    let (_, ckpts) = server.get(&format!("/api/runs/{train_id}/checkpoints"));
    let newest = ckpts
        .as_array()
        .and_then(|c| c.last())
        .expect("a checkpoint");
    let (_, train_run) = server.get(&format!("/api/runs/{train_id}"));
    let init_from = format!(
        "rl.init_from=\"{}/checkpoints/{}\"",
        train_run["run_dir"].as_str().expect("run dir"),
        newest["name"].as_str().expect("name")
    );

    // The [rl] section makes it an RL job, which needs reward modules.
    let (code, err) = server.post(
        "/api/configs/validate",
        &json!({ "config_path": "configs/rl_tiny.toml", "overrides": [init_from] }),
    );
    assert_eq!(code, 422, "{err}");
    assert_eq!(err["errors"][0]["key_path"], "rl.rewards", "{err}");
    let (code, err) = server.post(
        "/api/configs/validate",
        &json!({ "config_path": "configs/rl_tiny.toml", "rewards": [{ "id": 999 }] }),
    );
    assert_eq!(code, 422, "{err}");
    assert!(
        err["error"].as_str().is_some_and(|e| e.contains("999")),
        "{err}"
    );
    // A module that loads but lacks the reward ABI is refused, by position.
    let no_abi = home.join("no_score.wat");
    std::fs::write(&no_abi, r#"(module (memory (export "memory") 1))"#).expect("write");
    let (code, err) = server.post(
        "/api/configs/validate",
        &json!({
            "config_path": "configs/rl_tiny.toml",
            "overrides": [format!("rl.rewards=[{{ path = {} }}]", json!(no_abi))],
            "rewards": [],
        }),
    );
    assert_eq!(code, 422, "{err}");
    assert_eq!(err["errors"][0]["key_path"], "rl.rewards[0].path", "{err}");
    assert!(
        err["error"]
            .as_str()
            .is_some_and(|e| e.contains("reward ABI")),
        "{err}"
    );

    let picks = json!([{ "id": position_id, "weight": 1.0 }, { "id": parity_id, "weight": 0.5 }]);
    let (code, ok) = server.post(
        "/api/configs/validate",
        &json!({ "config_path": "configs/rl_tiny.toml", "overrides": [init_from], "rewards": picks }),
    );
    assert_eq!(code, 200, "{ok}");
    assert_eq!(ok["kind"], "rl");
    let resolved = ok["resolved"].as_str().expect("toml");
    assert!(
        resolved.contains("name = \"length_parity.wat\""),
        "{resolved}"
    );
    assert!(resolved.contains("weight = 0.5"), "{resolved}");
    // The training config stays a training job.
    let (_, ok) = server.post(
        "/api/configs/validate",
        &json!({ "config_path": "configs/tiny.toml" }),
    );
    assert_eq!(ok["kind"], "train");

    let (code, body) = server.post(
        "/api/runs",
        &json!({ "name": "rl", "config_path": "configs/rl_tiny.toml", "overrides": [init_from], "rewards": picks }),
    );
    assert_eq!(code, 201, "{body}");
    assert_eq!(body["run"]["kind"], "rl");
    let overrides = body["run"]["overrides"]
        .as_array()
        .expect("overrides")
        .clone();
    assert_eq!(overrides.len(), 2, "init_from, then the picked modules");
    assert!(overrides[1]
        .as_str()
        .is_some_and(|o| o.starts_with("rl.rewards=")));
    let id = body["id"].as_i64().expect("id");
    let run = server.wait_status(id, &["completed"], MINUTES);
    assert_eq!(run["latest"]["step"], 6, "{run}");
    assert!(run["latest"]["reward_mean"].is_number(), "{run}");
    assert!(run["latest"]["eval_accuracy"].is_number(), "{run}");
    let (_, logs) = server.get(&format!("/api/runs/{id}/logs?tail=1000"));
    let log = logs["lines"].as_array().expect("lines");
    assert!(
        log.iter()
            .any(|l| l.as_str().is_some_and(|l| l.contains("start: anneal rl "))),
        "the supervisor starts `anneal rl`: {logs}"
    );

    // Metrics: the RL row set, step 0 holding the accuracy before training.
    let (_, rows) = server.get(&format!("/api/runs/{id}/metrics"));
    let rows = rows.as_array().expect("rows").clone();
    let steps: Vec<u64> = rows.iter().filter_map(|r| r["step"].as_u64()).collect();
    assert_eq!(steps, [0, 1, 2, 3, 4, 5, 6]);
    assert!(rows[0]["eval_accuracy"].is_number());
    for key in [
        "reward_mean",
        "reward_std",
        "entropy",
        "logprob_mismatch_max",
        "staleness_mean",
        "t_rollout",
        "t_reward",
        "t_train",
        "response_len_mean",
    ] {
        assert!(rows[6][key].is_number(), "{key} in {}", rows[6]);
    }

    // Samples: all 8 of each of the 6 steps, newest first, each module's part included.
    let all = samples(&server, id, "limit=500");
    assert_eq!(all["total"], 48, "{all}");
    assert_eq!(all["steps"], json!([1, 2, 3, 4, 5, 6]));
    let every = list(&all);
    assert_eq!(every[0]["step"], 6);
    assert_eq!(every[47]["step"], 1);
    for s in &every {
        let names: Vec<&str> = s["scores"]
            .as_array()
            .expect("scores")
            .iter()
            .filter_map(|m| m["name"].as_str())
            .collect();
        assert_eq!(names, ["position_match.wat", "length_parity.wat"], "{s}");
        let len = s["completion"].as_str().expect("completion").len();
        let parity = &s["scores"][1];
        let position = s["scores"][0]["score"].as_f64().expect("position score");
        if len % 2 == 1 {
            assert_eq!(parity["error"], "trap", "{s}");
            assert_eq!(s["reward"].as_f64(), Some(position - 0.5), "{s}");
            assert_eq!(
                s["correct"],
                Value::Null,
                "a failed call does not vote: {s}"
            );
        } else {
            assert_eq!(parity["error"], Value::Null, "{s}");
            assert_eq!(s["correct"], json!(len % 4 == 0), "{s}");
        }
    }
    let erroring_total = every
        .iter()
        .filter(|s| !s["scores"][1]["error"].is_null())
        .count();
    let counted_errors: u64 = rows
        .iter()
        .filter_map(|r| r["reward_errors"].as_u64())
        .sum();
    assert_eq!(
        erroring_total as u64, counted_errors,
        "the samples agree with the metrics"
    );
    assert!(
        erroring_total > 0 && erroring_total < 48,
        "the policy's completions mix lengths ({erroring_total} of 48 odd)"
    );

    // Filters: erroring, failed (not correct, or below the threshold), a step, and their counts.
    let erroring = samples(&server, id, "erroring=true&limit=500");
    assert_eq!(erroring["total"], erroring_total);
    assert_eq!(erroring["counts"]["erroring"], erroring_total);
    assert!(list(&erroring)
        .iter()
        .all(|s| s["scores"][1]["error"] == "trap"));
    let failed = samples(&server, id, "failed=true&limit=500");
    assert!(list(&failed).iter().all(|s| s["correct"] == false));
    let wrong = every.iter().filter(|s| s["correct"] == false).count();
    assert_eq!(failed["total"], wrong);
    let below = samples(&server, id, "failed=true&threshold=0.25&limit=500");
    let want = every
        .iter()
        .filter(|s| s["correct"] == false || s["reward"].as_f64().is_some_and(|r| r < 0.25))
        .count();
    assert_eq!(below["total"], want);
    assert!(want > wrong, "the trapping samples fall below 0.25");
    let both = samples(
        &server,
        id,
        "failed=true&threshold=0.25&erroring=true&limit=500",
    );
    assert!(list(&both)
        .iter()
        .all(|s| !s["scores"][1]["error"].is_null()));
    let step3 = samples(&server, id, "step=3");
    assert_eq!(step3["total"], 8);
    assert!(list(&step3).iter().all(|s| s["step"] == 3));
    let page = samples(&server, id, "offset=10&limit=5");
    assert_eq!(
        list(&page),
        every[10..15].to_vec(),
        "pages follow the same order"
    );
    assert_eq!(page["limit"], 5);
    let (code, _) = server.get(&format!("/api/runs/{train_id}/samples"));
    assert_eq!(code, 200, "a training run simply has no samples");
    assert_eq!(samples(&server, train_id, "")["total"], 0);

    // Several modules combined by the RL rule, on inputs given here.
    let (code, scored) = server.post(
        "/api/rewards/score",
        &json!({
            "rewards": picks,
            "error_reward": -1.0,
            "inputs": [
                { "prompt": "4213=", "completion": "1234", "metadata": { "answer": "1234" } },
                { "prompt": "4213=", "completion": "124", "metadata": { "answer": "1234" } },
            ],
        }),
    );
    assert_eq!(code, 200, "{scored}");
    let r0 = &scored["results"][0];
    assert!(
        (r0["reward"].as_f64().expect("reward") - 1.2).abs() < 1e-12,
        "{r0}"
    );
    assert_eq!(r0["correct"], true);
    let r1 = &scored["results"][1];
    assert_eq!(r1["modules"][1]["error"], "trap", "{r1}");
    assert_eq!(r1["correct"], Value::Null);
    assert_eq!(r1["reward"].as_f64(), Some(0.5 - 0.5), "{r1}");
    let (code, _) = server.post(
        "/api/rewards/score",
        &json!({ "rewards": [], "inputs": [{ "prompt": "p", "completion": "c" }] }),
    );
    assert_eq!(code, 400);

    // A completed run trained all its steps: a resume is refused, saying why.
    let (code, err) = server.post(&format!("/api/runs/{id}/resume"), &json!({}));
    assert_eq!(code, 409, "{err}");
    assert!(
        err["error"]
            .as_str()
            .is_some_and(|e| e.contains("completed")),
        "{err}"
    );
    assert_eq!(
        server.get(&format!("/api/runs/{id}")).1["status"],
        "completed"
    );
    assert_eq!(samples(&server, id, "")["total"], 48);

    // A stopped RL run resumes as an RL run, keeping its samples.
    let (code, body) = server.post(
        "/api/runs",
        &json!({
            "name": "rl-long", "config_path": "configs/rl_tiny.toml",
            "overrides": [init_from, "training.steps=1000000"], "rewards": picks,
        }),
    );
    assert_eq!(code, 201, "{body}");
    let long = body["id"].as_i64().expect("id");
    server.wait_rows(long, 3, MINUTES);
    let (code, _) = server.post(&format!("/api/runs/{long}/stop"), &json!({}));
    assert_eq!(code, 202);
    let run = server.wait_status(long, &["stopped", "failed", "completed"], MINUTES);
    assert_eq!(run["status"], "stopped", "{run}");
    let kept = samples(&server, long, "")["total"].as_u64().expect("total");
    assert!(kept > 0);
    let rows = server.wait_rows(long, 1, MINUTES).len();
    let (code, _) = server.post(&format!("/api/runs/{long}/resume"), &json!({}));
    assert_eq!(code, 202);
    server.wait_rows(long, rows + 2, MINUTES);
    let (_, logs) = server.get(&format!("/api/runs/{long}/logs?tail=1000"));
    let starts: Vec<&str> = logs["lines"]
        .as_array()
        .expect("lines")
        .iter()
        .filter_map(Value::as_str)
        .filter(|l| l.contains("[anneal serve] start:"))
        .collect();
    assert_eq!(starts.len(), 2, "{logs}");
    assert!(
        starts.iter().all(|l| l.contains("start: anneal rl ")),
        "{starts:?}"
    );
    assert!(
        samples(&server, long, "")["total"].as_u64() >= Some(kept),
        "the resume kept the samples"
    );
    let (code, _) = server.post(&format!("/api/runs/{long}/stop"), &json!({}));
    assert_eq!(code, 202);
    server.wait_status(long, &["stopped", "failed"], MINUTES);
}
