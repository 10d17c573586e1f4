//! `anneal serve` end to end: a real server on a random loopback port, a real SQLite registry in
//! a temporary home, and real `anneal train` children training a tiny Llama. Covers the JSON API
//! (runs, configs, metrics, events, logs, checkpoints, plugins, rewards), bad input, the token,
//! and a server killed and restarted while a run is active.

use anneal_tests::serve as serve_common;

use serde_json::{json, Value};
use serve_common::{alive, kill, temp_home, tiny_configs, Server};
use std::time::Duration;

const MINUTE: Duration = Duration::from_secs(60);

fn start(name: &str, extra: &[&str]) -> Server {
    let home = temp_home(name);
    let configs = tiny_configs(&home);
    let mut args = vec!["--configs", configs.to_str().expect("utf-8 path")];
    args.extend_from_slice(extra);
    Server::start(&home, &args)
}

fn create(server: &Server, name: &str, overrides: &[&str]) -> i64 {
    let (code, body) = server.post(
        "/api/runs",
        &json!({ "name": name, "config_path": "configs/tiny.toml", "overrides": overrides }),
    );
    assert_eq!(code, 201, "{body}");
    body["id"].as_i64().expect("an id")
}

#[test]
fn health_configs_and_validation() {
    let server = start("configs", &[]);
    let (code, health) = server.get("/api/health");
    assert_eq!(code, 200);
    assert_eq!(health["status"], "ok");
    assert!(health["version"].is_string());

    let (code, configs) = server.get("/api/configs");
    assert_eq!(code, 200);
    assert_eq!(
        configs,
        json!([{ "name": "tiny.toml", "path": "configs/tiny.toml" }])
    );
    let (code, file) = server.get("/api/configs/tiny.toml");
    assert_eq!(code, 200);
    assert!(file["text"]
        .as_str()
        .is_some_and(|t| t.contains("[training]")));

    // A valid config resolves to the full TOML, overrides applied.
    let (code, ok) = server.post(
        "/api/configs/validate",
        &json!({ "config_path": "configs/tiny.toml", "overrides": ["training.steps=11"] }),
    );
    assert_eq!(code, 200, "{ok}");
    assert!(ok["resolved"]
        .as_str()
        .is_some_and(|t| t.contains("steps = 11")));

    // Bad values and unknown keys: 422 naming the key path.
    for (overrides, key) in [
        (json!(["training.steps=\"many\""]), "training.steps"),
        (json!(["training.stepz=3"]), "training.stepz"),
    ] {
        let (code, err) = server.post(
            "/api/configs/validate",
            &json!({ "config_path": "configs/tiny.toml", "overrides": overrides }),
        );
        assert_eq!(code, 422, "{err}");
        assert_eq!(err["errors"][0]["key_path"], key, "{err}");
        assert!(
            err["error"].as_str().is_some_and(|e| e.contains(key)),
            "{err}"
        );
    }
    let (code, err) = server.post(
        "/api/configs/validate",
        &json!({ "config": "[training]\nsteps = -1\n" }),
    );
    assert_eq!(code, 422, "{err}");
    assert_eq!(err["errors"][0]["key_path"], "training.steps", "{err}");
    let (code, err) = server.post("/api/configs/validate", &json!({ "config": "[training" }));
    assert_eq!(code, 422, "{err}");

    // Creating a run with an invalid config is refused the same way; nothing is recorded.
    let (code, err) = server.post(
        "/api/runs",
        &json!({ "config_path": "configs/tiny.toml", "overrides": ["training.stepz=3"] }),
    );
    assert_eq!(code, 422, "{err}");
    assert_eq!(err["errors"][0]["key_path"], "training.stepz");
    assert_eq!(server.get("/api/runs").1, json!([]));

    // Config paths stay inside configs/.
    for path in [
        "../registry.sqlite",
        "configs/../../etc/passwd",
        "/etc/passwd",
        "nope.toml",
    ] {
        let (code, err) = server.post("/api/runs", &json!({ "config_path": path }));
        assert_eq!(code, 404, "{path}: {err}");
    }
    let (code, _) = server.get("/api/configs/..%2Fregistry.sqlite");
    assert_eq!(code, 404);
    let (code, err) = server.post("/api/runs", &json!({ "overrides": [] }));
    assert_eq!(code, 400, "{err}");
}

