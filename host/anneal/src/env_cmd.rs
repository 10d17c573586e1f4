//! `anneal env ...`: run RL environments (WebAssembly) from the command line.

use crate::errors::UserError;
use crate::user_bail;
use anneal_data::chat::tools::parse_tool_calls;
use anneal_reward::{EpisodeLimits, Sandbox, SandboxConfig};
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Duration;

/// The subcommands of `anneal env`.
#[derive(Subcommand)]
pub enum EnvCommand {
    /// Play scripted episodes: JSON lines `{"task":{..},"turns":["..", ..]}` (a turn is the
    /// policy's text, tool calls as `<tool_call>{"name":..,"arguments":{..}}</tool_call>`, or a
    /// turn object `{"text","content","tool_calls","error"}`). Prints one JSON line per event:
    /// the start (messages, tools), each step (observation, reward, done, details or the error)
    /// and the end (steps, return, fuel, microseconds).
    Test(TestArgs),
}

/// Arguments of `anneal env test`.
#[derive(Args)]
pub struct TestArgs {
    /// The environment: a core module or component (`.wasm`) or WebAssembly text (`.wat`).
    module: PathBuf,
    /// The JSON lines file of episodes (standard input if absent).
    #[arg(long, value_name = "FILE.jsonl")]
    input: Option<PathBuf>,
    /// Fuel per call (init, one step, close).
    #[arg(long, value_name = "N", default_value_t = EpisodeLimits::default().step_fuel)]
    step_fuel: u64,
    /// Wall-clock deadline per call, in milliseconds.
    #[arg(long, value_name = "T", default_value_t = 2000)]
    step_timeout_ms: u64,
    /// Fuel of all calls of an episode together.
    #[arg(long, value_name = "N", default_value_t = EpisodeLimits::default().episode_fuel)]
    episode_fuel: u64,
    /// Wall-clock time of all calls of an episode together, in milliseconds.
    #[arg(long, value_name = "T", default_value_t = 30000)]
    episode_timeout_ms: u64,
    /// The largest output of one call, in bytes.
    #[arg(long, value_name = "B", default_value_t = EpisodeLimits::default().max_output_bytes)]
    max_output_bytes: usize,
    /// Memory limit of an episode's instance, in MiB.
    #[arg(long, value_name = "M", default_value_t = 256)]
    memory_mb: usize,
    /// A directory to cache compiled modules in (large components compile in seconds).
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Forward the module's stdout and stderr (WASI) to this process's, for debugging.
    #[arg(long)]
    stdio: bool,
}

/// Runs one `anneal env` subcommand.
pub fn run(command: EnvCommand) -> Result<()> {
    match command {
        EnvCommand::Test(args) => test(args),
    }
}

fn test(args: TestArgs) -> Result<()> {
    let memory_bytes = args
        .memory_mb
        .checked_mul(1 << 20)
        .ok_or_else(|| UserError(format!("--memory-mb {} is too large", args.memory_mb)))?;
    if args.step_timeout_ms == 0 || args.episode_timeout_ms == 0 {
        user_bail!("--step-timeout-ms and --episode-timeout-ms must be at least 1");
    }
    let limits = EpisodeLimits {
        step_fuel: args.step_fuel,
        step_timeout: Duration::from_millis(args.step_timeout_ms),
        episode_fuel: args.episode_fuel,
        episode_timeout: Duration::from_millis(args.episode_timeout_ms),
        max_output_bytes: args.max_output_bytes,
    };
    let mut config = SandboxConfig {
        memory_bytes,
        cache_dir: args.cache_dir,
        ..SandboxConfig::default()
    };
    config.grants.stdio = args.stdio;
    let sandbox = Sandbox::new(config)?;
    let module = sandbox.load_env_file(&args.module)?;
    if let Some(problem) = module.abi_problem() {
        eprintln!(
            "warning: {} does not match the environment ABI ({problem}); every episode will fail with abi_mismatch",
            args.module.display()
        );
    }
    let (reader, source) = crate::reward_cmd::open_lines(args.input.as_deref())?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut print = |v: Value| -> Result<()> {
        writeln!(out, "{v}").context("cannot write to stdout")?;
        out.flush().context("cannot write to stdout")
    };
    for (index, line) in reader.lines().enumerate() {
        let number = index + 1;
        let line = line.map_err(|e| {
            let msg = format!("cannot read {source} line {number}: {e}");
            if e.kind() == std::io::ErrorKind::InvalidData {
                UserError(msg).into()
            } else {
                anyhow::Error::new(e).context(format!("cannot read {source} line {number}"))
            }
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let expected = || {
            UserError(format!(
                "{source} line {number}: expected {{\"task\":{{..}},\"turns\":[\"..\", ..]}}"
            ))
        };
        let script: Value =
            serde_json::from_str(&line).map_err(|e| UserError(format!("{}: {e}", expected().0)))?;
        let task = script.get("task").ok_or_else(expected)?;
        let turns = match script.get("turns") {
            None => &[][..],
            Some(Value::Array(turns)) => &turns[..],
            Some(_) => return Err(expected().into()),
        };
        let turns = turns
            .iter()
            .enumerate()
            .map(|(i, t)| match t {
                Value::String(text) => Ok(parse_tool_calls(text).to_step_json(text)),
                Value::Object(_) => Ok(t.clone()),
                _ => Err(UserError(format!(
                    "{source} line {number}: turns[{i}] is neither text nor a turn object"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (mut episode, start) = match sandbox.start_episode(&module, task, limits) {
            Ok(started) => started,
            Err(e) => {
                print(
                    json!({"line": number, "event": "start", "error": e.kind(), "message": e.message()}),
                )?;
                continue;
            }
        };
        print(json!({
            "line": number, "event": "start", "error": null,
            "messages": start.messages, "tools": start.tools,
            "fuel": episode.fuel_used(), "micros": episode.micros(),
        }))?;
        let mut total = 0.0;
        for (i, turn) in turns.iter().enumerate() {
            let mut v = json!({"line": number, "event": "step", "turn": i});
            match episode.step(turn) {
                Ok(outcome) => {
                    total += outcome.reward;
                    v["error"] = Value::Null;
                    if let (Some(obj), Value::Object(fields)) =
                        (v.as_object_mut(), outcome.to_json())
                    {
                        obj.extend(fields);
                    }
                }
                Err(e) => {
                    v["error"] = json!(e.kind());
                    v["message"] = json!(e.message());
                }
            }
            print(v)?;
            if episode.is_over() {
                break;
            }
        }
        let end = json!({
            "line": number, "event": "end", "steps": episode.steps(), "return": total,
            "done": episode.is_over(), "fuel": episode.fuel_used(), "micros": episode.micros(),
        });
        episode.close();
        print(end)?;
    }
    let metrics = serde_json::to_string(&sandbox.metrics_snapshot())
        .context("cannot serialize the metrics")?;
    eprintln!("metrics: {metrics}");
    Ok(())
}
