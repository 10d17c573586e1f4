//! The browser UI in real headless Chromium: `web/tests/browser.mjs` (playwright-core) drives a
//! real `anneal serve` with real training runs (and samples from a real checkpoint), then RL
//! runs started from the form with uploaded reward modules, their charts, samples view and
//! comparison, and the charts' axes. The server serves a copy of `web/` without `node_modules`:
//! the UI must work with nothing installed, as after the README's first command. The test itself
//! needs Debian's `chromium` and playwright-core in `web/node_modules` (both installed by
//! `scripts/setup.sh`). Screenshots land in `web/tests/screenshots/`.

use anneal_tests::serve as serve_common;

use serve_common::{add_rl_config, repo, temp_home, tiny_configs, Server, LENGTH_PARITY_WAT};
use std::process::Command;

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
    ] {
        assert!(shots.join(format!("{shot}.png")).is_file(), "{shot}.png");
    }
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
