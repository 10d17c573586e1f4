//! `anneal serve` is safe to run on a machine with a browser: real servers, real HTTP requests
//! with the headers a hostile page would make a browser send. Covers DNS rebinding (`Host`),
//! cross-site requests (`Origin`, form content types), the JSON error shape of every failure,
//! reward tests held to a budget and stopped when their client goes away or the server stops,
//! prompts that look like flags, `configs/` symlinks that point outside it, and symlinked logs
//! in a run directory.

use anneal_tests::serve::{cpu_seconds, temp_home, tiny_configs, Server};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MINUTE: Duration = Duration::from_secs(60);

/// A reward module (core ABI) whose `score` never returns.
const ENDLESS: &str = r#"(module
  (memory (export "memory") 1)
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "score") (param i32 i32 i32 i32 i32 i32) (result f64)
    (loop (br 0))
    (f64.const 0)))"#;

fn start(name: &str, extra: &[&str]) -> Server {
    let home = temp_home(&format!("sec-{name}"));
    let configs = tiny_configs(&home);
    let mut args = vec!["--configs", configs.to_str().expect("utf-8 path")];
    args.extend_from_slice(extra);
    Server::start(&home, &args)
}

/// Asserts the documented error shape: JSON with a non-empty one-line `error`.
fn assert_json_error(what: &str, status: u16, body: &[u8]) -> Value {
    let value: Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "{what}: {status} is not JSON ({e}): {}",
            String::from_utf8_lossy(body)
        )
    });
    let error = value["error"].as_str().unwrap_or_default();
    assert!(
        !error.is_empty() && !error.contains('\n'),
        "{what}: {status} {value}"
    );
    value
}

/// Uploads WAT text as a reward module; returns its id.
fn upload(server: &Server, wat: &str) -> i64 {
    let (code, raw) = server.raw(
        "POST",
        "/api/rewards?name=m.wat",
        Some(wat.as_bytes()),
        "application/wasm",
    );
    let stored: Value = serde_json::from_slice(&raw).expect("json");
    assert_eq!(code, 201, "{stored}");
    stored["id"].as_i64().expect("id")
}

fn inputs(n: usize) -> Value {
    let one = json!({ "prompt": "2+2?", "completion": "4", "metadata": {} });
    json!({ "inputs": vec![one; n] })
}

/// A tiny run trained to completion (6 steps, a checkpoint at the end).
fn completed_run(server: &Server) -> i64 {
    let (code, body) = server.post(
        "/api/runs",
        &json!({ "name": "t", "config_path": "configs/tiny.toml" }),
    );
    assert_eq!(code, 201, "{body}");
    let id = body["id"].as_i64().expect("an id");
    server.wait_status(id, &["completed"], 3 * MINUTE);
    id
}

fn reward_count(server: &Server) -> usize {
    server.get("/api/rewards").1.as_array().map_or(0, Vec::len)
}

#[test]
fn a_loopback_server_answers_only_to_its_own_names() {
    let server = start("host", &[]);
    let port = server.addr.rsplit(':').next().expect("port").to_string();
    for host in [
        "localhost".to_string(),
        format!("localhost:{port}"),
        format!("LocalHost:{port}"),
        "127.0.0.1".to_string(),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
    ] {
        let reply = server.send("GET", "/api/health", &[("Host", &host)], None);
        assert_eq!(reply.status, 200, "{host}");
    }
    // A page whose name was rebound to 127.0.0.1 reads nothing, not even the UI's files ...
    for host in [
        format!("evil.example:{port}"),
        "evil.example".to_string(),
        format!("localhost.evil.example:{port}"),
    ] {
        for path in ["/api/runs", "/api/configs/tiny.toml", "/index.html"] {
            let reply = server.send("GET", path, &[("Host", &host)], None);
            assert_eq!(reply.status, 403, "{host} {path}");
            let err = assert_json_error(path, reply.status, &reply.body);
            assert!(err["error"].as_str().is_some_and(|e| e.contains("Host")));
        }
    }
    // ... and changes nothing, though to the browser its requests are same-origin.
    let evil = format!("evil.example:{port}");
    let origin = format!("http://{evil}");
    let reply = server.send(
        "POST",
        "/api/rewards?name=x.wat",
        &[
            ("Host", &evil),
            ("Origin", &origin),
            ("Content-Type", "application/wasm"),
        ],
        Some(ENDLESS.as_bytes()),
    );
    assert_eq!(reply.status, 403);
    assert_json_error("rebound upload", reply.status, &reply.body);
    assert_eq!(reward_count(&server), 0);
}

