//! Multi-turn `anneal rl` through the CLI with an environment module (core ABI, WAT): episodes
//! of two policy turns around an observation, on one process and sharded over two ranks
//! (`parallelism.dp_shard = 2`) — rollout and trainer logprobs stay bitwise equal (mismatch
//! exactly 0) and FSDP(2) and CP(2) follow the single process, as single-turn RL does;
//! recomputing blocks in backward (`[activation_checkpoint]`) changes no bit; every sample
//! records its turns. Hostile environments (an endless loop in `step`, a memory bomb, a 100 MB
//! observation, invalid UTF-8, an episode that never ends) and a policy whose tool call never
//! closes end their episodes with a clear error while the run goes on.

use anneal_tests::cli as common;

mod dist_support;
mod rl_layout_support;
mod rl_support;

use common::ok;
use rl_layout_support::follows_one_process;
use rl_support::{rl, rl_job, samples, steps};

/// Opens with the user message "go"; the first step answers "ok", the second ends the
/// episode with reward 1.
const ENV_WAT: &str = r#"(module
  (memory (export "memory") 1)
  (global $out_ptr (mut i32) (i32.const 0))
  (global $out_len (mut i32) (i32.const 0))
  (global $steps (mut i32) (i32.const 0))
  (data (i32.const 16) "{\22text\22:\22go\22}")
  (data (i32.const 64) "{\22observation\22:\22ok\22}")
  (data (i32.const 128) "{\22reward\22:1,\22done\22:true}")
  (func (export "alloc") (param i32) (result i32) (i32.const 4096))
  (func (export "output_ptr") (result i32) (global.get $out_ptr))
  (func (export "output_len") (result i32) (global.get $out_len))
  (func (export "env_init") (param i32 i32) (result i32)
    (global.set $out_ptr (i32.const 16))
    (global.set $out_len (i32.const 13))
    (i32.const 0))
  (func (export "env_step") (param i32 i32) (result i32)
    (global.set $steps (i32.add (global.get $steps) (i32.const 1)))
    (if (i32.eq (global.get $steps) (i32.const 1))
      (then (global.set $out_ptr (i32.const 64)) (global.set $out_len (i32.const 20)))
      (else (global.set $out_ptr (i32.const 128)) (global.set $out_len (i32.const 24))))
    (i32.const 0)))
"#;

/// `ENV_WAT` with `step` replaced by `body` (which leaves the output in `$out_ptr`/`$out_len`).
fn env_stepping(body: &str) -> String {
    let start = ENV_WAT
        .find("  (func (export \"env_step\")")
        .expect("env_step");
    format!(
        "{}  (func (export \"env_step\") (param i32 i32) (result i32)\n    {body}\n    (i32.const 0)))\n",
        &ENV_WAT[..start]
    )
}

