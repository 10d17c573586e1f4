//! The OpenAI-compatible endpoint with the official `openai` Python client: a tiny Llama is
//! trained, served by `anneal serve --model` from its checkpoint step directory and from a
//! Hugging Face export with a Jinja chat template, and `tests/openai_client.py` checks
//! completions and chat completions (streaming and not), errors and 16 concurrent requests.
//! Needs `.venv` with `openai` (made by `scripts/setup.sh`); without it the test fails.

use anneal_tests::cli::{anneal, ok, Job};
use anneal_tests::serve::{repo, temp_home, Server};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The template the HF copy ships (ChatML-like; exercises trim_blocks and str.strip()).
const TEMPLATE: &str = "{% for message in messages %}\n{{ '<' + message['role'] + '> ' + message['content'].strip() + '\\n' }}\n{% endfor %}\n{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}";

fn python() -> PathBuf {
    let py = repo().join(".venv/bin/python");
    let has_client = Command::new(&py)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        has_client,
        "{} with the openai package is missing: run scripts/setup.sh (or scripts/setup-python.sh)",
        py.display()
    );
    py
}

/// Trains the tiny model and returns its step directory and a Hugging Face export of it with
/// a chat template.
fn tiny_models(job: &Job) -> (PathBuf, PathBuf) {
    let (out, run) = job.train(
        "tiny",
        &[
            "training.steps=40",
            "checkpoint.interval=40",
            "metrics.eval_freq=40",
        ],
    );
    ok(&out);
    let step = run.join("checkpoints/step-40");
    let hf = job.dir.join("tiny-chat");
    ok(&anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(&hf)
        .arg(&step)
        .output()
        .unwrap());
    let config = serde_json::json!({ "chat_template": TEMPLATE, "eos_token": "<|endoftext|>" });
    std::fs::write(hf.join("tokenizer_config.json"), config.to_string()).unwrap();
    (step, hf)
}

fn serve_fails(home: &Path, models: &[&Path]) -> String {
    let mut c = anneal();
    // From the repository root, as the server tests run (web/ is found: no warning line).
    c.current_dir(repo())
        .args(["serve", "--addr", "127.0.0.1:0", "--home"])
        .arg(home);
    for m in models {
        c.arg("--model").arg(m);
    }
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    err
}

#[test]
fn the_openai_client_talks_to_anneal_serve() {
    let py = python();
    let job = Job::new("openai");
    let (step, hf) = tiny_models(&job);
    let home = temp_home("openai");
    // Model names: a step dir is <run>-step-<N>, an HF dir its folder; duplicates are refused.
    let err = serve_fails(&home, &[&step, &step]);
    assert!(err.contains("two models are named 'tiny-step-40'"), "{err}");
    let err = serve_fails(&home, &[&job.dir.join("corpus")]);
    assert!(err.contains("neither a checkpoint step directory"), "{err}");
    // A model id is looked up in the local Hugging Face cache, and named where it is not.
    let err = serve_fails(&home, &[Path::new("anneal-tests/no-such-model")]);
    assert!(
        err.contains("--model") && err.contains("Hugging Face cache"),
        "{err}"
    );
    let args = [
        "--model",
        step.to_str().unwrap(),
        "--model",
        hf.to_str().unwrap(),
    ];
    let server = Server::start(&home, &args);
    let out = Command::new(py)
        .arg(repo().join("tests/openai_client.py"))
        .arg(server.url())
        .args(["tiny-step-40", "tiny-chat"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("ok: openai client checks passed"),
        "{stdout}"
    );
}

#[test]
fn the_endpoint_needs_the_servers_token_and_answers_in_openais_error_shape() {
    let job = Job::new("openai-token");
    let (step, _) = tiny_models(&job);
    let home = temp_home("openai-token");
    let mut server = Server::start(
        &home,
        &["--token", "s3cret", "--model", step.to_str().unwrap()],
    );
    let (status, body) = server.get("/v1/models");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"][0]["id"], "tiny-step-40");
    // Without the token, or with another: 401 in OpenAI's shape.
    for token in [None, Some("wrong".to_string())] {
        server.token = token;
        let (status, body) = server.get("/v1/models");
        assert_eq!(status, 401, "{body}");
        assert_eq!(body["error"]["code"], "invalid_api_key");
    }
    server.token = Some("s3cret".into());
    let (status, body) = server.post(
        "/v1/completions",
        &serde_json::json!({"model": "tiny-step-40", "prompt": "the king", "max_tokens": 0}),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "max_tokens");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let (status, body) = server.raw(
        "POST",
        "/v1/chat/completions",
        Some(b"{"),
        "application/json",
    );
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    let (status, body) = server.post(
        "/v1/chat/completions",
        &serde_json::json!({"model": "tiny-step-40", "messages": [], "max_tokens": 2}),
    );
    assert_eq!(
        (status, &body["error"]["param"]),
        (400, &serde_json::json!("messages"))
    );
    let (status, body) = server.get("/v1/embeddings");
    assert_eq!(
        (status, &body["error"]["code"]),
        (404, &serde_json::json!("unknown_url"))
    );
}