#[test]
fn unknown_ids_are_404_json() {
    let server = start("ids", &[]);
    for path in [
        "/api/runs/999",
        "/api/runs/abc",
        "/api/runs/..%2F..%2Fetc",
        "/api/runs/999/metrics",
        "/api/runs/999/logs",
        "/api/runs/999/checkpoints",
        "/api/runs/999/events",
        "/api/rewards/7",
        "/api/nothing-here",
    ] {
        let (code, body) = server.get(path);
        assert_eq!(code, 404, "{path}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
    for path in ["/api/runs/999/stop", "/api/runs/999/resume"] {
        assert_eq!(server.post(path, &json!({})).0, 404, "{path}");
    }
    assert_eq!(server.call("DELETE", "/api/runs/999", None).0, 404);
}

#[test]
fn a_run_trains_to_completion_with_metrics_events_and_logs() {
    let server = start("complete", &[]);
    let id = create(&server, "tiny-6", &[]);
    let run = server.wait_status(id, &["completed", "failed"], 3 * MINUTE);
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["exit_code"], 0);
    assert_eq!(run["attempts"], 1);
    assert_eq!(run["config_path"], "configs/tiny.toml");
    assert!(run["config"]
        .as_str()
        .is_some_and(|c| c.contains("[model]")));
    assert_eq!(run["latest"]["step"], 6, "{run}");
    // The steps it trains to, from the config the trainer resolved (the page's progress line).
    assert_eq!(run["total_steps"], 6, "{run}");
    assert!(run["latest"]["loss"].is_number(), "{run}");

    // Metrics: every training row, the trainer's keys, `since` and `fields` filters.
    let (_, rows) = server.get(&format!("/api/runs/{id}/metrics"));
    let rows = rows.as_array().expect("rows").clone();
    let train: Vec<&Value> = rows.iter().filter(|r| r["loss"].is_number()).collect();
    assert_eq!(train.len(), 6, "{rows:?}");
    for key in [
        "step",
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "mfu",
        "mem_peak_bytes",
    ] {
        assert!(
            train[0].get(key).is_some(),
            "row without {key}: {}",
            train[0]
        );
    }
    assert!(rows.iter().any(|r| r["val_loss"].is_number()), "{rows:?}");
    let (_, later) = server.get(&format!("/api/runs/{id}/metrics?since=4&fields=loss"));
    let later = later.as_array().expect("rows").clone();
    assert!(
        later.iter().all(|r| r["step"].as_f64() > Some(4.0)),
        "{later:?}"
    );
    assert!(
        later
            .iter()
            .all(|r| r.as_object().is_some_and(|o| o.len() == 2)),
        "{later:?}"
    );
    let (_, few) = server.get(&format!("/api/runs/{id}/metrics?fields=loss&max_points=3"));
    assert!(
        few.as_array().is_some_and(|r| r.len() <= 4 && r.len() >= 3),
        "{few}"
    );

    // Events: the status first, then every metric row.
    let events = server.events_until(&format!("/api/runs/{id}/events"), MINUTE, |ev| {
        ev.iter()
            .filter(|(n, v)| n == "metric" && v["loss"].is_number())
            .count()
            == 6
    });
    assert_eq!(events[0].0, "status");
    assert_eq!(events[0].1["status"], "completed");
    let streamed = events
        .iter()
        .filter(|(n, v)| n == "metric" && v["loss"].is_number());
    assert_eq!(streamed.count(), 6);
    let since = server.events_until(
        &format!("/api/runs/{id}/events?since=5"),
        Duration::from_secs(3),
        |_| false,
    );
    let steps: Vec<&Value> = since
        .iter()
        .filter(|(n, _)| n == "metric")
        .map(|(_, v)| &v["step"])
        .collect();
    assert!(
        steps.iter().all(|s| s.as_f64() > Some(5.0)) && !steps.is_empty(),
        "{since:?}"
    );

    // Logs hold the trainer's output and the supervisor's notes.
    let (_, logs) = server.get(&format!("/api/runs/{id}/logs?tail=500"));
    let lines = logs["lines"].as_array().expect("lines");
    assert!(
        lines.iter().any(|l| l
            .as_str()
            .is_some_and(|l| l.contains("start: anneal train"))),
        "{logs}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.as_str().is_some_and(|l| l.contains("exit code 0"))),
        "{logs}"
    );
    let (_, two) = server.get(&format!("/api/runs/{id}/logs?tail=2"));
    assert_eq!(two["lines"].as_array().map(Vec::len), Some(2));

    // The trainer saved a checkpoint at the end; sampling exports it and generates from it.
    let (_, ckpts) = server.get(&format!("/api/runs/{id}/checkpoints"));
    assert_eq!(ckpts[0]["name"], "step-6", "{ckpts}");
    let (code, sample) = server.post(
        &format!("/api/runs/{id}/generate"),
        &json!({ "prompt_tokens": [5, 17, 33], "max_new_tokens": 4, "temperature": 0.0 }),
    );
    assert_eq!(code, 200, "{sample}");
    assert_eq!(sample["checkpoint"], "step-6");
    assert_eq!(
        sample["tokens"].as_array().map(Vec::len),
        Some(4),
        "{sample}"
    );
    let (code, text) = server.post(
        &format!("/api/runs/{id}/generate"),
        &json!({ "prompt": "the king", "max_new_tokens": 4, "seed": 1 }),
    );
    assert_eq!(code, 200, "{text}");
    let (code, err) = server.post(&format!("/api/runs/{id}/generate"), &json!({}));
    assert_eq!(code, 400, "{err}");

    // The run list shows it with its latest metrics; delete removes record and directory.
    let (_, runs) = server.get("/api/runs");
    assert_eq!(runs[0]["id"], id);
    assert!(runs[0].get("config").is_none());
    let run_dir = std::path::PathBuf::from(run["run_dir"].as_str().expect("run dir"));
    assert!(run_dir.join("metrics.jsonl").is_file());
    assert!(run_dir.join("exit.json").is_file());
    assert_eq!(
        server.call("DELETE", &format!("/api/runs/{id}"), None).0,
        204
    );
    assert_eq!(server.get(&format!("/api/runs/{id}")).0, 404);
    assert!(!run_dir.exists());
}

#[test]
fn checkpoints_are_listed_and_temporary_ones_ignored() {
    let server = start("ckpt", &[]);
    let id = create(
        &server,
        "ck",
        &[
            "training.steps=6",
            "checkpoint.interval=2",
            "checkpoint.keep_latest=5",
        ],
    );
    let run = server.wait_status(id, &["completed", "failed"], 3 * MINUTE);
    assert_eq!(run["status"], "completed", "{run}");
    let dir =
        std::path::PathBuf::from(run["run_dir"].as_str().expect("run dir")).join("checkpoints");
    // A save in progress and a foreign folder are not checkpoints.
    for name in ["step-8.tmp-99-1", "notes"] {
        std::fs::create_dir_all(dir.join(name)).expect("mkdir");
    }
    let (_, list) = server.get(&format!("/api/runs/{id}/checkpoints"));
    let steps: Vec<i64> = list
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|c| c["step"].as_i64())
        .collect();
    assert_eq!(steps, [2, 4, 6], "{list}");
    assert!(list[2]["bytes"].as_u64().is_some_and(|b| b > 0), "{list}");
    assert!(
        list[2]["files"].as_array().is_some_and(|f| !f.is_empty()),
        "{list}"
    );
}

