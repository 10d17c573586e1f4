//! Multi-turn `anneal rl` through the CLI with an environment module (core ABI, WAT): episodes
//! of two policy turns around an observation, on one process and sharded over two ranks
//! (`parallelism.dp_shard = 2`) — rollout and trainer logprobs stay bitwise equal (mismatch
//! exactly 0) and FSDP(2) follows the single process, as single-turn RL does; every sample
//! records its turns.

use anneal_tests::cli as common;

mod dist_support;
mod rl_layout_support;
mod rl_support;

use common::ok;
use rl_layout_support::follows_one_process;
use rl_support::{rl, rl_job, samples};

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

#[test]
fn multi_turn_rl_keeps_parity_and_fsdp_follows_one_process() {
    let dir = rl_job("env");
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
    std::fs::write(dir.join("env.wat"), ENV_WAT).unwrap();
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
    for run in [&one_dir, &fsdp_dir] {
        let rows = samples(run);
        assert!(!rows.is_empty());
        for r in rows {
            let roles: Vec<&str> = r["turns"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["role"].as_str().unwrap())
                .collect();
            assert_eq!(roles, ["prompt", "policy", "tool", "policy"], "{r}");
            // The environment's reward plus the length reward of the last turn.
            let last = r["completion"].as_str().unwrap().len() as f64;
            assert_eq!(r["reward"].as_f64().unwrap(), 1.0 + last, "{r}");
        }
    }
}
