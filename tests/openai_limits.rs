//! The OpenAI-compatible endpoint (`/v1`) under hostile input, with real servers: a model whose
//! chat template never ends (each render stopped at its limits with an OpenAI error, off the
//! async workers, so the server keeps answering and still stops on SIGTERM), every error
//! under `/v1` in OpenAI's shape, and logprobs whose alternatives print alike.

use anneal_tests::cli::{anneal, ok, Job};
use anneal_tests::serve::{temp_home, Server};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// Loops 10^10 times writing nothing: only fuel stops it.
const QUIET: &str =
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x";
/// Loops 10^10 times writing the first message each time.
const LOUD: &str = "{% for a in range(100000) %}{% for b in range(100000) %}{{ messages[0].content }}{% endfor %}{% endfor %}";

/// A tiny Llama trained for two steps (its logits nearly uniform, so the 128 byte tokens that
/// are no character alone are among any 20 most likely) and two Hugging Face exports of it
/// with endless chat templates.
struct Models {
    step: PathBuf,
    quiet: PathBuf,
    loud: PathBuf,
}

fn models() -> &'static Models {
    static MODELS: OnceLock<Models> = OnceLock::new();
    MODELS.get_or_init(|| {
        let job = Job::new("openai-limits");
        let (out, run) = job.train(
            "tiny",
            &[
                "training.steps=2",
                "checkpoint.interval=2",
                "metrics.eval_freq=2",
            ],
        );
        ok(&out);
        let step = run.join("checkpoints/step-2");
        let export = |name: &str, template: &str| {
            let hf = job.dir.join(name);
            ok(&anneal()
                .args(["checkpoint", "export", "--to-hf"])
                .arg(&hf)
                .arg(&step)
                .output()
                .expect("run anneal"));
            let config = json!({ "chat_template": template, "eos_token": "<|endoftext|>" });
            std::fs::write(hf.join("tokenizer_config.json"), config.to_string())
                .expect("tokenizer_config.json");
            hf
        };
        Models {
            quiet: export("endless-quiet", QUIET),
            loud: export("endless-loud", LOUD),
            step,
        }
    })
}

fn chat(model: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "the king speaks of"}],
        "max_tokens": 2,
    })
}

/// Asserts OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with a
/// one-line message and a type; returns the error object.
fn openai_error(what: &str, body: &[u8]) -> Value {
    let value: Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {}", String::from_utf8_lossy(body)));
    let error = &value["error"];
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        !message.is_empty() && !message.contains('\n'),
        "{what}: {value}"
    );
    assert!(error["type"].is_string(), "{what}: {value}");
    let keys = error.as_object().map(|o| o.len());
    assert!(
        keys == Some(4) && error.get("param").is_some() && error.get("code").is_some(),
        "{what}: {value}"
    );
    error.clone()
}

