//! Serving for agent harnesses (issue 38): tool calls through `/v1/chat/completions` with the
//! official `openai` Python client, and the token endpoints (`/v1/generate`, `/v1/tokenize`,
//! `/v1/detokenize`) fed back turn by turn, whose logprobs must equal `anneal logprobs` of the
//! whole sequence bit for bit (the decode loop is batch-invariant).
//!
//! The tool-call model is a tiny Llama trained here on chat data whose assistant answers a
//! weather question with `<tool_call>` and a tool's answer with a sentence, rendered by the
//! built-in ChatML (the tools block is the system message Qwen's template writes for the tools
//! `tests/openai_tools.py` sends), so greedy decoding gives a real tool call.
//! Needs `.venv` with `openai` (made by `scripts/setup.sh`).

use anneal_tests::cli::{anneal, ok, root};
use anneal_tests::serve::{repo, temp_home, Server};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The tool `tests/openai_tools.py` sends, as Python's `json.dumps` writes it.
const TOOL: &str = r#"{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#;

/// The system turn Qwen's template (and the built-in ChatML) writes for [`TOOL`].
fn tools_system() -> String {
    format!(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{TOOL}\n</tools>\n\n\
         For each function call, return a json object with function name and arguments within \
         <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
    )
}

/// What the fixture answers.
const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
const ANSWER: &str = "It is sunny in Paris.";

/// Trains the tool-call fixture; returns its checkpoint step directory.
fn tool_model(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let questions = [
        "What is the weather in Paris?",
        "Is it raining in Paris?",
        "Weather in Paris, please.",
        "How warm is Paris today?",
    ];
    let mut lines = String::new();
    for q in questions {
        let system = json!({"role": "system", "content": tools_system()});
        let user = json!({"role": "user", "content": q});
        let call = json!({"role": "assistant", "content": CALL});
        let reply =
            json!({"role": "user", "content": "<tool_response>\nsunny, 21 C\n</tool_response>"});
        let answer = json!({"role": "assistant", "content": ANSWER});
        for _ in 0..8 {
            lines += &json!({"messages": [system, user, call]}).to_string();
            lines += "\n";
            lines += &json!({"messages": [system, user, call, reply, answer]}).to_string();
            lines += "\n";
        }
    }
    let data = dir.join("tools.jsonl");
    std::fs::write(&data, lines).unwrap();
    let config = format!(
        r#"[model]
plugin = "llama"
flavor = "debugmodel"
args = {{ dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 4, ffn_dim = 128, vocab_size = 512, max_seq_len = 256 }}
[optimizer]
plugin = "adamw"
lr = 1e-2
[lr_scheduler]
warmup_steps = 5
[training]
steps = 120
batch_size = 8
micro_batch_size = 8
seq_len = 256
seed = 3
[checkpoint]
interval = 120
[data]
path = "{data}"
format = "chat"
tokenizer = "train"
vocab_size = 512
val_fraction = 0.0
cache_dir = "{cache}"
[metrics]
log_freq = 10
eval_freq = 1000
progress_bar = false
"#,
        data = data.display(),
        cache = dir.join("cache").display()
    );
    std::fs::write(dir.join("tools.toml"), config).unwrap();
    let run = dir.join("tools");
    ok(&anneal()
        .arg("train")
        .arg(dir.join("tools.toml"))
        .arg("--run-dir")
        .arg(&run)
        .output()
        .unwrap());
    run.join("checkpoints/step-120")
}