/// The roles of a sample's turns, in order.
fn roles(sample: &serde_json::Value) -> Vec<&str> {
    sample["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["role"].as_str().unwrap())
        .collect()
}

/// A folder with the RL job of `rl_support`, a ChatML tokenizer and `env.wat`.
fn env_job(name: &str, env: &str) -> std::path::PathBuf {
    let dir = rl_job(name);
    // ChatML's turn markers: the policy's turns end with `<|im_end|>`.
    let docs: Vec<String> = (0..200)
        .map(|i| {
            let (p, a) = anneal_rl::rollout::digits_sort_task(99, i);
            format!("<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n")
        })
        .collect();
    let specials = anneal_data::chat::template::CHATML_SPECIALS;
    anneal_data::TextTokenizer::train_bpe_with_specials(&docs, 272, &specials)
        .unwrap()
        .save(&dir.join("tokenizer.json"))
        .unwrap();
    std::fs::write(dir.join("env.wat"), env).unwrap();
    dir
}

#[test]
fn multi_turn_rl_keeps_parity_and_fsdp_follows_one_process() {
    let dir = env_job("env", ENV_WAT);
    let env = format!(
        "rl.environment={:?}",
        dir.join("env.wat").display().to_string()
    );
    let sets = [
        env.as_str(),
        "rl.max_turns=2",
        "rl.max_new_tokens=5",
        "model.args.max_seq_len=128",
    ];
    let (out, one_dir) = rl(1, &dir, "one", &sets);
    ok(&out);
    let fsdp: Vec<&str> = sets
        .iter()
        .copied()
        .chain(["parallelism.dp_shard=2"])
        .collect();
    let (out, fsdp_dir) = rl(2, &dir, "fsdp2", &fsdp);
    ok(&out);
    follows_one_process("fsdp2", &one_dir, &fsdp_dir, (true, 1e-4));
    // Context parallelism splits each episode's row over the ranks, as for one turn.
    let cp: Vec<&str> = sets.iter().copied().chain(["parallelism.cp=2"]).collect();
    let (out, cp_dir) = rl(2, &dir, "cp2", &cp);
    ok(&out);
    follows_one_process("cp2", &one_dir, &cp_dir, (true, 1e-4));
    // Recomputing blocks in backward (every one, or a memory budget's plan) changes no value:
    // every step is the single process's, bit for bit.
    for (run, mode) in [
        ("full", &["activation_checkpoint.mode=\"full\""][..]),
        (
            "budget",
            &[
                "activation_checkpoint.mode=\"budget\"",
                "activation_checkpoint.memory_budget=0.5",
            ][..],
        ),
    ] {
        let set: Vec<&str> = sets.iter().copied().chain(mode.iter().copied()).collect();
        let (out, run_dir) = rl(1, &dir, run, &set);
        let stdout = ok(&out);
        if run == "budget" {
            assert!(stdout.contains("recompute blocks"), "{stdout}");
        }
        let (a, b) = (steps(&one_dir), steps(&run_dir));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            for key in ["loss", "grad_norm", "reward_mean"] {
                assert_eq!(
                    x[key].as_f64().map(f64::to_bits),
                    y[key].as_f64().map(f64::to_bits),
                    "{run} step {}: {key}",
                    x["step"]
                );
            }
        }
    }
    for run in [&one_dir, &fsdp_dir, &cp_dir] {
        let rows = samples(run);
        assert!(!rows.is_empty());
        for r in rows {
            assert_eq!(roles(&r), ["prompt", "policy", "tool", "policy"], "{r}");
            // The environment's reward plus the length reward of the last turn.
            let last = r["completion"].as_str().unwrap().len() as f64;
            assert_eq!(r["reward"].as_f64().unwrap(), 1.0 + last, "{r}");
        }
    }
}

#[test]
fn hostile_environments_end_their_episodes_and_the_run_goes_on() {
    let cases = [
        ("loop", "(loop $l (br $l))", "timeout"),
        (
            "memory",
            "(loop $l (br_if $l (i32.ne (memory.grow (i32.const 64)) (i32.const -1)))) unreachable",
            "memory_limit",
        ),
        (
            "flood",
            "(global.set $out_ptr (i32.const 0)) (global.set $out_len (i32.const 100000000))",
            "bad_output",
        ),
        (
            "utf8",
            "(i32.store8 (i32.const 80) (i32.const 255)) \
             (global.set $out_ptr (i32.const 64)) (global.set $out_len (i32.const 20))",
            "bad_output",
        ),
    ];
    for (name, body, kind) in cases {
        let dir = env_job(&format!("hostile-{name}"), &env_stepping(body));
        let env = format!(
            "rl.environment={:?}",
            dir.join("env.wat").display().to_string()
        );
        let sets = [
            env.as_str(),
            "training.steps=1",
            "rl.eval_freq=0",
            "rl.error_reward=-1.0",
            "rl.env_step_timeout_ms=200",
            "model.args.max_seq_len=128",
        ];
        let (out, run) = rl(1, &dir, "run", &sets);
        ok(&out);
        let rows = samples(&run);
        assert_eq!(rows.len(), 16, "{name}");
        for r in rows {
            let error = r["turns"][1]["error"].as_str().unwrap_or_default();
            assert!(error.starts_with(kind), "{name}: {r}");
            assert_eq!(r["reward"].as_f64(), Some(-1.0), "{name}: {r}");
        }
    }

    // An environment that never says done, with 10,000 turns allowed: every episode ends at
    // the context (128 positions), with what it earned.
    let dir = env_job(
        "hostile-endless",
        &env_stepping("(global.set $out_ptr (i32.const 64)) (global.set $out_len (i32.const 20))"),
    );
    let env = format!(
        "rl.environment={:?}",
        dir.join("env.wat").display().to_string()
    );
    let sets = [
        env.as_str(),
        "training.steps=1",
        "rl.eval_freq=0",
        "rl.max_turns=10000",
        "model.args.max_seq_len=128",
    ];
    let (out, run) = rl(1, &dir, "run", &sets);
    ok(&out);
    for r in samples(&run) {
        let turns = r["turns"].as_array().unwrap();
        assert!(turns.len() > 3, "{r}");
        let last = turns.last().unwrap()["error"].as_str().unwrap_or_default();
        assert!(last.starts_with("max_episode_tokens"), "{r}");
    }
}