#[test]
fn stop_resume_and_conflicts() {
    let server = start("stop", &["--max-running", "2"]);
    let id = create(&server, "long", &["training.steps=1000000"]);
    server.wait_status(id, &["running"], MINUTE);
    server.wait_rows(id, 3, 2 * MINUTE);

    // A running run cannot be resumed or deleted.
    let (code, err) = server.post(&format!("/api/runs/{id}/resume"), &json!({}));
    assert_eq!(code, 409, "{err}");
    assert_eq!(
        server.call("DELETE", &format!("/api/runs/{id}"), None).0,
        409
    );

    // Stop is graceful: the trainer ends after its step and exits 0 → `stopped`.
    let (code, _) = server.post(&format!("/api/runs/{id}/stop"), &json!({}));
    assert_eq!(code, 202);
    let run = server.wait_status(id, &["stopped", "failed", "completed"], 2 * MINUTE);
    assert_eq!(run["status"], "stopped", "{run}");
    assert_eq!(run["exit_code"], 0, "{run}");
    assert!(run["pid"].is_null());
    let before = server.wait_rows(id, 1, MINUTE).len();
    let (code, err) = server.post(&format!("/api/runs/{id}/stop"), &json!({}));
    assert_eq!(code, 409, "{err}");

    // Resume starts it again in the same run dir; its metrics keep growing.
    let (code, _) = server.post(&format!("/api/runs/{id}/resume"), &json!({}));
    assert_eq!(code, 202);
    let run = server.wait_status(id, &["running"], MINUTE);
    assert_eq!(run["attempts"], 2);
    server.wait_rows(id, before + 3, 2 * MINUTE);

    // Force stop kills the process group: `failed` would be wrong for a requested stop.
    let (code, _) = server.post(&format!("/api/runs/{id}/stop?force=true"), &json!({}));
    assert_eq!(code, 202);
    let run = server.wait_status(id, &["stopped", "failed"], MINUTE);
    assert!(
        run["exit_reason"]
            .as_str()
            .is_some_and(|r| r.contains("signal 9")),
        "{run}"
    );

    // A queued run (no free slot) stops at once.
    let server1 = start("queue", &["--max-running", "1"]);
    let a = create(&server1, "a", &["training.steps=1000000"]);
    let b = create(&server1, "b", &[]);
    server1.wait_status(a, &["running"], MINUTE);
    assert_eq!(server1.get(&format!("/api/runs/{b}")).1["status"], "queued");
    // Nothing to sample from before the first checkpoint.
    let (code, err) = server1.post(
        &format!("/api/runs/{b}/generate"),
        &json!({ "prompt_tokens": [1] }),
    );
    assert_eq!(code, 409, "{err}");
    assert!(
        err["error"]
            .as_str()
            .is_some_and(|e| e.contains("no checkpoint")),
        "{err}"
    );
    server1.post(&format!("/api/runs/{b}/stop"), &json!({}));
    assert_eq!(
        server1.get(&format!("/api/runs/{b}")).1["status"],
        "stopped"
    );
    server1.post(&format!("/api/runs/{a}/stop"), &json!({}));
    server1.wait_status(a, &["stopped"], 2 * MINUTE);
}

