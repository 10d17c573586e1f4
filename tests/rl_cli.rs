//! `anneal rl` end to end on a tiny Llama with a WebAssembly reward: a run cut short and
//! continued in the same run dir logs exactly the metrics of an uninterrupted one, and its
//! checkpoints serve export, generation and a later run's `rl.init_from`; reward calls that trap
//! or never return are counted per kind while the run completes; `samples.jsonl` records each
//! module's score and error, stays bounded, and is cut back to the checkpoint on resume.

use anneal_tests::cli as common;

mod rl_support;

use common::{anneal, ok, rows, user_error};
use rl_support::{digits_tokenizer, fresh_dir};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;

/// Core-module reward (ABI v1): the completion's length in bytes when its first byte and the
/// prompt's differ in parity, else 0 (so held-out accuracy, the share of positive rewards, is
/// neither 0 nor 1); a prompt starting with `t` traps (`unreachable`), one starting with `l`
/// loops until the sandbox stops it.
const REWARD_WAT: &str = r#"(module
  (memory (export "memory") 1)
  (global $next (mut i32) (i32.const 1024))
  (func (export "alloc") (param $len i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $next))
    (global.set $next (i32.add (global.get $next) (local.get $len)))
    (local.get $p))
  (func (export "score")
    (param $pp i32) (param $pl i32) (param $cp i32) (param $cl i32) (param $mp i32) (param $ml i32)
    (result f64)
    (if (i32.eq (i32.load8_u (local.get $pp)) (i32.const 116)) (then unreachable))
    (if (i32.eq (i32.load8_u (local.get $pp)) (i32.const 108)) (then (loop $spin (br $spin))))
    (f64.convert_i32_u
      (i32.mul
        (i32.and
          (i32.add (i32.load8_u (local.get $cp)) (i32.load8_u (local.get $pp)))
          (i32.const 1))
        (local.get $cl))))
  (func (export "anneal_reward_abi") (result i32) (i32.const 1)))
"#;

/// Metrics that measure time, not what was computed.
const TIMING: [&str; 7] = [
    "t_rollout",
    "t_reward",
    "t_train",
    "t_wait",
    "samples_per_s",
    "time",
    "wall_time",
];

/// A folder with a tokenizer, the reward module and `rl.toml`: 8 synchronous GRPO steps of
/// 2 prompts x 4 samples from fresh weights, with a KL penalty, held-out evaluation every 2
/// steps and a checkpoint every 3.
struct RlJob {
    dir: PathBuf,
}

impl RlJob {
    /// Digit-sorting prompts, or the given ones (`prompts`, cycled in order).
    fn new(name: &str, prompts: Option<&[&str]>) -> RlJob {
        let dir = fresh_dir(&format!("anneal-rl-cli-{name}"));
        digits_tokenizer(&dir.join("tokenizer.json"), 99, 200, 260);
        std::fs::write(dir.join("reward.wat"), REWARD_WAT).unwrap();
        let prompts_line = match prompts {
            Some(list) => {
                let lines: String = list
                    .iter()
                    .map(|p| format!("{}\n", serde_json::json!({ "prompt": p })))
                    .collect();
                std::fs::write(dir.join("prompts.jsonl"), lines).unwrap();
                format!("prompts_path = \"{}\"", dir.join("prompts.jsonl").display())
            }
            None => String::new(),
        };
        let config = format!(
            r#"[job]
name = "rl-tiny"
[model]
plugin = "llama"
flavor = "debugmodel"
args = {{ dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, ffn_dim = 64, vocab_size = 272, max_seq_len = 64 }}
[optimizer]
plugin = "adamw"
lr = 1e-2
[lr_scheduler]
warmup_steps = 0
decay = "constant"
[training]
steps = 8
seed = 5
[checkpoint]
interval = 3
[metrics]
log_freq = 1
progress_bar = false
[rl]
tokenizer = "{tok}"
{prompts_line}
group_size = 4
prompts_per_step = 2
max_new_tokens = 6
rewards = [{{ path = "{reward}", weight = 1.0 }}]
error_reward = -1.0
reward_timeout_ms = 30
kl_coef = 0.05
max_staleness = 0
rollout_threads = 1
eval_freq = 2
eval_prompts = 8
samples_every = 2
samples_per_step = 6
"#,
            tok = dir.join("tokenizer.json").display(),
            reward = dir.join("reward.wat").display(),
        );
        std::fs::write(dir.join("rl.toml"), config).unwrap();
        RlJob { dir }
    }

