//! The browser UI in real headless Chromium: `web/tests/browser.mjs` (playwright-core) drives a
//! real `anneal serve` with real training runs (and samples from a real checkpoint), then RL
//! runs started from the form with uploaded reward modules, their charts, samples view and
//! comparison, the charts' axes and their controls (smoothing, a step / tokens / wall-time x
//! axis, log scale, kept over a reload and on the compare page); last, a multi-turn RL run (the
//! calculator environment, a policy warm-started on tool-call transcripts) whose samples show
//! turn by turn. The server serves a copy of `web/` without `node_modules`: the UI must work
//! with nothing installed, as after the README's first command. The test itself needs Debian's
//! `chromium`, playwright-core in `web/node_modules` and the calculator environment
//! `reward-wasm/out/env_calculator.wasm` (all three installed by `scripts/setup.sh`), and
//! `python3` for `scripts/tool-data.py`. Screenshots land in `web/tests/screenshots/`.

use anneal_tests::serve as serve_common;

use anneal_tests::cli::{anneal, ok};
use serde_json::json;
use serve_common::{add_rl_config, repo, temp_home, tiny_configs, Server, LENGTH_PARITY_WAT};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

#[test]
fn the_ui_creates_watches_stops_resumes_and_compares_training_and_rl_runs() {
    let root = repo();
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let playwright = root.join("web/node_modules/playwright-core");
    assert!(
        std::path::Path::new(&chromium).exists() && playwright.is_dir(),
        "the browser test needs {chromium} and web/node_modules (run scripts/setup.sh)"
    );
    let home = temp_home("browser");
    let configs = tiny_configs(&home);
    add_rl_config(&configs);
    let parity = home.join("length_parity.wat");
    std::fs::write(&parity, LENGTH_PARITY_WAT).expect("write the reward module");
    let rl_rewards = format!(
        "{}\n{}",
        root.join("reward-wasm/examples/position_match/reward.wat")
            .display(),
        parity.display()
    );
    let web = home.join("web");
    copy_ui(&root.join("web"), &web);
    let server = Server::start(
        &home,
        &[
            "--configs",
            configs.to_str().expect("utf-8"),
            "--max-running",
            "2",
            "--web",
            web.to_str().expect("utf-8"),
        ],
    );
    let tools_run = multi_turn_run(&server, &root, &home);
    let shots = root.join("web/tests/screenshots");
    let out = Command::new("node")
        .arg(root.join("web/tests/browser.mjs"))
        .arg(server.url())
        .arg(&shots)
        .current_dir(root.join("web"))
        .env("CHROMIUM", &chromium)
        // Long enough to be stopped mid-way (log every 5 steps to keep the page light).
        .env(
            "ANNEAL_LONG_OVERRIDES",
            "training.steps=1000000\nmetrics.log_freq=5\nmetrics.eval_freq=50",
        )
        .env(
            "ANNEAL_SHORT_OVERRIDES",
            "training.steps=30\nmetrics.eval_freq=10",
        )
        .env("ANNEAL_BAD_OVERRIDE", "training.steps=\"many\"")
        .env("ANNEAL_BAD_KEY", "training.steps")
        .env(
            "ANNEAL_REWARD_MODULE",
            root.join("reward-wasm/examples/wat/reward.wat"),
        )
        .env("ANNEAL_RL_REWARDS", &rl_rewards)
        .env("ANNEAL_TOOLS_RUN", tools_run.to_string())
        .output()
        .expect("run node (install Node.js)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for shot in [
        "01-new-run-invalid",
        "02-run-live",
        "04-compare",
        "05-runs-table",
        "08-new-rl-run",
        "09-rl-run",
        "10-rl-samples",
        "11-rl-compare",
        "12-chart-axes",
        "14-chart-controls",
        "13-rl-turns",
    ] {
        assert!(shots.join(format!("{shot}.png")).is_file(), "{shot}.png");
    }
}