#[test]
fn an_endless_chat_template_is_stopped_and_the_server_keeps_answering() {
    let m = models();
    let home = temp_home("openai-endless");
    let args = [
        "--model",
        m.quiet.to_str().expect("utf-8"),
        "--model",
        m.loud.to_str().expect("utf-8"),
    ];
    let mut server = Server::start(&home, &args);
    // More renders at once than the machine has async workers (a render on a worker used to
    // take it for good): every one ends with OpenAI's error, and health answers meanwhile.
    let replies = std::thread::scope(|s| {
        let calls: Vec<_> = (0..8)
            .map(|i| {
                let server = &server;
                let model = if i % 2 == 0 {
                    "endless-quiet"
                } else {
                    "endless-loud"
                };
                s.spawn(move || server.post("/v1/chat/completions", &chat(model)))
            })
            .collect();
        for _ in 0..5 {
            assert_eq!(server.get("/api/health").0, 200);
            std::thread::sleep(Duration::from_millis(100));
        }
        calls
            .into_iter()
            .map(|c| c.join().expect("a request thread"))
            .collect::<Vec<_>>()
    });
    for (status, body) in replies {
        assert_eq!(status, 400, "{body}");
        let error = openai_error("endless template", body.to_string().as_bytes());
        assert_eq!(error["param"], "messages", "{body}");
        assert_eq!(error["code"], "chat_template_limit", "{body}");
        let message = error["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("chat template exceeded its limits") && message.contains("fuel"),
            "{body}"
        );
    }
    // A client that leaves at once: its render stops, the server goes on.
    drop(server.open(
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        Some(chat("endless-loud").to_string().as_bytes()),
    ));
    assert_eq!(server.get("/api/health").0, 200);
    // SIGTERM with renders in flight ends the server.
    let body = chat("endless-quiet").to_string();
    let _open: Vec<_> = (0..6)
        .map(|_| {
            server.open(
                "POST",
                "/v1/chat/completions",
                &[("Content-Type", "application/json")],
                Some(body.as_bytes()),
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    server.terminate_within(Duration::from_secs(20));
}

#[test]
fn every_error_under_v1_has_openais_shape() {
    let home = temp_home("openai-errors");
    let server = Server::start(&home, &[]);
    let big = format!("{{\"prompt\":\"{}\"}}", "x".repeat(3 << 20));
    let json_type = ("Content-Type", "application/json");
    // (method, path, headers, body, status, code)
    type Case<'a> = (
        &'a str,
        &'a str,
        Vec<(&'a str, &'a str)>,
        &'a [u8],
        u16,
        Value,
    );
    let cases: Vec<Case> = vec![
        (
            "POST",
            "/v1/completions",
            vec![json_type],
            big.as_bytes(),
            413,
            json!("request_too_large"),
        ),
        (
            "GET",
            "/v1/chat/completions",
            vec![],
            b"",
            405,
            json!("method_not_allowed"),
        ),
        (
            "DELETE",
            "/v1/models",
            vec![],
            b"",
            405,
            json!("method_not_allowed"),
        ),
        (
            "POST",
            "/v1/completions",
            vec![("Content-Type", "text/plain")],
            b"{}",
            415,
            json!("unsupported_media_type"),
        ),
        (
            "POST",
            "/v1/chat/completions",
            vec![json_type, ("Origin", "http://evil.example")],
            b"{}",
            403,
            json!("forbidden"),
        ),
        (
            "GET",
            "/v1/models",
            vec![("Host", "evil.example")],
            b"",
            403,
            json!("forbidden"),
        ),
        (
            "POST",
            "/v1/completions",
            vec![json_type],
            b"{",
            400,
            Value::Null,
        ),
        (
            "GET",
            "/v1/models/nope",
            vec![],
            b"",
            404,
            json!("model_not_found"),
        ),
        ("GET", "/v1/nope", vec![], b"", 404, json!("unknown_url")),
        ("GET", "/v1", vec![], b"", 404, json!("unknown_url")),
    ];
    for (method, path, headers, body, status, code) in cases {
        let reply = server.send(method, path, &headers, Some(body));
        let what = format!("{method} {path} {headers:?}");
        assert_eq!(
            reply.status,
            status,
            "{what}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        let error = openai_error(&what, &reply.body);
        assert_eq!(error["code"], code, "{what}: {error}");
        if status == 405 {
            assert!(reply.header("allow").is_some(), "{what}: {}", reply.head);
        }
    }
    // The rest of the API keeps its own shape.
    let reply = server.send("GET", "/api/runs", &[("Host", "evil.example")], None);
    assert_eq!(reply.status, 403);
    assert!(reply.json()["error"].is_string());
}

#[test]
fn twenty_logprob_alternatives_are_twenty_distinct_tokens_with_their_bytes() {
    let m = models();
    let home = temp_home("openai-logprobs");
    let server = Server::start(&home, &["--model", m.step.to_str().expect("utf-8")]);
    let model = "tiny-step-2";
    let mut partial = 0;
    // The completions endpoint: a map keyed by text, one key per alternative.
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"model": model, "prompt": "the king", "max_tokens": 4, "temperature": 0,
                "logprobs": 20}),
    );
    assert_eq!(status, 200, "{body}");
    let tops = body["choices"][0]["logprobs"]["top_logprobs"]
        .as_array()
        .expect("top_logprobs");
    assert_eq!(tops.len(), 4, "{body}");
    for top in tops {
        let keys = top.as_object().expect("a map");
        assert_eq!(keys.len(), 20, "{top}");
        partial += keys.keys().filter(|k| k.starts_with("bytes:")).count();
    }
    // The chat endpoint: a list with each alternative's exact bytes.
    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({"model": model, "messages": [{"role": "user", "content": "the king"}],
                "max_tokens": 4, "temperature": 0, "logprobs": true, "top_logprobs": 20}),
    );
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content");
    assert_eq!(content.len(), 4, "{body}");
    for entry in content {
        let alts = entry["top_logprobs"].as_array().expect("a list");
        assert_eq!(alts.len(), 20, "{entry}");
        let bytes: HashSet<Vec<u8>> = alts
            .iter()
            .map(|a| serde_json::from_value(a["bytes"].clone()).expect("bytes"))
            .collect();
        let tokens: HashSet<&str> = alts.iter().filter_map(|a| a["token"].as_str()).collect();
        assert_eq!((bytes.len(), tokens.len()), (20, 20), "{entry}");
        for a in alts {
            let b: Vec<u8> = serde_json::from_value(a["bytes"].clone()).expect("bytes");
            let token = a["token"].as_str().unwrap_or_default();
            match std::str::from_utf8(&b) {
                Ok(text) => assert_eq!(token, text, "{a}"),
                Err(_) => {
                    let escaped: String = b.iter().map(|x| format!("\\x{x:02x}")).collect();
                    assert_eq!(token, format!("bytes:{escaped}"), "{a}");
                    partial += 1;
                }
            }
        }
    }
    // The case at issue came up: alternatives that are part of a character.
    assert!(partial > 0, "no alternative was a partial character");
}