    /// Runs `anneal rl` to the end in `<dir>/<run>`.
    fn run(&self, run: &str, set: &[&str]) -> (Output, PathBuf) {
        let run_dir = self.dir.join(run);
        let mut c = anneal();
        c.arg("rl")
            .arg(self.dir.join("rl.toml"))
            .arg("--run-dir")
            .arg(&run_dir);
        for s in set {
            c.args(["--set", s]);
        }
        (c.output().expect("run anneal"), run_dir)
    }
}

/// The rows of `metrics.jsonl` without the timing fields.
fn computed_rows(run_dir: &Path) -> Vec<Value> {
    rows(run_dir)
        .into_iter()
        .map(|mut r| {
            let obj = r.as_object_mut().expect("a row is an object");
            for k in TIMING {
                obj.remove(k);
            }
            r
        })
        .collect()
}

/// The rows of `samples.jsonl`.
fn samples(run_dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(run_dir.join("samples.jsonl"))
        .expect("samples.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn a_run_cut_short_resumes_with_identical_metrics_and_checkpoints_serve_later_runs() {
    let job = RlJob::new("resume", None);
    let (out, reference) = job.run("reference", &[]);
    ok(&out);
    let want = computed_rows(&reference);
    let steps: Vec<u64> = want.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(
        steps,
        (0..=8).collect::<Vec<_>>(),
        "step 0 is the first evaluation"
    );
    assert!(want.iter().any(|r| r["grad_norm"].as_f64() > Some(0.0)));

    // Samples of steps 1, 2, 4, 6 and 8 (`samples_every = 2`), 6 of each step's 8.
    let want_samples = samples(&reference);
    let sample_steps: Vec<u64> = want_samples
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    let expected: Vec<u64> = [1, 2, 4, 6, 8].iter().flat_map(|&s| [s; 6]).collect();
    assert_eq!(sample_steps, expected);
    let first = &want_samples[0];
    assert!(first["prompt"].as_str().unwrap().ends_with('='), "{first}");
    assert!(first["completion"].is_string() && first["reward"].is_number());
    assert_eq!(first["scores"][0]["name"], "reward.wat");
    assert_eq!(first["scores"][0]["weight"], 1.0);
    assert_eq!(first["scores"][0]["score"], first["reward"]);
    assert_eq!(first["scores"][0]["error"], Value::Null);

    // Stopped after step 4 (its last step, so saved), then continued by a longer command.
    let (out, run) = job.run("resumed", &["training.steps=4"]);
    ok(&out);
    assert!(run.join("checkpoints/step-4").is_dir());
    // Samples a process wrote after its last checkpoint before dying are dropped on resume.
    let mut partial = std::fs::read_to_string(run.join("samples.jsonl")).unwrap();
    partial.push_str("{\"step\":6,\"prompt\":\"written after the checkpoint\"}\n");
    std::fs::write(run.join("samples.jsonl"), partial).unwrap();
    let (out, _) = job.run("resumed", &[]);
    let stdout = ok(&out);
    let resumed_from = format!(
        "resuming from {} (step 4)",
        run.join("checkpoints/step-4").display()
    );
    assert!(stdout.contains(&resumed_from), "{stdout}");
    assert_eq!(
        computed_rows(&run),
        want,
        "the resumed run's metrics differ"
    );
    assert_eq!(
        samples(&run),
        want_samples,
        "the resumed run's samples differ"
    );

    // keep_latest = 3 of the saves at 3, 4, 6 and 8.
    let mut saved: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    saved.sort();
    assert_eq!(saved, ["step-4", "step-6", "step-8"]);
    let last = run.join("checkpoints/step-8");
    let names: Vec<String> = json(&last.join("manifest.json"))["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect();
    for prefix in ["model/", "optim/", "ref/"] {
        assert!(
            names.iter().any(|n| n.starts_with(prefix)),
            "{prefix}* in {names:?}"
        );
    }
    let state = json(&last.join("train_state.json"));
    assert_eq!(state["step"], 8);
    assert_eq!(state["rl"]["next_prompt"], 16, "8 steps of 2 prompts");
    assert_eq!(state["rl"]["samples"], 64);
    assert!(run.join("tokenizer.json").is_file());

    // The checkpoint exports to a Hugging Face directory that generates text.
    let hf = job.dir.join("hf");
    ok(&anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(&hf)
        .arg(&last)
        .output()
        .unwrap());
    ok(&anneal()
        .args(["generate", "--model-dir"])
        .arg(&hf)
        .arg("--tokenizer")
        .arg(hf.join("tokenizer.json"))
        .args(["--prompt", "4213=", "--max-new-tokens", "4"])
        .output()
        .unwrap());

    // A later run starts from it (the tokenizer found next to the checkpoints): its step-0
    // evaluation is the evaluation of step 8.
    let init_from = format!("rl.init_from=\"{}\"", last.display());
    let (out, next) = job.run(
        "next",
        &[&init_from, "rl.tokenizer=\"\"", "training.steps=1"],
    );
    assert!(ok(&out).contains("policy: checkpoint"));
    assert_eq!(
        rows(&next)[0]["eval_accuracy"],
        want[8]["eval_accuracy"],
        "evaluated with the weights of step 8"
    );
    // So does one from the export, built from its config.json; an argument contradicting it
    // is refused by name.
    let from_hf = format!("rl.init_from=\"{}\"", hf.display());
    let (out, hf_run) = job.run("from-hf", &[&from_hf, "training.steps=1"]);
    assert!(ok(&out).contains("policy: Hugging Face directory"));
    assert_eq!(rows(&hf_run)[0]["eval_accuracy"], want[8]["eval_accuracy"]);
    let (out, _) = job.run(
        "from-hf-refused",
        &[&from_hf, "training.steps=1", "model.args.rope_theta=1.0"],
    );
    user_error(
        &out,
        &["`model.args.rope_theta`", "rl.init_from", "config.json"],
    );
}

#[test]
fn trapping_and_endless_rewards_are_counted_and_the_run_completes() {
    let job = RlJob::new("faults", Some(&["trap 31=", "loop 21=", "ok 4213="]));
    // One group per prompt and step: 2 calls trap, 2 run into the 30 ms deadline (long before
    // the sandbox's fuel, 10^9 instructions, runs out), 2 score.
    let (out, run) = job.run(
        "run",
        &[
            "training.steps=3",
            "rl.prompts_per_step=3",
            "rl.group_size=2",
            "rl.eval_freq=0",
            "checkpoint.interval=0",
            "rl.samples_every=1",
            "rl.samples_per_step=100",
        ],
    );
    let stdout = ok(&out);
    let rows = rows(&run);
    let steps: Vec<u64> = rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3], "{stdout}");
    for r in &rows {
        // reward_errors counts every failed call, timeouts included.
        assert_eq!(r["reward_errors"], 4, "{r}");
        assert_eq!(r["reward_timeouts"], 2, "{r}");
    }
    assert!(run.join("checkpoints/step-3/manifest.json").is_file());
    // Each sample says which module failed and how; a failed call counts as the error reward.
    let all = samples(&run);
    assert_eq!(all.len(), 3 * 6);
    for s in &all {
        let module = &s["scores"][0];
        let (error, reward) = match s["prompt"].as_str().unwrap() {
            "trap 31=" => (Value::from("trap"), -1.0),
            "loop 21=" => (Value::from("timeout"), -1.0),
            _ => (Value::Null, module["score"].as_f64().unwrap()),
        };
        assert_eq!(module["error"], error, "{s}");
        assert_eq!(s["reward"], reward, "{s}");
        assert_eq!(module["message"].is_string(), !error.is_null(), "{s}");
    }
}