#[test]
fn with_a_token_any_host_is_accepted_but_origins_are_checked() {
    let home = temp_home("sec-token-host");
    let server = Server::start_on("0.0.0.0:0", &home, &["--token", "s3cret"]);
    let reply = server.send(
        "GET",
        "/api/health",
        &[("Host", "anneal.lab.example:8080")],
        None,
    );
    assert_eq!(reply.status, 200);
    let reply = server.send(
        "POST",
        "/api/rewards?name=x.wat",
        &[
            ("Host", "anneal.lab.example:8080"),
            ("Origin", "https://evil.example"),
            ("Content-Type", "application/wasm"),
        ],
        Some(ENDLESS.as_bytes()),
    );
    assert_eq!(reply.status, 403);
    assert_json_error("cross-site upload", reply.status, &reply.body);
    // Behind a proxy that terminates TLS the page's origin is https://<Host>.
    let reply = server.send(
        "POST",
        "/api/rewards?name=x.wat",
        &[
            ("Host", "anneal.lab.example:8080"),
            ("Origin", "https://anneal.lab.example:8080"),
            ("Content-Type", "application/wasm"),
        ],
        Some(ENDLESS.as_bytes()),
    );
    assert_eq!(
        reply.status,
        201,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
}

#[test]
fn cross_site_requests_cannot_change_state() {
    let server = start("origin", &[]);
    let id = completed_run(&server);
    let resume = format!("/api/runs/{id}/resume");
    let own = format!("http://{}", server.addr);
    let port = server.addr.rsplit(':').next().expect("port");
    let other_local = format!(
        "http://localhost:{}",
        port.parse::<u16>().expect("port") ^ 1
    );
    // A form or a `text/plain` fetch needs no permission from the server: refused by type.
    for content_type in [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let reply = server.send("POST", &resume, &[("Content-Type", content_type)], None);
        assert_eq!(reply.status, 415, "{content_type}");
        assert_json_error(content_type, reply.status, &reply.body);
        let reply = server.send(
            "POST",
            "/api/rewards?name=x.wat",
            &[("Content-Type", content_type)],
            Some(ENDLESS.as_bytes()),
        );
        assert_eq!(reply.status, 415, "upload as {content_type}");
    }
    // Any other page is refused by its Origin, whatever the type.
    for origin in ["http://evil.example", "null", other_local.as_str()] {
        let headers = [("Origin", origin), ("Content-Type", "application/json")];
        let reply = server.send("POST", &resume, &headers, Some(b"{}"));
        assert_eq!(reply.status, 403, "{origin}");
        assert_json_error(origin, reply.status, &reply.body);
        let reply = server.send("DELETE", &format!("/api/runs/{id}"), &headers, None);
        assert_eq!(reply.status, 403, "{origin}");
    }
    assert_eq!(
        server.get(&format!("/api/runs/{id}")).1["status"],
        "completed"
    );
    assert_eq!(reward_count(&server), 0);
    // The server's own pages (the UI) may.
    let headers = [
        ("Origin", own.as_str()),
        ("Content-Type", "application/json"),
    ];
    // The resume passes the checks and reaches the run, which refuses it: a completed run has
    // nothing to resume. The delete is carried out.
    let reply = server.send("POST", &resume, &headers, Some(b"{}"));
    assert_eq!(
        reply.status,
        409,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert!(
        reply.json()["error"]
            .as_str()
            .is_some_and(|e| e.contains("completed")),
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let reply = server.send("DELETE", &format!("/api/runs/{id}"), &headers, None);
    assert_eq!(
        reply.status,
        204,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let reply = server.send(
        "POST",
        "/api/rewards?name=x.wat",
        &[
            ("Origin", own.as_str()),
            ("Content-Type", "application/octet-stream"),
        ],
        Some(ENDLESS.as_bytes()),
    );
    assert_eq!(
        reply.status,
        201,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
}

#[test]
fn api_errors_are_json() {
    let server = start("errors", &[]);
    let validate = "/api/configs/validate";
    let big = format!("{{\"config\":\"{}\"}}", "x".repeat(3 << 20));
    // (method, path, content type, body, status)
    type Case<'a> = (&'a str, &'a str, Option<&'a str>, &'a [u8], u16);
    let cases: [Case; 9] = [
        (
            "POST",
            validate,
            Some("application/json"),
            b"{not json",
            400,
        ),
        ("POST", validate, Some("application/xml"), b"<x/>", 415),
        ("POST", validate, None, b"{}", 415),
        (
            "POST",
            validate,
            Some("application/json"),
            b"{\"overrides\":5}",
            422,
        ),
        (
            "POST",
            validate,
            Some("application/json"),
            big.as_bytes(),
            413,
        ),
        ("GET", "/api/runs/1/stop", None, b"", 405),
        ("DELETE", "/api/runs", None, b"", 405),
        ("GET", "/api/runs/1/metrics?max_points=lots", None, b"", 400),
        ("GET", "/api/no/such/thing", None, b"", 404),
    ];
    for (method, path, content_type, body, status) in cases {
        let headers: Vec<(&str, &str)> = content_type
            .map(|t| vec![("Content-Type", t)])
            .unwrap_or_default();
        let reply = server.send(method, path, &headers, Some(body));
        let what = format!("{method} {path} {content_type:?}");
        assert_eq!(
            reply.status,
            status,
            "{what}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        assert_json_error(&what, reply.status, &reply.body);
        if status == 405 {
            assert!(reply.header("allow").is_some(), "{what}: {}", reply.head);
        }
    }
}

#[test]
fn a_prompt_starting_with_a_dash_is_text_not_a_flag() {
    let server = start("dash", &[]);
    let id = completed_run(&server);
    for prompt in ["-the king", "--help", "--prompt-tokens=1"] {
        let (code, sample) = server.post(
            &format!("/api/runs/{id}/generate"),
            &json!({ "prompt": prompt, "max_new_tokens": 3, "seed": 1 }),
        );
        assert_eq!(code, 200, "{prompt}: {sample}");
        assert_eq!(
            sample["tokens"].as_array().map(Vec::len),
            Some(3),
            "{sample}"
        );
        assert!(sample["text"].is_string(), "{sample}");
    }
}

#[test]
fn reward_tests_stop_at_their_fuel_budget() {
    let server = start("fuel", &["--reward-test-fuel", "1000000"]);
    let id = upload(&server, ENDLESS);
    let start = Instant::now();
    let (code, body) = server.post(&format!("/api/rewards/{id}/test"), &inputs(50));
    assert_eq!(code, 422, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("budget") && error.contains("1000000 fuel"),
        "{body}"
    );
    let results = body["results"].as_array().expect("the results so far");
    assert_eq!(results.len(), 1, "{body}");
    assert_eq!(results[0]["error"], "fuel_exhausted", "{body}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn reward_tests_stop_at_their_time_budget_and_inputs_are_capped() {
    let server = start("time", &["--reward-test-seconds", "1"]);
    let id = upload(&server, ENDLESS);
    let start = Instant::now();
    let (code, body) = server.post(&format!("/api/rewards/{id}/test"), &inputs(50));
    let took = start.elapsed();
    assert_eq!(code, 422, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("1 s")),
        "{body}"
    );
    // The per-call fuel may run out before the deadline on a fast machine: then two calls.
    let n = body["results"].as_array().map_or(0, Vec::len);
    assert!((1..=2).contains(&n), "{body}");
    assert!(took < Duration::from_secs(6), "{took:?}");

    let (code, body) = server.post(&format!("/api/rewards/{id}/test"), &inputs(1001));
    assert_eq!(code, 400, "{body}");
    let long = "x".repeat(1 << 20);
    let (code, body) = server.post(
        &format!("/api/rewards/{id}/test"),
        &json!({ "inputs": [{ "prompt": long, "completion": "" }] }),
    );
    assert_eq!(code, 413, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("bytes")),
        "{body}"
    );
}

#[test]
fn a_reward_test_stops_when_its_client_goes_away() {
    let server = start("gone", &[]);
    let id = upload(&server, ENDLESS);
    let pid = server.child.id();
    let body = inputs(200).to_string();
    let stream = server.open(
        "POST",
        &format!("/api/rewards/{id}/test"),
        &[("Content-Type", "application/json")],
        Some(body.as_bytes()),
    );
    std::thread::sleep(Duration::from_secs(1));
    let busy_from = cpu_seconds(pid);
    std::thread::sleep(Duration::from_secs(2));
    let busy = cpu_seconds(pid) - busy_from;
    assert!(
        busy > 0.3,
        "the test is not running: {busy} s of CPU in 2 s"
    );
    drop(stream);
    // The call in flight ends within its own deadline (2 s, counted in epoch ticks that a
    // loaded machine may stretch); no further input is started.
    std::thread::sleep(Duration::from_secs(5));
    let idle_from = cpu_seconds(pid);
    std::thread::sleep(Duration::from_secs(2));
    let idle = cpu_seconds(pid) - idle_from;
    assert!(
        idle < 0.2,
        "still scoring after the client left: {idle} s of CPU in 2 s"
    );
    assert_eq!(server.get("/api/health").0, 200);
}

#[test]
fn sigterm_ends_the_server_during_a_reward_test() {
    let mut server = start("sigterm", &[]);
    let id = upload(&server, ENDLESS);
    let body = inputs(1000).to_string();
    let _stream = server.open(
        "POST",
        &format!("/api/rewards/{id}/test"),
        &[("Content-Type", "application/json")],
        Some(body.as_bytes()),
    );
    std::thread::sleep(Duration::from_millis(1500));
    server.terminate_within(Duration::from_secs(5));
}

#[test]
fn configs_symlinks_pointing_outside_are_not_followed() {
    let home = temp_home("sec-links");
    let configs = tiny_configs(&home);
    let tiny = std::fs::read_to_string(configs.join("tiny.toml")).expect("tiny.toml");
    std::fs::write(home.join("secret.toml"), format!("# secret-marker\n{tiny}"))
        .expect("outside file");
    std::os::unix::fs::symlink("../secret.toml", configs.join("leak.toml")).expect("symlink");
    std::os::unix::fs::symlink(home.join("secret.toml"), configs.join("abs.toml"))
        .expect("symlink");
    std::os::unix::fs::symlink("tiny.toml", configs.join("alias.toml")).expect("symlink");
    let server = Server::start(&home, &["--configs", configs.to_str().expect("utf-8")]);

    let (code, list) = server.get("/api/configs");
    assert_eq!(code, 200);
    let names: Vec<&str> = list
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, ["alias.toml", "tiny.toml"], "{list}");
    for name in ["leak.toml", "abs.toml"] {
        let (code, body) = server.get(&format!("/api/configs/{name}"));
        assert_eq!(code, 404, "{name}: {body}");
        assert!(!body.to_string().contains("secret-marker"), "{body}");
        let path = format!("configs/{name}");
        let (code, body) = server.post("/api/configs/validate", &json!({ "config_path": path }));
        assert_eq!(code, 404, "{name}: {body}");
        let (code, body) = server.post("/api/runs", &json!({ "config_path": path }));
        assert_eq!(code, 404, "{name}: {body}");
    }
    assert_eq!(server.get("/api/runs").1, json!([]));
    // A link that stays inside the folder is followed.
    let (code, alias) = server.get("/api/configs/alias.toml");
    assert_eq!(code, 200, "{alias}");
    assert_eq!(alias["text"], tiny.as_str());
}

#[test]
fn a_symlinked_log_in_a_run_dir_is_not_followed() {
    let server = start("log-links", &[]);
    let id = completed_run(&server);
    let (_, run) = server.get(&format!("/api/runs/{id}"));
    let run_dir = std::path::PathBuf::from(run["run_dir"].as_str().expect("run_dir"));
    let secret = server.home.join("secret.txt");
    std::fs::write(&secret, "secret-marker\n").expect("outside file");
    std::fs::create_dir_all(run_dir.join("logs")).expect("logs/");
    std::os::unix::fs::symlink(&secret, run_dir.join("logs/rank-1.log")).expect("symlink");
    std::fs::write(run_dir.join("logs/rank-2.log"), "rank two\n").expect("rank 2 log");
    let log = run_dir.join("stdout.log");
    std::fs::remove_file(&log).expect("remove stdout.log");
    std::os::unix::fs::symlink(&secret, &log).expect("symlink");

    let (code, body) = server.get(&format!("/api/runs/{id}/logs"));
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["ranks"], json!([0, 2]), "{body}");
    assert!(!body.to_string().contains("secret-marker"), "{body}");
    let (code, body) = server.get(&format!("/api/runs/{id}/logs?rank=1"));
    assert_eq!(code, 404, "{body}");
    assert!(!body.to_string().contains("secret-marker"), "{body}");
    let (code, body) = server.get(&format!("/api/runs/{id}/logs?rank=2"));
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["lines"], json!(["rank two"]), "{body}");
    // Nor does the run's summary read its last log line through the link.
    let (_, run) = server.get(&format!("/api/runs/{id}"));
    assert!(!run.to_string().contains("secret-marker"), "{run}");
}
