//! The OpenAI-compatible endpoint (`/v1`) under hostile input, with real servers: every error
//! under `/v1` in OpenAI's shape, and logprobs whose alternatives print alike.

use anneal_tests::cli::{ok, Job};
use anneal_tests::serve::{temp_home, Server};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::OnceLock;

/// A tiny Llama trained for two steps (its logits nearly uniform, so the 128 byte tokens that
/// are no character alone are among any 20 most likely).
struct Models {
    step: PathBuf,
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
        Models {
            step: run.join("checkpoints/step-2"),
        }
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