#[test]
fn a_deepseek_v3_policy_keeps_rollout_and_trainer_logprobs_equal_and_balances() {
    let job = RlJob::new("deepseek", None);
    let config = std::fs::read_to_string(job.dir.join("rl.toml")).unwrap();
    let config = config.replace("plugin = \"llama\"", "plugin = \"deepseek_v3\"").replace(
        "args = { dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, ffn_dim = 64, vocab_size = 272, max_seq_len = 64 }",
        "args = { dim = 32, n_layers = 2, n_heads = 2, vocab_size = 272, max_seq_len = 64, \
         q_lora_rank = 16, kv_lora_rank = 8, qk_nope_head_dim = 8, qk_rope_head_dim = 4, \
         v_head_dim = 8, ffn_dim = 64, first_k_dense = 1, n_experts = 4, top_k = 2, \
         expert_ffn_dim = 16, n_group = 2, topk_group = 1, mtp_layers = 1, balance_rate = 0.01 }",
    );
    assert!(config.contains("deepseek_v3") && config.contains("mtp_layers"));
    std::fs::write(job.dir.join("rl.toml"), config).unwrap();
    let (out, run) = job.run("run", &["training.steps=3", "checkpoint.interval=3"]);
    ok(&out);
    let rows = computed_rows(&run);
    let trained: Vec<&Value> = rows
        .iter()
        .filter(|r| r["step"].as_u64() > Some(0))
        .collect();
    assert_eq!(trained.len(), 3);
    for r in trained {
        // Synchronous RL: the trainer's forward (MLA over the whole sequence) reproduces the
        // rollout's cached decode bit for bit.
        assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{r}");
        assert!(r["mtp_loss"].as_f64().is_some_and(|v| v > 0.0), "{r}");
    }
    let saved = anneal_engine::io::load_safetensors(
        run.join("checkpoints/step-3/shard-00000-of-00001.safetensors"),
    )
    .unwrap();
    let bias = saved["model/layers.1.feed_forward.router.balance_bias"].to_vec_f32();
    assert!(bias.iter().any(|b| b.abs() > 1e-3), "{bias:?}");
}

