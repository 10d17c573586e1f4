//! `anneal serve`'s config validation asks what the run asks before it starts (the same code:
//! `anneal_train::preflight`, `anneal_rl::preflight`): the model's context, the device, the
//! data, the plugins' arguments, the RL prompts; each refusal a 422 under its key path, at
//! validation and at run creation. And a configs folder of another name (`--configs DIR`) is
//! spoken of as it is named.

use anneal_tests::serve::{add_rl_config, temp_home, tiny_configs, Server};
use serde_json::{json, Value};
use std::time::Duration;

fn validate(server: &Server, body: Value) -> (u16, Value) {
    server.post("/api/configs/validate", &body)
}

/// Asserts a 422 whose first problem is about `key` and whose message holds `words`.
fn refused(reply: (u16, Value), key: &str, words: &[&str]) {
    let (code, body) = reply;
    assert_eq!(code, 422, "{key}: {body}");
    assert_eq!(body["errors"][0]["key_path"], key, "{body}");
    let message = body["errors"][0]["message"].as_str().unwrap_or_default();
    for w in words {
        assert!(message.contains(w), "{w} not in {message}");
    }
}

/// `tiny.toml`'s text with another `[model]`: its plugin and args replaced.
fn with_model(text: &str, plugin: &str, args: &str) -> String {
    text.lines()
        .map(|l| match l {
            l if l.starts_with("plugin = \"llama\"") => format!("plugin = \"{plugin}\"\n"),
            l if l.starts_with("args = { dim") => format!("args = {args}\n"),
            l => format!("{l}\n"),
        })
        .collect()
}

#[test]
fn validation_refuses_what_the_run_would_refuse_at_start() {
    let home = temp_home("validate");
    let configs = tiny_configs(&home);
    let server = Server::start(&home, &["--configs", configs.to_str().expect("utf-8")]);
    let tiny =
        |overrides: &[&str]| json!({ "config_path": "configs/tiny.toml", "overrides": overrides });
    let (code, ok) = validate(&server, tiny(&[]));
    assert_eq!(code, 200, "{ok}");
    assert_eq!(ok["notes"], json!([]));

    // The tiny model has 64 positions.
    refused(
        validate(&server, tiny(&["training.seq_len=128"])),
        "training.seq_len",
        &["128", "max_seq_len 64"],
    );
    refused(
        validate(&server, tiny(&["job.device=\"cuda:99\""])),
        "job.device",
        &["cuda:99"],
    );
    refused(
        validate(&server, tiny(&["data.path=\"/nonexistent/corpus\""])),
        "data.path",
        &["/nonexistent/corpus"],
    );
    let jsonl = home.join("docs.jsonl");
    std::fs::write(&jsonl, "{\"body\": \"the king\"}\n").unwrap();
    refused(
        validate(
            &server,
            tiny(&[&format!("data.path=\"{}\"", jsonl.display())]),
        ),
        "data.path",
        &["docs.jsonl:1", "\"text\""],
    );
    refused(
        validate(&server, tiny(&["model.plugin=\"nope\""])),
        "model.plugin",
        &["nope"],
    );
    refused(
        validate(&server, tiny(&["model.args.norm_eps=-1e-5"])),
        "model.args.norm_eps",
        &["llama"],
    );
    // Four data-parallel shards: neither the one micro-batch nor its 3 rows split over them.
    refused(
        validate(
            &server,
            tiny(&[
                "training.batch_size=3",
                "training.micro_batch_size=3",
                "parallelism.dp_shard=4",
            ]),
        ),
        "training.batch_size",
        &["parallelism.dp_shard = 4"],
    );
    // A DeepSeek-V3 all of whose blocks are dense (its experts would never run).
    let text = std::fs::read_to_string(configs.join("tiny.toml")).unwrap();
    let deepseek = with_model(&text, "deepseek_v3", anneal_tests::tiny::DEEPSEEK_V3);
    let (code, body) = validate(&server, json!({ "config": deepseek }));
    assert_eq!(code, 200, "{body}");
    refused(
        validate(
            &server,
            json!({ "config": deepseek, "overrides": ["model.args.first_k_dense=2"] }),
        ),
        "model.args.first_k_dense",
        &["no MoE layer"],
    );
    // Creating a run is refused the same way, and records nothing.
    refused(
        server.post("/api/runs", &tiny(&["training.seq_len=128"])),
        "training.seq_len",
        &["max_seq_len"],
    );
    assert_eq!(server.get("/api/runs").1, json!([]));
}