/// A multi-turn RL run, finished before the browser opens it: a tiny Llama warm-started with
/// `anneal train` on the tool-use demo's transcripts (`scripts/tool-data.py`: ask, call the
/// calculator, copy its answer), then three steps of GRPO in the calculator environment
/// (`rl.environment`, arithmetic questions, 3 turns), created through the API so the server
/// runs `anneal rl`. Its policy half-learned the format, so its episodes mix well-formed tool
/// calls answered by the tool, unreadable ones, and ones that never close; every fourth task
/// lacks the calculator's `question`, so those episodes fail to start. Every sample is written
/// with its turns.
fn multi_turn_run(server: &Server, root: &Path, home: &Path) -> i64 {
    let env = root.join("reward-wasm/out/env_calculator.wasm");
    assert!(
        env.is_file(),
        "the browser test needs {} (run scripts/setup.sh, or bash reward-wasm/build-envs.sh calculator)",
        env.display()
    );
    let data = home.join("tool-data");
    let out = Command::new("python3")
        .arg(root.join("scripts/tool-data.py"))
        .args([data.to_str().expect("utf-8"), "200", "1"])
        .output()
        .expect("run python3");
    ok(&out);
    let model = "args = { dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 4, ffn_dim = 128, vocab_size = 1024, max_seq_len = 320 }";
    let sft = format!(
        r#"[model]
plugin = "llama"
flavor = "debugmodel"
{model}
[optimizer]
plugin = "adamw"
lr = 1e-2
[lr_scheduler]
warmup_steps = 5
[training]
steps = 300
batch_size = 8
micro_batch_size = 8
seq_len = 256
seed = 3
[checkpoint]
interval = 300
[data]
path = "{data}"
format = "chat"
tokenizer = "train"
vocab_size = 1024
val_fraction = 0.0
cache_dir = "{cache}"
[metrics]
log_freq = 50
eval_freq = 1000
progress_bar = false
"#,
        data = data.join("tools.jsonl").display(),
        cache = home.join("tool-cache").display()
    );
    let sft_config = home.join("tools_sft.toml");
    std::fs::write(&sft_config, sft).expect("write the warm start's config");
    let sft_dir = home.join("tools-sft");
    ok(&anneal()
        .arg("train")
        .arg(&sft_config)
        .arg("--run-dir")
        .arg(&sft_dir)
        .output()
        .expect("run anneal train"));
    // The arithmetic task's questions, every fourth without the `question` the calculator
    // needs: its episodes fail to start (an `env_error`), so some episode fails whatever the
    // half-trained policy writes.
    let prompts = home.join("tool-prompts.jsonl");
    let lines: Vec<String> = (0..16u64)
        .map(|i| {
            let (question, answer) = anneal_rl::rollout::arithmetic_task(5, i);
            let metadata = match i % 4 {
                3 => serde_json::json!({ "answer": answer }),
                _ => serde_json::json!({ "question": question, "answer": answer }),
            };
            serde_json::json!({ "prompt": question, "metadata": metadata }).to_string()
        })
        .collect();
    std::fs::write(&prompts, lines.join("\n")).expect("write the prompts");
    let rl = format!(
        r#"[job]
name = "rl_tools_tiny"
[model]
plugin = "llama"
flavor = "debugmodel"
{model}
[optimizer]
plugin = "adamw"
lr = 1e-3
[lr_scheduler]
warmup_steps = 0
decay = "constant"
[training]
steps = 3
seed = 5
[metrics]
log_freq = 1
progress_bar = false
[rl]
init_from = "{init}"
prompts_path = "{prompts}"
environment = "{env}"
max_turns = 3
max_new_tokens = 32
max_episode_tokens = 320
prompts_per_step = 4
group_size = 4
temperature = 0.7
error_reward = 0.0
eval_freq = 0
samples_every = 1
samples_per_step = 16
"#,
        init = sft_dir.join("checkpoints/step-300").display(),
        prompts = prompts.display(),
        env = env.display()
    );
    let (code, made) = server.post(
        "/api/runs",
        &json!({"name": "browser-rl-tools", "config": rl}),
    );
    assert_eq!(code, 201, "{made}");
    let id = made["id"].as_i64().expect("the run's id");
    server.wait_status(id, &["completed"], Duration::from_secs(300));
    // The samples API hands each episode's turns through as the run wrote them.
    let (code, page) = server.get(&format!("/api/runs/{id}/samples?limit=500"));
    assert_eq!(code, 200, "{page}");
    let samples = page["samples"].as_array().expect("samples");
    assert_eq!(samples.len(), 48, "{page}");
    let turns = |s: &serde_json::Value| s["turns"].as_array().cloned().unwrap_or_default();
    assert!(
        samples
            .iter()
            .all(|s| turns(s).first().is_some_and(|t| t["role"] == "prompt")),
        "every sample has turns, the prompt first: {page}"
    );
    assert!(
        samples
            .iter()
            .any(|s| turns(s).iter().any(|t| t["role"] == "tool")),
        "some episode called the tool: {page}"
    );
    assert!(
        samples
            .iter()
            .any(|s| turns(s).iter().any(|t| t["error"].is_string())),
        "some episode failed: {page}"
    );
    id
}

/// Copies the UI's files (not `node_modules`, not the tests) from `from` to `to`.
fn copy_ui(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("create the UI copy");
    for entry in std::fs::read_dir(from).expect("read web/") {
        let entry = entry.expect("a web/ entry");
        let name = entry.file_name();
        if name == "node_modules" || name == "tests" {
            continue;
        }
        if entry.file_type().expect("file type").is_dir() {
            copy_ui(&entry.path(), &to.join(&name));
        } else {
            std::fs::copy(entry.path(), to.join(&name)).expect("copy a UI file");
        }
    }
}
