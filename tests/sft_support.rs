//! What the chat fine-tuning tests share: the tiny Qwen3 fixture, a job folder fine-tuning it
//! on its own chat data, and a run of it.

#![allow(dead_code)] // Each test file that includes this uses part of it.

use anneal_tests::cli as common;

use common::{anneal, ok};
use std::path::{Path, PathBuf};

/// The tiny Qwen3 saved by transformers, with its tokenizer, template and chat data.
pub fn fixture() -> PathBuf {
    common::root().join("host/runtime/tests/fixtures/tiny_qwen3_chat")
}

/// A folder with `chat.jsonl` (the fixture's, with `edit` applied to its text) and a config
/// fine-tuning the fixture's checkpoint on it.
pub fn job(name: &str, edit: impl Fn(String) -> String) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("anneal-sft-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let chat = std::fs::read_to_string(fixture().join("chat.jsonl")).unwrap();
    std::fs::write(dir.join("chat.jsonl"), edit(chat)).unwrap();
    let config = format!(
        r#"[job]
name = "sft"
[model]
plugin = ""
[optimizer]
plugin = "adamw"
lr = 3e-3
[lr_scheduler]
warmup_steps = 2
[training]
steps = 2
batch_size = 4
micro_batch_size = 4
seq_len = 96
seed = 3
[data]
path = "{data}"
format = "chat"
shuffle = false
val_fraction = 0.0625
cache_dir = "{cache}"
[checkpoint]
init_from_hf = "{hf}"
[metrics]
log_freq = 1
eval_freq = 2
eval_batches = 4
progress_bar = false
"#,
        data = dir.join("chat.jsonl").display(),
        cache = dir.join("cache").display(),
        hf = fixture().display(),
    );
    std::fs::write(dir.join("sft.toml"), config).unwrap();
    dir
}

/// Runs `anneal train` on the folder's config with `--set` overrides, to success.
pub fn train(dir: &Path, run: &str, set: &[&str]) -> PathBuf {
    let run_dir = dir.join(run);
    let mut c = anneal();
    c.arg("train")
        .arg(dir.join("sft.toml"))
        .arg("--run-dir")
        .arg(&run_dir);
    for s in set {
        c.args(["--set", s]);
    }
    ok(&c.output().expect("run anneal"));
    run_dir
}

/// The held-out loss of the job's data under the Hugging Face checkpoint `hf`: a one-step run
/// started from it with a zero learning rate, evaluated at once (packed).
pub fn held_out_loss_of(dir: &Path, hf: &Path) -> f64 {
    let from = format!("checkpoint.init_from_hf=\"{}\"", hf.display());
    let run = train(
        dir,
        "again",
        &[
            "training.steps=1",
            "optimizer.lr=0.0",
            "metrics.eval_freq=1",
            "data.pack=true",
            &from,
        ],
    );
    common::rows(&run)
        .iter()
        .find_map(|r| r["val_loss"].as_f64())
        .expect("a held-out loss")
}

/// Runs the job's config with `--set` overrides and checks that it is refused as bad input,
/// its error line holding every one of `needles`.
pub fn refused(dir: &Path, set: &[&str], needles: &[&str]) {
    let mut c = anneal();
    c.arg("train")
        .arg(dir.join("sft.toml"))
        .arg("--run-dir")
        .arg(dir.join("refused"));
    for s in set {
        c.args(["--set", s]);
    }
    common::user_error(&c.output().unwrap(), needles);
}
