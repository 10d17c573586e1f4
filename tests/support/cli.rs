//! The repository root, the `anneal` binary with its plugins, and tiny training jobs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The folder of this test's profile (`target/<profile>/`), after building the `anneal` binary
/// and every plugin crate of the workspace in it, once per test process (a nested `cargo build`
/// with the running test's profile, so nothing is built twice).
pub fn built_dir() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        // A test runs as target/<profile>/deps/<test>-<hash>.
        let exe = std::env::current_exe().expect("the test's own path");
        let out_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("tests run from target/<profile>/deps")
            .to_path_buf();
        let profile = match out_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev".to_string(),
            Some(p) => p.to_string(),
        };
        // Every library (each plugin's cdylib among them) and binary of the workspace but this
        // test crate (whose dependencies would change the features the others build with), so
        // a new plugin is there without being listed here.
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(["build", "--profile", &profile, "--workspace", "--exclude"]);
        cargo.args(["anneal-tests", "--lib", "--bins"]);
        let ok = cargo
            .current_dir(root())
            .status()
            .expect("run cargo")
            .success();
        assert!(ok, "building anneal and its plugins failed");
        out_dir
    })
}

/// The `anneal` binary (see [`built_dir`]).
pub fn anneal_bin() -> PathBuf {
    built_dir().join("anneal")
}

/// A command running the `anneal` binary (see [`anneal_bin`]), with no plugin path from the
/// environment.
pub fn anneal() -> Command {
    let mut c = Command::new(anneal_bin());
    c.env_remove("ANNEAL_PLUGIN_PATH");
    c
}

/// A small English corpus in `dir`: four documents of 600 short lines built from a few phrases,
/// enough for a tiny Llama to learn something in a few steps.
pub fn write_tiny_corpus(dir: &Path) {
    std::fs::create_dir_all(dir).expect("corpus dir");
    let subjects = [
        "the king",
        "a fool",
        "my lord",
        "the queen",
        "this night",
        "our town",
    ];
    let verbs = [
        "speaks of",
        "waits for",
        "dreams of",
        "forgets",
        "remembers",
        "calls",
    ];
    let objects = [
        "the sea.",
        "his crown.",
        "a storm.",
        "the moon.",
        "her honour.",
        "old wine.",
    ];
    for doc in 0..4 {
        let mut text = String::new();
        for i in 0..600usize {
            let k = i * 7 + doc * 3;
            text.push_str(&format!(
                "{} {} {}\n",
                subjects[k % 6],
                verbs[(k / 6) % 6],
                objects[(k / 36) % 6]
            ));
        }
        std::fs::write(dir.join(format!("doc{doc}.txt")), text).unwrap();
    }
}

/// `tiny.toml`: a 41k-parameter Llama trained on the corpus in `corpus` (tokenizer vocab 320,
/// batch 4 × 32), logging every step and evaluating every `eval_freq` steps.
pub fn tiny_config_toml(corpus: &Path, cache: &Path, steps: u64, eval_freq: u64) -> String {
    format!(
        r#"[job]
name = "tiny"
[model]
plugin = "llama"
flavor = "debugmodel"
args = {{ dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, ffn_dim = 64, vocab_size = 320, max_seq_len = 64 }}
[optimizer]
plugin = "adamw"
lr = 1e-2
[lr_scheduler]
warmup_steps = 2
[training]
steps = {steps}
batch_size = 4
micro_batch_size = 4
seq_len = 32
seed = 7
[data]
path = "{corpus}"
tokenizer = "train"
vocab_size = 320
cache_dir = "{cache}"
val_fraction = 0.1
[metrics]
log_freq = 1
eval_freq = {eval_freq}
eval_batches = 2
peak_tflops = 1.0
progress_bar = false
"#,
        corpus = corpus.display(),
        cache = cache.display()
    )
}