#[test]
fn a_failing_job_is_failed_with_its_error_line() {
    let server = start("fail", &[]);
    // Valid as far as validation looks (a corpus whose first document is fine), but a later
    // line is not JSON: reading the corpus, the trainer exits 2 with one line naming it.
    let corpus = server.home.join("bad.jsonl");
    let mut text = "{\"text\": \"the king speaks of the sea\"}\n".repeat(20);
    text.push_str("not json\n");
    std::fs::write(&corpus, text).expect("corpus");
    let data = format!("data.path=\"{}\"", corpus.display());
    let id = create(&server, "bad-data", &[&data]);
    let run = server.wait_status(id, &["failed", "completed"], 2 * MINUTE);
    assert_eq!(run["status"], "failed", "{run}");
    assert_eq!(run["exit_code"], 2);
    let reason = run["exit_reason"].as_str().expect("a reason");
    assert!(reason.contains("bad.jsonl:21"), "{reason}");
}

#[test]
fn server_killed_and_restarted_reconciles_runs() {
    let home = temp_home("restart");
    let configs = tiny_configs(&home);
    let args = [
        "--configs",
        configs.to_str().expect("utf-8"),
        "--max-running",
        "3",
    ];
    let server = Server::start(&home, &args);
    let adopted = create(&server, "adopted", &["training.steps=1000000"]);
    let finishes = create(&server, "finishes", &["training.steps=40"]);
    let killed = create(&server, "killed", &["training.steps=1000000"]);
    for id in [adopted, killed] {
        server.wait_status(id, &["running"], MINUTE);
    }
    // 40 steps of the tiny model can start and end between two polls.
    server.wait_status(finishes, &["running", "completed"], MINUTE);
    server.wait_rows(adopted, 2, 2 * MINUTE);
    server.wait_rows(killed, 2, 2 * MINUTE);
    let pid = |s: &Server, id: i64| {
        s.get(&format!("/api/runs/{id}")).1["pid"]
            .as_i64()
            .expect("pid")
    };
    let adopted_pid = pid(&server, adopted);
    let killed_pid = pid(&server, killed);

    // The server dies abruptly; its runs do not.
    server.kill();
    assert!(alive(adopted_pid), "runs outlive the server");
    // While no server watches: one run finishes, one is killed outright (no exit record).
    kill(-killed_pid, 9);
    let deadline = std::time::Instant::now() + 2 * MINUTE;
    while !home.join(format!("runs/{finishes}/exit.json")).exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "run {finishes} did not finish"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let rows_before = std::fs::read_to_string(home.join(format!("runs/{adopted}/metrics.jsonl")))
        .expect("metrics")
        .lines()
        .count();

    // A new server on the same home: nothing is left `running` without a process.
    let server = Server::start(&home, &args);
    let run = server.get(&format!("/api/runs/{finishes}")).1;
    assert_eq!(run["status"], "completed", "{run}");
    let run = server.get(&format!("/api/runs/{killed}")).1;
    assert_eq!(run["status"], "failed", "{run}");
    assert!(
        run["exit_reason"]
            .as_str()
            .is_some_and(|r| r.contains("exit record")),
        "{run}"
    );
    // The live one is adopted: still running, still streaming, and stoppable.
    let run = server.get(&format!("/api/runs/{adopted}")).1;
    assert_eq!(run["status"], "running", "{run}");
    assert_eq!(run["pid"], adopted_pid);
    server.wait_rows(adopted, rows_before + 2, 2 * MINUTE);
    let events = server.events_until(&format!("/api/runs/{adopted}/events"), MINUTE, |ev| {
        ev.iter().any(|(n, _)| n == "metric")
    });
    assert!(events.iter().any(|(n, _)| n == "metric"));
    assert_eq!(
        server
            .post(&format!("/api/runs/{adopted}/stop"), &json!({}))
            .0,
        202
    );
    let run = server.wait_status(adopted, &["stopped", "failed"], 2 * MINUTE);
    assert_eq!(run["status"], "stopped", "{run}");
    // Nothing lost: every run and every metric row is still there.
    assert_eq!(server.get("/api/runs").1.as_array().map(Vec::len), Some(3));
    let (_, rows) = server.get(&format!("/api/runs/{adopted}/metrics"));
    assert!(rows.as_array().is_some_and(|r| r.len() >= rows_before));
}