#[test]
fn rl_validation_checks_the_prompts_against_the_context() {
    let home = temp_home("validate-rl");
    let configs = tiny_configs(&home);
    add_rl_config(&configs);
    let server = Server::start(&home, &["--configs", configs.to_str().expect("utf-8")]);
    let tokenizer = home.join("tokenizer.json");
    let docs: Vec<String> = (0..200)
        .map(|i| {
            let (p, a) = anneal_rl::rollout::digits_sort_task(3, i);
            format!("{p}{a}")
        })
        .collect();
    anneal_data::TextTokenizer::train_bpe_on_texts(&docs, 260)
        .unwrap()
        .save(&tokenizer)
        .unwrap();
    let reward = home.join("reward.wat");
    std::fs::write(&reward, anneal_tests::serve::LENGTH_PARITY_WAT).unwrap();
    // Line 3 holds 80 characters no merge covers: more than the 64 positions by itself.
    let prompts = home.join("prompts.jsonl");
    let long = "xyz ".repeat(20);
    std::fs::write(
        &prompts,
        format!("{{\"prompt\":\"123=\"}}\n{{\"prompt\":\"42=\"}}\n{{\"prompt\":\"{long}\"}}\n"),
    )
    .unwrap();
    let rl = |extra: &[&str]| {
        let mut overrides = vec![
            format!("rl.tokenizer=\"{}\"", tokenizer.display()),
            format!("rl.prompts_path=\"{}\"", prompts.display()),
            format!(
                "rl.rewards=[{{ path = \"{}\", weight = 1.0 }}]",
                reward.display()
            ),
        ];
        overrides.extend(extra.iter().map(|s| s.to_string()));
        json!({ "config_path": "configs/rl_tiny.toml", "overrides": overrides })
    };
    refused(
        validate(&server, rl(&[])),
        "rl.prompts_path",
        &[
            "prompts.jsonl line 3",
            "rl.max_new_tokens = 6",
            "rl.skip_long_prompts",
        ],
    );
    let (code, ok) = validate(&server, rl(&["rl.skip_long_prompts=true"]));
    assert_eq!(code, 200, "{ok}");
    let notes = ok["notes"].to_string();
    assert!(notes.contains("skipping 1 prompt"), "{notes}");
    refused(
        validate(&server, rl(&["rl.group_size=1"])),
        "rl.group_size",
        &["advantage is 0"],
    );
}

#[test]
fn a_configs_folder_of_another_name_is_named_as_it_is() {
    let home = temp_home("validate-dir");
    let configs = tiny_configs(&home);
    let cfgs = home.join("cfgs");
    std::fs::rename(&configs, &cfgs).unwrap();
    let server = Server::start(&home, &["--configs", cfgs.to_str().expect("utf-8")]);
    let (code, list) = server.get("/api/configs");
    assert_eq!(code, 200);
    assert_eq!(
        list,
        json!([{ "name": "tiny.toml", "path": "cfgs/tiny.toml" }])
    );
    let whole = cfgs.join("tiny.toml").display().to_string();
    for path in ["cfgs/tiny.toml", "tiny.toml", whole.as_str()] {
        let (code, body) = validate(&server, json!({ "config_path": path }));
        assert_eq!(code, 200, "{path}: {body}");
    }
    // `configs/` is no folder of this server: the 404 names the real one.
    let (code, body) = validate(&server, json!({ "config_path": "configs/tiny.toml" }));
    assert_eq!(code, 404, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(error.contains(&format!("{}/", cfgs.display())), "{error}");
    let (code, body) = server.post("/api/runs", &json!({}));
    assert_eq!(code, 400);
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("cfgs")),
        "{body}"
    );
    let (code, body) = server.post(
        "/api/runs",
        &json!({ "config_path": "tiny.toml", "overrides": ["training.steps=1"] }),
    );
    assert_eq!(code, 201, "{body}");
    assert_eq!(body["run"]["config_path"], "cfgs/tiny.toml");
    assert_eq!(body["run"]["name"], "tiny");
    let id = body["id"].as_i64().expect("id");
    let run = server.wait_status(id, &["completed", "failed"], Duration::from_secs(180));
    assert_eq!(run["status"], "completed", "{run}");
}