/// A folder under `dir` to put on `ANNEAL_PLUGIN_PATH`: it holds the test plugin of
/// plugins/test-bad-logits under the name the host looks `badlogits` up by.
pub fn badlogits_plugin_dir(dir: &Path) -> PathBuf {
    let dir = dir.join("badlogits-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("libanneal_plugin_badlogits.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(
        built_dir().join("libanneal_testplugin_bad_logits.so"),
        &link,
    )
    .unwrap();
    dir
}

/// A fresh folder with a small English corpus and a config for a tiny Llama trained on it.
pub struct Job {
    /// The folder (corpus, cache, config, run dirs).
    pub dir: PathBuf,
}

impl Job {
    /// Writes the corpus and `tiny.toml`.
    pub fn new(name: &str) -> Job {
        let dir = std::env::temp_dir().join(format!("anneal-train-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("corpus")).unwrap();
        write_tiny_corpus(&dir.join("corpus"));
        let config = tiny_config_toml(&dir.join("corpus"), &dir.join("cache"), 8, 4);
        std::fs::write(dir.join("tiny.toml"), config).unwrap();
        Job { dir }
    }

    /// The config file.
    pub fn config(&self) -> PathBuf {
        self.dir.join("tiny.toml")
    }

    /// `tiny.toml` with another model: the `[model]` section's plugin and args replaced
    /// (`args` as an inline TOML table), written as `<name>.toml`.
    pub fn config_with_model(&self, name: &str, plugin: &str, args: &str) -> PathBuf {
        let toml = std::fs::read_to_string(self.config()).unwrap();
        let model: String = toml
            .lines()
            .map(|l| {
                if l.starts_with("plugin = \"llama\"") {
                    format!("plugin = \"{plugin}\"\n")
                } else if l.starts_with("args = { dim") {
                    format!("args = {args}\n")
                } else {
                    format!("{l}\n")
                }
            })
            .collect();
        let path = self.dir.join(format!("{name}.toml"));
        std::fs::write(&path, model).unwrap();
        path
    }

    /// Starts `anneal train` in `run_dir` in the background, with extra environment variables
    /// and its output piped.
    pub fn spawn(&self, run_dir: &Path, set: &[&str], env: &[(&str, &str)]) -> Child {
        let mut c = anneal();
        c.arg("train")
            .arg(self.config())
            .arg("--run-dir")
            .arg(run_dir);
        for s in set {
            c.args(["--set", s]);
        }
        for (k, v) in env {
            c.env(k, v);
        }
        c.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn anneal")
    }

    /// Runs `anneal train` to the end in `<dir>/<run>`.
    pub fn train(&self, run: &str, set: &[&str]) -> (Output, PathBuf) {
        let run_dir = self.dir.join(run);
        let mut c = anneal();
        c.arg("train")
            .arg(self.config())
            .arg("--run-dir")
            .arg(&run_dir);
        for s in set {
            c.args(["--set", s]);
        }
        (c.output().expect("run anneal"), run_dir)
    }
}

/// The rows of `metrics.jsonl`.
pub fn rows(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

/// The logged training losses as bits.
pub fn losses(run_dir: &Path) -> Vec<u64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["loss"].as_f64())
        .map(f64::to_bits)
        .collect()
}

/// Asserts a command succeeded (showing its output otherwise) and returns its stdout.
pub fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {stdout}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Asserts a command succeeded and parses its stdout as one JSON object.
pub fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_str(&ok(out)).expect("one JSON object")
}

/// A JSON array of numbers.
pub fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

/// Asserts exit code `code` and exactly one `error:` line on stderr; returns that line.
pub fn error_line(out: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(code), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "one error line: {stderr}");
    lines[0].to_string()
}

/// Asserts exit code 2 and an `error: ` line that names every one of `needles`.
pub fn user_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line in {stderr}"));
    for n in needles {
        assert!(line.contains(n), "{n} not in {line}");
    }
}

/// `anneal info`'s `cuda backend:` line.
pub fn cuda_backend_line() -> String {
    let out = anneal().arg("info").output().expect("anneal info");
    ok(&out);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with("cuda backend:"))
        .unwrap_or("cuda backend: not reported")
        .to_string()
}

/// `None` when CUDA device 0 runs here, else why not (from `anneal info`). Under
/// `ANNEAL_REQUIRE_CUDA=1` (scripts/test.sh runs the CUDA tests on the CPU's emulation of a GPU
/// and requires it) a missing GPU fails instead.
pub fn no_gpu() -> Option<String> {
    let line = cuda_backend_line();
    if line.starts_with("cuda backend: cuda on ") {
        return None;
    }
    assert!(
        std::env::var("ANNEAL_REQUIRE_CUDA").as_deref() != Ok("1"),
        "ANNEAL_REQUIRE_CUDA=1 but {line}"
    );
    Some(line)
}

/// GPUs on this machine as `anneal info` reports them (`…, N devices)`), 1 when it does not say.
pub fn gpus_here() -> usize {
    cuda_backend_line()
        .rsplit_once(", ")
        .and_then(|(_, n)| n.strip_suffix(" devices)")?.parse().ok())
        .unwrap_or(1)
}

/// On the transformers checkpoint `dir`: `anneal logprobs` on `tokens` prints `want` (the
/// fixture's log-probabilities, within 1e-4), and `anneal generate` from the first `prompt`
/// tokens (`new` tokens at temperature 0.8 with `seed`) gives the log-probabilities the
/// training forward then computes for them, bit for bit.
pub fn assert_logprobs_and_decode(
    dir: &Path,
    tokens: &[i64],
    want: &[f32],
    [prompt, new]: [usize; 2],
    seed: u64,
) {
    let join = |ids: &[i64]| {
        ids.iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let logprobs = |ids: &[i64]| {
        let out = anneal()
            .args(["logprobs", "--model-dir"])
            .arg(dir)
            .args(["--tokens", &join(ids)])
            .output()
            .unwrap();
        floats(&json_of(&out)["logprobs"])
    };
    let got = logprobs(tokens);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - *w as f64).abs() < 1e-4, "token {i}: {g} vs {w}");
    }
    let prompt = &tokens[..prompt];
    let g = json_of(
        &anneal()
            .args(["generate", "--model-dir"])
            .arg(dir)
            .args(["--prompt-tokens", &join(prompt)])
            .args(["--max-new-tokens", &new.to_string()])
            .args(["--temperature", "0.8", "--seed", &seed.to_string()])
            .output()
            .unwrap(),
    );
    let generated: Vec<i64> = g["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect();
    assert_eq!(generated.len(), new, "{g}");
    let mut all = prompt.to_vec();
    all.extend(&generated);
    assert_eq!(
        logprobs(&all)[prompt.len() - 1..],
        floats(&g["logprobs"])[..]
    );
}