#[test]
fn plugins_are_listed() {
    let server = start("plugins", &[]);
    let (code, body) = server.get("/api/plugins");
    assert_eq!(code, 200, "{body}");
    let names: Vec<&str> = body["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    for name in ["llama", "adamw"] {
        assert!(names.contains(&name), "{body}");
    }
    // Each model plugin lists the Hugging Face model types it serves.
    let llama = body["plugins"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "llama"))
        .expect("llama");
    assert_eq!(
        llama["model_types"],
        serde_json::json!([
            "llama",
            "qwen3",
            "qwen3_moe",
            "mixtral",
            "qwen3_vl",
            "qwen3_vl_moe"
        ]),
        "{body}"
    );
}

#[test]
fn reward_modules_upload_validate_and_test() {
    let server = start("rewards", &["--max-upload-mb", "1"]);
    let wat = std::fs::read(serve_common::repo().join("reward-wasm/examples/wat/reward.wat"))
        .expect("the WAT example");
    let wasm = wat::parse_bytes(&wat).expect("valid WAT").into_owned();
    let (code, raw) = server.raw(
        "POST",
        "/api/rewards?name=reward.wasm",
        Some(&wasm),
        "application/wasm",
    );
    let stored: Value = serde_json::from_slice(&raw).expect("json");
    assert_eq!(code, 201, "{stored}");
    assert_eq!(stored["kind"], "core");
    assert_eq!(stored["size"], wasm.len());
    let id = stored["id"].as_i64().expect("id");
    assert_eq!(
        server.get("/api/rewards").1.as_array().map(Vec::len),
        Some(1)
    );

    // Scores the shared cases as `anneal reward test` does.
    let cases = std::fs::read_to_string(serve_common::repo().join("reward-wasm/cases.jsonl"))
        .expect("cases");
    let cases: Vec<Value> = cases
        .lines()
        .map(|l| serde_json::from_str(l).expect("case"))
        .collect();
    let (code, res) = server.post(
        &format!("/api/rewards/{id}/test"),
        &json!({ "inputs": cases }),
    );
    assert_eq!(code, 200, "{res}");
    for (got, case) in res["results"]
        .as_array()
        .expect("results")
        .iter()
        .zip(&cases)
    {
        assert_eq!(got["score"], case["expected"]["score"], "{got}");
    }

    // Invalid modules, modules without the reward ABI, and oversized uploads are refused.
    let (code, raw) = server.raw(
        "POST",
        "/api/rewards?name=x.wasm",
        Some(b"\0asm garbage"),
        "application/wasm",
    );
    assert_eq!(code, 422, "{}", String::from_utf8_lossy(&raw));
    let no_abi = wat::parse_str("(module (func (export \"f\")))").expect("wat");
    let (code, raw) = server.raw(
        "POST",
        "/api/rewards?name=f.wasm",
        Some(&no_abi),
        "application/wasm",
    );
    assert_eq!(code, 422, "{}", String::from_utf8_lossy(&raw));
    assert!(String::from_utf8_lossy(&raw).contains("reward ABI"));
    let big = vec![0u8; (1 << 20) + 1];
    let (code, raw) = server.raw(
        "POST",
        "/api/rewards?name=big.wasm",
        Some(&big),
        "application/wasm",
    );
    assert_eq!(code, 413, "{}", String::from_utf8_lossy(&raw));
    assert_eq!(
        server.get("/api/rewards").1.as_array().map(Vec::len),
        Some(1)
    );

    assert_eq!(
        server.call("DELETE", &format!("/api/rewards/{id}"), None).0,
        204
    );
    assert_eq!(server.get(&format!("/api/rewards/{id}")).0, 404);
}