#[test]
fn a_kimi_linear_policy_keeps_rollout_and_trainer_logprobs_equal() {
    // KDA blocks decode from the host-kept convolution tail and delta-rule state; MLA (no RoPE)
    // from its latent cache.
    let job = RlJob::new("kimi-linear", None);
    let config = std::fs::read_to_string(job.dir.join("rl.toml")).unwrap();
    let config = config
        .replace("plugin = \"llama\"", "plugin = \"deepseek_v3\"")
        .replace("flavor = \"debugmodel\"", "flavor = \"kimi_linear_debug\"")
        .replace(
            "args = { dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, ffn_dim = 64, vocab_size = 272, max_seq_len = 64 }",
            "args = { dim = 32, n_layers = 2, n_heads = 2, vocab_size = 272, max_seq_len = 64, \
             kv_lora_rank = 8, qk_nope_head_dim = 8, qk_rope_head_dim = 4, v_head_dim = 8, \
             ffn_dim = 64, n_experts = 4, top_k = 2, expert_ffn_dim = 16, \
             kda = { n_heads = 2, head_dim = 16, conv_kernel = 4, layers = [0] } }",
        );
    assert!(config.contains("kimi_linear_debug") && config.contains("kda"));
    std::fs::write(job.dir.join("rl.toml"), config).unwrap();
    let (out, run) = job.run("run", &["training.steps=3", "checkpoint.interval=3"]);
    ok(&out);
    let rows = computed_rows(&run);
    let trained: Vec<&Value> = rows
        .iter()
        .filter(|r| r["step"].as_u64() > Some(0))
        .collect();
    assert_eq!(trained.len(), 3);
    for r in trained {
        assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{r}");
    }
}