#[test]
fn the_openai_client_gets_tool_calls_back() {
    let py = repo().join(".venv/bin/python");
    let has_client = Command::new(&py)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        has_client,
        "{} with openai is missing: run scripts/setup.sh",
        py.display()
    );
    let dir = std::env::temp_dir().join(format!("anneal-tools-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let step = tool_model(&dir);
    let home = temp_home("openai-tools");
    let server = Server::start(&home, &["--model", step.to_str().unwrap()]);
    let out = Command::new(py)
        .arg(repo().join("tests/openai_tools.py"))
        .arg(server.url())
        .arg("tools-step-120")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("ok: tool call checks passed"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Hugging Face copy of the runtime's tiny Llama fixture with its tokenizer.
fn tiny_hf(dir: &Path) -> PathBuf {
    let fixtures = root().join("host/runtime/tests/fixtures");
    let hf = dir.join("tiny-llama");
    std::fs::create_dir_all(&hf).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures.join("tiny_llama").join(f), hf.join(f)).unwrap();
    }
    std::fs::copy(
        fixtures.join("tiny_tokenizer.json"),
        hf.join("tokenizer.json"),
    )
    .unwrap();
    hf
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn tokens_fed_back_turn_by_turn_score_as_anneal_logprobs_does() {
    let dir = std::env::temp_dir().join(format!("anneal-gen-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let hf = tiny_hf(&dir);
    let home = temp_home("openai-generate");
    let server = Server::start(&home, &["--model", hf.to_str().unwrap()]);
    let model = "tiny-llama";
    // Text round trip.
    let (status, t) = server.post("/v1/tokenize", &json!({"model": model, "text": "the cat"}));
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["count"], t["token_ids"].as_array().unwrap().len());
    let (status, d) = server.post(
        "/v1/detokenize",
        &json!({"model": model, "token_ids": t["token_ids"]}),
    );
    assert_eq!((status, d["text"].as_str()), (200, Some("the cat")), "{d}");
    // Three turns: generate, append the tokens and a "tool output", generate again. The other
    // requests in flight beside each turn share its decode steps.
    let mut seq: Vec<i64> = vec![1, 5, 9, 12, 7];
    let mut scored: Vec<(usize, Vec<i64>, Vec<f32>)> = Vec::new();
    for turn in 0..3u64 {
        let body = |seed: u64| {
            json!({"model": model, "prompt_token_ids": seq, "max_tokens": 6,
                   "temperature": 1.0, "seed": seed, "ignore_eos": true})
        };
        let results: Vec<(u16, Value)> = std::thread::scope(|s| {
            let calls: Vec<_> = (0..3)
                .map(|k| {
                    let b = body(10 * turn + k);
                    let server = &server;
                    s.spawn(move || server.post("/v1/generate", &b))
                })
                .collect();
            calls.into_iter().map(|c| c.join().unwrap()).collect()
        });
        let (status, g) = &results[0];
        assert_eq!(*status, 200, "{g}");
        let tokens = ints(&g["token_ids"]);
        let logprobs = floats(&g["logprobs"]);
        assert_eq!((tokens.len(), logprobs.len()), (6, 6), "{g}");
        assert_eq!(g["finish_reason"], "length");
        assert_eq!(g["usage"]["prompt_tokens"], seq.len());
        assert_eq!(g["usage"]["completion_tokens"], 6);
        scored.push((seq.len(), tokens.clone(), logprobs));
        seq.extend(tokens);
        seq.extend([40 + turn as i64, 41, 42]);
    }
    let all = seq
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = anneal()
        .args(["logprobs", "--model-dir"])
        .arg(&hf)
        .args(["--tokens", &all])
        .output()
        .unwrap();
    ok(&out);
    let whole: Value = serde_json::from_slice(&out.stdout).unwrap();
    let whole = floats(&whole["logprobs"]);
    for (start, tokens, logprobs) in &scored {
        // logprobs[i] scores token i + 1.
        let want = &whole[start - 1..start - 1 + tokens.len()];
        let same = want
            .iter()
            .zip(logprobs)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "served {logprobs:?} != anneal logprobs {want:?}");
    }
    // Errors name the field.
    for (body, param) in [
        (
            json!({"model": model, "prompt_token_ids": []}),
            "prompt_token_ids",
        ),
        (
            json!({"model": model, "prompt_token_ids": [1, 100000]}),
            "prompt_token_ids",
        ),
        (
            json!({"model": model, "prompt_token_ids": [1], "temperature": 5}),
            "temperature",
        ),
        (
            json!({"model": model, "prompt_token_ids": [1], "max_tokens": 0}),
            "max_tokens",
        ),
        (
            json!({"model": model, "prompt_token_ids": vec![1; 200]}),
            "prompt_token_ids",
        ),
    ] {
        let (status, e) = server.post("/v1/generate", &body);
        assert_eq!(
            (status, &e["error"]["param"]),
            (400, &json!(param)),
            "{body}: {e}"
        );
    }
    let (status, e) = server.post(
        "/v1/tokenize",
        &json!({"model": model, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}),
    );
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("tools")),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