#[test]
fn a_token_guards_the_api() {
    let home = temp_home("token");
    let mut server = Server::start(&home, &["--token", "s3cret"]);
    assert_eq!(server.get("/api/runs").0, 200);
    server.token = None;
    let (code, body) = server.get("/api/runs");
    assert_eq!(code, 401, "{body}");
    // EventSource cannot send headers: the token may come in the query.
    assert_eq!(server.get("/api/runs?token=s3cret").0, 200);
    assert_eq!(server.get("/api/health").0, 401);
    server.token = Some("wrong".into());
    assert_eq!(server.get("/api/runs").0, 401);
    // The UI's files are public.
    let (code, page) = server.raw("GET", "/index.html", None, "text/plain");
    assert_eq!(code, 200);
    assert!(String::from_utf8_lossy(&page).contains("<main>"));
}

#[test]
fn one_server_per_home() {
    let home = temp_home("twice");
    let _first = Server::start(&home, &[]);
    let out = std::process::Command::new(anneal_tests::cli::anneal_bin())
        .args(["serve", "--addr", "127.0.0.1:0", "--home"])
        .arg(&home)
        .output()
        .expect("run anneal serve");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another anneal serve"), "{err}");
}

#[test]
fn listening_beyond_loopback_needs_a_token() {
    let home = temp_home("public");
    let out = std::process::Command::new(anneal_tests::cli::anneal_bin())
        .args(["serve", "--addr", "0.0.0.0:0", "--home"])
        .arg(&home)
        .env_remove("ANNEAL_TOKEN")
        .output()
        .expect("run anneal serve");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("token"), "{err}");
}

#[test]
fn a_run_whose_mesh_asks_for_two_processes_runs_on_two_ranks_and_shows_both_logs() {
    let server = start("two-ranks", &[]);
    let id = create(
        &server,
        "ddp",
        &["parallelism.dp_replicate=2", "training.micro_batch_size=2"],
    );
    let run = server.wait_status(id, &["completed", "failed"], 3 * MINUTE);
    assert_eq!(run["status"], "completed", "{run}");
    let (code, main) = server.get(&format!("/api/runs/{id}/logs?tail=400"));
    assert_eq!(code, 200, "{main}");
    assert_eq!(main["ranks"], json!([0, 1]), "{main}");
    let text = main["lines"].to_string();
    assert!(text.contains("--nproc=2"), "{text}");
    let (code, rank1) = server.get(&format!("/api/runs/{id}/logs?rank=1&tail=50"));
    assert_eq!(code, 200, "{rank1}");
    assert!(
        rank1["lines"].as_array().is_some_and(|l| !l.is_empty()),
        "{rank1}"
    );
    let (code, none) = server.get(&format!("/api/runs/{id}/logs?rank=5"));
    assert_eq!(code, 404, "{none}");
    // Every step reached metrics.jsonl once, written by rank 0.
    let (_, metrics) = server.get(&format!("/api/runs/{id}/metrics"));
    let steps: Vec<i64> = metrics
        .as_array()
        .expect("rows")
        .iter()
        .filter(|r| r["loss"].is_number())
        .map(|r| r["step"].as_i64().unwrap())
        .collect();
    assert_eq!(steps, (1..=6).collect::<Vec<_>>(), "{metrics}");
}
