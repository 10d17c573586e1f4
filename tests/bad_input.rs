//! Bad input end to end: no panic, no abort, no hang. Every case runs the real `anneal` binary
//! (and, for the server, a real `anneal serve`) on a bad config, file, argument or plugin and
//! checks that it ends promptly with one clean error line and the right exit code (2 for the
//! user's input, 1 for a failure of the run).

use anneal_tests::cli::{anneal, anneal_bin, badlogits_plugin_dir, ok, root, Job};
use anneal_tests::serve::{temp_home, tiny_configs, Server};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `c`, killing it and failing the test if it has not ended within `secs` (a hang or a
/// runaway allocation is a regression, not a test that never ends).
fn run_within(mut c: Command, secs: u64) -> Output {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start anneal");
    let start = Instant::now();
    while child.try_wait().expect("poll anneal").is_none() {
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect output");
            panic!(
                "still running after {secs} s; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("collect output")
}

/// Asserts that `out` failed with `code` and one clean `error:` line, and returns that line.
fn error_line(out: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(code), "stderr: {stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "exactly one error line: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let line = errors[0].to_string();
    assert!(!repeats_a_cause(&line), "a cause is said twice: {line}");
    assert!(!line.contains("{\""), "a JSON dump: {line}");
    line
}

/// `... X: X`: the text after some `: ` is also what came right before it.
fn repeats_a_cause(line: &str) -> bool {
    line.match_indices(": ")
        .any(|(i, _)| line[..i].ends_with(&line[i + 2..]))
}

fn train(job: &Job, run: &str, set: &[&str]) -> Output {
    let mut c = anneal();
    c.arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(job.dir.join(run));
    for s in set {
        c.args(["--set", s]);
    }
    run_within(c, 120)
}

fn fixture(name: &str) -> PathBuf {
    root().join("host/runtime/tests/fixtures").join(name)
}

#[test]
fn the_cause_check_finds_repetition() {
    assert!(repeats_a_cause("error: checkpoint: a/b: bad: a/b: bad"));
    assert!(!repeats_a_cause(
        "error: no usable checkpoint in a/b (a/b/step-1: bad)"
    ));
}

#[test]
fn nan_or_inf_in_plugin_args_is_an_error_naming_the_key() {
    let job = Job::new("nan-args");
    for (set, key) in [
        ("model.args.dim=nan", "model.args.dim"),
        ("optimizer.args.betas=[0.9, inf]", "optimizer.args.betas[1]"),
    ] {
        let mut c = anneal();
        c.args(["config", "show"])
            .arg(job.config())
            .args(["--set", set]);
        let line = error_line(&run_within(c, 60), 2);
        assert!(line.contains(key) && line.contains("finite"), "{line}");
        let line = error_line(&train(&job, "nan", &[set]), 2);
        assert!(line.contains(key), "{line}");
    }
}

#[test]
fn a_model_that_cannot_fit_is_refused_before_allocating() {
    let job = Job::new("memory");
    anneal_bin(); // built before the clock starts
    let started = Instant::now();
    let line = error_line(&train(&job, "huge", &["model.args.dim=4000000"]), 2);
    assert!(
        line.contains("needs about") && line.contains("PiB") && line.contains("available"),
        "{line}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "refused at once"
    );
    // A limit below the tiny model's estimate refuses it; the default lets it train.
    let line = error_line(&train(&job, "limit", &["training.memory_limit_mb=1"]), 2);
    assert!(line.contains("training.memory_limit_mb"), "{line}");
    ok(&train(
        &job,
        "fits",
        &[
            "training.memory_limit_mb=1",
            "training.skip_memory_check=true",
            "training.steps=1",
        ],
    ));
    let mut c = anneal();
    c.args(["config", "show"]).arg(job.config());
    let out = run_within(c, 60);
    ok(&out);
    let shown = String::from_utf8_lossy(&out.stderr);
    let estimate = shown
        .lines()
        .find(|l| l.starts_with("memory estimate for `anneal train`: "))
        .unwrap_or_else(|| panic!("no estimate in {shown}"));
    assert!(
        estimate.contains("parameters") && estimate.contains("available"),
        "{estimate}"
    );
}

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("run mkfifo")
        .success();
    assert!(ok, "mkfifo {}", path.display());
}

#[test]
fn a_fifo_named_like_a_plugin_hangs_nothing() {
    let job = Job::new("fifo");
    let dir = job.dir.join("plugins");
    std::fs::create_dir_all(&dir).unwrap();
    mkfifo(&dir.join("libanneal_plugin_x.so"));
    let mut c = anneal();
    c.env("ANNEAL_PLUGIN_PATH", &dir).args(["plugins", "list"]);
    let listed = ok(&run_within(c, 60));
    assert!(
        listed.contains("llama") && !listed.contains("plugin_x"),
        "{listed}"
    );
    let mut c = anneal();
    c.env("ANNEAL_PLUGIN_PATH", &dir)
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(job.dir.join("run"))
        .args(["--set", "training.steps=1"]);
    ok(&run_within(c, 120));
}

#[test]
fn plugins_refuse_bad_arguments_by_name() {
    let job = Job::new("plugin-args");
    for (set, words) in [
        ("optimizer.args.eps=-1e-8", ["adamw", "eps"]),
        ("optimizer.args.betas=[1.0, 0.9]", ["adamw", "betas[0]"]),
        ("model.args.norm_eps=-1e-5", ["llama", "norm_eps"]),
        ("model.args.dim=\"wide\"", ["llama", "dim"]),
        ("model.args.dim=0", ["llama", "dim"]),
    ] {
        let line = error_line(&train(&job, "args", &[set]), 2);
        assert!(words.iter().all(|w| line.contains(w)), "{set}: {line}");
    }
    // A Hugging Face config.json with a negative rms_norm_eps, and one with a wrong type.
    let dir = job.dir.join("hf");
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture("tiny_llama");
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    for (key, value, want) in [
        ("rms_norm_eps", json!(-1e-5), "rms_norm_eps"),
        (
            "hidden_size",
            json!("64"),
            "'hidden_size' has the wrong type",
        ),
    ] {
        let mut c = config.clone();
        c[key] = value;
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        let mut cmd = anneal();
        cmd.args(["logprobs", "--tokens", "1,2,3", "--model-dir"])
            .arg(&dir);
        let line = error_line(&run_within(cmd, 60), 2);
        assert!(line.contains(want) && !line.contains("missing"), "{line}");
    }
}

fn generate(extra: &[&str]) -> Output {
    let mut c = anneal();
    c.args(["generate", "--model-dir"])
        .arg(fixture("tiny_llama"))
        .args(extra);
    run_within(c, 60)
}

#[test]
fn sampling_settings_and_lengths_are_checked_against_the_model() {
    let prompt = ["--prompt-tokens", "5,17,33"];
    for (flag, value, word) in [
        ("--temperature", "-1", "temperature"),
        ("--temperature", "NaN", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--top-p", "1.5", "top_p"),
    ] {
        let out = generate(&[&prompt[..], &[flag, value]].concat());
        let line = error_line(&out, 2);
        assert!(
            line.contains(word) && line.contains(value),
            "{flag} {value}: {line}"
        );
    }
    // The fixture has 128 positions: 129 tokens cannot be scored, and a 120-token prompt leaves
    // room for 8 new tokens, whatever --max-new-tokens asks.
    let ids = |n: usize| {
        (0..n)
            .map(|i| (i % 90).to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut c = anneal();
    c.args(["logprobs", "--tokens", &ids(129), "--model-dir"])
        .arg(fixture("tiny_llama"));
    let line = error_line(&run_within(c, 60), 2);
    assert!(
        line.contains("129 tokens") && line.contains("128 positions"),
        "{line}"
    );
    let out = generate(&[
        "--prompt-tokens",
        &ids(120),
        "--max-new-tokens",
        "100",
        "--temperature",
        "0",
    ]);
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).expect("JSON");
    assert_eq!(v["tokens"].as_array().map(Vec::len), Some(8), "{v}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("capped at 8"),
        "a note says so"
    );
    let line = error_line(&generate(&["--prompt-tokens", &ids(128)]), 2);
    assert!(line.contains("nothing is left to generate"), "{line}");
    let line = error_line(
        &generate(&["--prompt-tokens", "1,2", "--plugin", "adamw"]),
        2,
    );
    assert!(line.contains("not a model"), "{line}");
}

#[test]
fn the_job_name_cannot_leave_runs() {
    let job = Job::new("job-name");
    let cwd = job.dir.join("cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    for name in ["../../escaped", "/tmp/escaped", "a/b"] {
        let mut c = anneal();
        c.current_dir(&cwd)
            .arg("train")
            .arg(job.config())
            .args(["--set", &format!("job.name=\"{name}\"")]);
        let line = error_line(&run_within(c, 60), 2);
        assert!(line.contains("job.name"), "{line}");
    }
    let escaped = std::fs::read_dir(&job.dir)
        .unwrap()
        .filter_map(Result::ok)
        .any(|e| e.file_name().to_string_lossy().starts_with("escaped"));
    assert!(!escaped, "no run dir outside runs/");
    assert!(!cwd.join("runs").exists(), "nothing was created");
}

#[test]
fn errors_are_one_line_each_cause_once_with_the_right_exit_code() {
    let job = Job::new("messages");
    // A missing corpus: the OS error is said once.
    let line = error_line(&train(&job, "a", &["data.path=\"/nonexistent/corpus\""]), 2);
    assert!(line.contains("/nonexistent/corpus"), "{line}");
    // Damaged checkpoints and a load_step that does not exist: the user's to fix, said once.
    ok(&train(
        &job,
        "ckpt",
        &["training.steps=2", "checkpoint.interval=1"],
    ));
    let step = job.dir.join("ckpt/checkpoints/step-2/manifest.json");
    std::fs::write(&step, "garbage").unwrap();
    let line = error_line(&train(&job, "ckpt", &["checkpoint.load_step=2"]), 2);
    assert!(
        line.contains("step-2") && line.starts_with("error: checkpoint:"),
        "{line}"
    );
    let line = error_line(&train(&job, "ckpt", &["checkpoint.load_step=7"]), 2);
    assert!(line.contains("no checkpoint step-7"), "{line}");
    let line = error_line(
        &train(&job, "ckpt", &["training.seed=1", "training.steps=3"]),
        2,
    );
    assert!(line.contains("training.seed"), "{line}");
    // The wrong kind of value says "wrong type".
    let line = error_line(&train(&job, "a", &["training.steps=\"ten\""]), 2);
    assert!(line.contains("wrong type"), "{line}");
    // A missing model directory names it once.
    let mut c = anneal();
    c.args(["logprobs", "--tokens", "1,2", "--model-dir"])
        .arg(job.dir.join("no-such-model"));
    let line = error_line(&run_within(c, 60), 2);
    assert!(line.contains("no-such-model: no such directory"), "{line}");
    // A failure that is not the user's input exits 1: the server's registry is damaged.
    let home = job.dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::write(
        home.join("registry.sqlite"),
        "not a database, not a header either",
    )
    .unwrap();
    let mut c = anneal();
    c.args(["serve", "--addr", "127.0.0.1:0", "--home"])
        .arg(&home);
    error_line(&run_within(c, 60), 1);
    // Exactly what the plugin file is named after is opened: an unknown name lists the others.
    let line = error_line(&train(&job, "a", &["model.plugin=\"nope\""]), 2);
    assert!(
        line.contains(
            "found: adamw, deepseek_v3, deepseek_v4, gpt_oss, kimi_k3, llama, muon, muse, qwen3_5, sgd"
        ),
        "{line}"
    );
}

#[test]
fn logits_of_the_wrong_shape_are_an_error_not_a_crash() {
    let job = Job::new("bad-logits");
    let dir = badlogits_plugin_dir(&job.dir);
    for (flavor, code) in [("rank2", 1), ("narrow", 1), ("ok", 0)] {
        let mut c = Command::new(anneal_bin());
        c.env("ANNEAL_PLUGIN_PATH", &dir)
            .arg("train")
            .arg(job.config())
            .arg("--run-dir")
            .arg(job.dir.join(format!("run-{flavor}")))
            .args(["--set", "model.plugin=\"badlogits\""])
            .args(["--set", &format!("model.flavor=\"{flavor}\"")])
            .args(["--set", "training.steps=1"]);
        let out = run_within(c, 120);
        if code == 0 {
            ok(&out);
            continue;
        }
        let line = error_line(&out, code);
        assert!(
            line.contains("badlogits") && line.contains("logits of shape"),
            "{flavor}: {line}"
        );
    }
}

/// A plugin's typed errors decide the exit code: its refusal of the input is the user's to fix
/// (2, its message), its panic is its own bug (1, said so), and neither crashes the host.
#[test]
fn a_plugins_refusal_is_the_users_error_and_its_panic_is_its_bug() {
    let job = Job::new("plugin-error-kinds");
    let dir = badlogits_plugin_dir(&job.dir);
    for (flavor, code, says) in [
        (
            "refuse",
            2,
            "sequences longer than 4 tokens are not supported",
        ),
        ("panic", 1, "a bug in it, not in your input"),
    ] {
        let mut c = Command::new(anneal_bin());
        // A backtrace asked for is printed besides the error; the check is of the error alone.
        c.env("ANNEAL_PLUGIN_PATH", &dir)
            .env_remove("RUST_BACKTRACE")
            .arg("train")
            .arg(job.config())
            .arg("--run-dir")
            .arg(job.dir.join(format!("run-{flavor}")))
            .args(["--set", "model.plugin=\"badlogits\""])
            .args(["--set", &format!("model.flavor=\"{flavor}\"")])
            .args(["--set", "training.steps=1"]);
        let line = error_line(&run_within(c, 120), code);
        assert!(
            line.contains("badlogits") && line.contains(says),
            "{flavor}: {line}"
        );
        if flavor == "panic" {
            assert!(line.contains("deliberate panic in head"), "{line}");
        }
    }
}

#[test]
fn the_server_answers_bad_configs_and_sampling_with_4xx_not_500() {
    let home = temp_home("bad-input");
    let configs = tiny_configs(&home);
    let server = Server::start(&home, &["--configs", configs.to_str().expect("utf-8")]);
    let (code, body) = server.post(
        "/api/configs/validate",
        &json!({ "config": "[model]\nargs = { dim = nan }\n" }),
    );
    assert_eq!(code, 422, "{body}");
    assert_eq!(body["errors"][0]["key_path"], "model.args.dim", "{body}");
    let (code, body) = server.post(
        "/api/runs",
        &json!({ "name": "s", "config_path": "configs/tiny.toml",
                 "overrides": ["training.steps=1", "checkpoint.interval=1"] }),
    );
    assert_eq!(code, 201, "{body}");
    let id = body["id"].as_i64().expect("an id");
    let run = server.wait_status(id, &["completed", "failed"], Duration::from_secs(120));
    assert_eq!(run["status"], "completed", "{run}");
    let (code, body) = server.post(
        &format!("/api/runs/{id}/generate"),
        &json!({ "prompt_tokens": [1, 2, 3], "temperature": -1.0 }),
    );
    assert_eq!(code, 422, "{body}");
    let msg = body["error"].as_str().unwrap_or_default();
    assert!(msg.contains("temperature -1"), "{body}");
}

#[test]
fn rl_refuses_bad_input_with_the_key_and_exit_2() {
    let job = Job::new("rl");
    ok(&train(&job, "sft", &["training.steps=1"]));
    let reward = root().join("reward-wasm/examples/exact_match/reward.wat");
    let rl = |set: &[&str]| {
        let mut c = anneal();
        c.arg("rl")
            .arg(job.config())
            .arg("--run-dir")
            .arg(job.dir.join("rl"))
            .args(["--set", "training.steps=1"])
            .args([
                "--set",
                &format!(
                    "rl.tokenizer=\"{}\"",
                    job.dir.join("sft/tokenizer.json").display()
                ),
            ])
            .args([
                "--set",
                &format!("rl.rewards=[{{path=\"{}\"}}]", reward.display()),
            ]);
        for s in set {
            c.args(["--set", s]);
        }
        run_within(c, 120)
    };
    for (set, want) in [
        ("model.args.dim=4000000", "needs about"),
        (
            "rl.prompts_path=\"/nonexistent/prompts.jsonl\"",
            "`rl.prompts_path`",
        ),
        ("rl.init_from=\"/nonexistent/step-3\"", "`rl.init_from`"),
        (
            "rl.eval_prompts_path=\"/nonexistent/eval.jsonl\"",
            "`rl.eval_prompts_path`",
        ),
        (
            "rl.rewards=[{path=\"/nonexistent/r.wat\"}]",
            "`rl.rewards[0].path`",
        ),
    ] {
        let line = error_line(&rl(&[set]), 2);
        assert!(line.contains(want), "{set}: {line}");
        assert!(
            line.matches("/nonexistent/").count() <= 1,
            "the path once: {line}"
        );
    }
}

#[test]
fn an_moe_model_asking_for_more_experts_than_it_has_or_with_misshapen_experts_is_refused() {
    let job = Job::new("moe-args");
    let line = error_line(
        &train(
            &job,
            "topk",
            &[
                "model.flavor=\"debugmodel_qwen3_moe\"",
                "model.args.moe.top_k=9",
            ],
        ),
        2,
    );
    assert!(
        line.contains("moe.top_k") && line.contains("more experts per token"),
        "{line}"
    );
    // gpt-oss names its own key.
    let config = job.config_with_model(
        "gpt_oss",
        "gpt_oss",
        "{ dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, head_dim = 16, vocab_size = 320, \
         max_seq_len = 64, top_k = 9 }",
    );
    let mut cmd = anneal();
    cmd.arg("train")
        .arg(&config)
        .arg("--run-dir")
        .arg(job.dir.join("topk-gpt-oss"));
    let line = error_line(&run_within(cmd, 120), 2);
    assert!(
        line.contains("top_k") && line.contains("more experts per token"),
        "{line}"
    );
    // DeepSeek-V3 names the group keys.
    let config = job.config_with_model(
        "deepseek_v3",
        "deepseek_v3",
        "{ dim = 32, n_layers = 2, n_heads = 2, vocab_size = 320, max_seq_len = 64, \
         kv_lora_rank = 8, qk_nope_head_dim = 8, qk_rope_head_dim = 4, v_head_dim = 8, \
         ffn_dim = 64, n_experts = 4, top_k = 2, expert_ffn_dim = 16, n_group = 2, topk_group = 3 }",
    );
    let mut cmd = anneal();
    cmd.arg("train")
        .arg(&config)
        .arg("--run-dir")
        .arg(job.dir.join("groups"));
    let line = error_line(&run_within(cmd, 120), 2);
    assert!(
        line.contains("topk_group (3) must not exceed n_group (2)"),
        "{line}"
    );
    // Transformers checkpoints whose experts have the wrong shape: Qwen3-MoE's expert 2 up
    // projection (stacked per expert) and gpt-oss's fused gate/up tensor.
    for (fixture_name, bad, shape) in [
        (
            "tiny_qwen3_moe",
            "model.layers.0.mlp.experts.2.up_proj.weight",
            vec![40, 64],
        ),
        (
            "tiny_gpt_oss",
            "model.layers.1.mlp.experts.gate_up_proj",
            vec![4, 64, 78],
        ),
    ] {
        let line = logprobs_with_tensor(&job, fixture_name, bad, &shape);
        let shown = format!("{shape:?}");
        assert!(line.contains(bad) && line.contains(&shown), "{line}");
    }
}

/// The error line of `anneal logprobs` on a copy of fixture `name` whose tensor `bad` is
/// replaced by zeros of `shape`.
fn logprobs_with_tensor(job: &Job, name: &str, bad: &str, shape: &[usize]) -> String {
    let dir = job.dir.join(format!("hf-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture(name);
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut tensors = anneal_engine::io::load_safetensors(src.join("model.safetensors")).unwrap();
    tensors.insert(
        bad.to_string(),
        anneal_engine::Tensor::zeros(shape, anneal_engine::DType::F32),
    );
    let named: Vec<(&str, &anneal_engine::Tensor)> =
        tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    anneal_engine::io::save_safetensors(dir.join("model.safetensors"), &named).unwrap();
    let mut cmd = anneal();
    cmd.args(["logprobs", "--tokens", "1,2,3", "--model-dir"])
        .arg(&dir);
    error_line(&run_within(cmd, 60), 2)
}

#[test]
fn a_corrupt_safetensors_header_names_the_tensor_and_the_file() {
    let job = Job::new("bad-header");
    let src = fixture("tiny_llama");
    let dir = job.dir.join("hf-bad-header");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let name = header
        .as_object()
        .unwrap()
        .keys()
        .find(|k| *k != "__metadata__")
        .unwrap()
        .clone();
    let end = header[&name]["data_offsets"][1].as_u64().unwrap();
    for (field, value, words) in [
        (
            "data_offsets",
            json!([0, data.len() + 1000]),
            "outside the".to_string(),
        ),
        ("dtype", json!("F99"), "unknown dtype".to_string()),
        ("shape", json!([end + 1]), "needs".to_string()),
    ] {
        let mut h = header.clone();
        h[&name][field] = value;
        let text = h.to_string().into_bytes();
        let file = [&(text.len() as u64).to_le_bytes()[..], &text, data].concat();
        std::fs::write(dir.join("model.safetensors"), file).unwrap();
        let mut cmd = anneal();
        cmd.args(["logprobs", "--tokens", "1,2,3", "--model-dir"])
            .arg(&dir);
        let line = error_line(&run_within(cmd, 60), 2);
        assert!(
            line.contains("model.safetensors")
                && line.contains(&format!("tensor `{name}`"))
                && line.contains(&words),
            "{field}: {line}"
        );
    }
}