#[test]
fn a_tool_call_that_never_closes_ends_its_episode_with_the_error_reward() {
    let dir = env_job("unclosed", ENV_WAT);
    // ChatML for the warm start and the episodes alike.
    let config = serde_json::json!({
        "chat_template": anneal_data::chat::template::CHATML,
        "eos_token": "<|im_end|>",
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    // A warm start on transcripts whose assistant opens a tool call and ends its turn inside it.
    let data = dir.join("unclosed.jsonl");
    let line = r#"{"messages":[{"role":"user","content":"go"},{"role":"assistant","content":"<tool_call>{\"name\": \"x\""}]}"#;
    std::fs::write(&data, vec![line; 64].join("\n")).unwrap();
    let sft = format!(
        r#"[model]
plugin = "llama"
flavor = "debugmodel"
args = {{ dim = 32, n_layers = 2, n_heads = 2, n_kv_heads = 2, ffn_dim = 64, vocab_size = 272, max_seq_len = 64 }}
[optimizer]
plugin = "adamw"
lr = 1e-2
[training]
steps = 60
batch_size = 8
micro_batch_size = 8
seq_len = 48
seed = 1
threads = 1
[data]
path = "{data}"
format = "chat"
tokenizer = "{tok}"
val_fraction = 0.0
[checkpoint]
interval = 60
[metrics]
log_freq = 10
eval_freq = 0
progress_bar = false
"#,
        data = data.display(),
        tok = dir.join("tokenizer.json").display(),
    );
    std::fs::write(dir.join("sft.toml"), sft).unwrap();
    let out = anneal_tests::cli::anneal()
        .arg("train")
        .arg(dir.join("sft.toml"))
        .arg("--run-dir")
        .arg(dir.join("sft"))
        .output()
        .unwrap();
    ok(&out);
    let env = format!(
        "rl.environment={:?}",
        dir.join("env.wat").display().to_string()
    );
    let init = format!(
        "rl.init_from={:?}",
        dir.join("sft/checkpoints/step-60").display().to_string()
    );
    let (out, run) = rl(
        1,
        &dir,
        "rl",
        &[
            &env,
            &init,
            "rl.max_turns=2",
            "rl.max_new_tokens=16",
            "rl.error_reward=-1.0",
            "training.steps=2",
        ],
    );
    ok(&out);
    let rows = samples(&run);
    let unclosed: Vec<&serde_json::Value> = rows
        .iter()
        .filter(|r| {
            r["turns"].as_array().unwrap().iter().any(|t| {
                t["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("never closes"))
            })
        })
        .collect();
    assert!(!unclosed.is_empty(), "{rows:?}");
    for r in unclosed {
        // The episode ended on the policy's turn: no observation followed it.
        assert_eq!(roles(r), ["prompt", "policy"], "{r}");
        assert_eq!(r["reward"].as_f64(), Some(-1.0), "{r}");
    }
    let errors: u64 = steps(&run)
        .iter()
        .map(|r| r["reward_errors"].as_u64().unwrap_or(0))
        .sum();
    assert!(errors > 0);
}
