//! The OpenAI-compatible endpoint (`/v1`) under hostile input, with real servers: every error
//! under `/v1` in OpenAI's shape.

use anneal_tests::serve::{temp_home, Server};
use serde_json::{json, Value};

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
