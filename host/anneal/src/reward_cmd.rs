//! `anneal reward ...`: run reward modules (WebAssembly) from the command line.

use crate::errors::UserError;
use crate::user_bail;
use anneal_reward::{Sandbox, SandboxConfig, ScoreInput, ScoreOutcome};
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The subcommands of `anneal reward`.
#[derive(Subcommand)]
pub enum RewardCommand {
    /// Score JSON lines `{"prompt":..,"completion":..,"metadata":{..}}` with a reward module
    /// and print one JSON line per input: score or error kind, details, fuel and microseconds.
    Test(TestArgs),
}

/// Arguments of `anneal reward test`.
#[derive(Args)]
pub struct TestArgs {
    /// The reward module: a core module or component (`.wasm`) or WebAssembly text (`.wat`).
    module: PathBuf,
    /// The JSON lines file to score (standard input if absent).
    #[arg(long, value_name = "FILE.jsonl")]
    input: Option<PathBuf>,
    /// Fuel per call (about one unit per WASM instruction).
    #[arg(long, value_name = "N", default_value_t = SandboxConfig::default().fuel)]
    fuel: u64,
    /// Wall-clock deadline per call, in milliseconds.
    #[arg(long, value_name = "T", default_value_t = 2000)]
    timeout_ms: u64,
    /// Memory limit per call, in MiB.
    #[arg(long, value_name = "M", default_value_t = 256)]
    memory_mb: usize,
    /// The reward printed for a failed call.
    #[arg(
        long,
        value_name = "R",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    error_reward: f64,
    /// A directory to cache compiled modules in (large components compile in seconds).
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Forward the module's stdout and stderr (WASI) to this process's, for debugging.
    #[arg(long)]
    stdio: bool,
}

/// Runs one `anneal reward` subcommand.
pub fn run(command: RewardCommand) -> Result<()> {
    match command {
        RewardCommand::Test(args) => test(args),
    }
}

fn test(args: TestArgs) -> Result<()> {
    let memory_bytes = args
        .memory_mb
        .checked_mul(1 << 20)
        .ok_or_else(|| UserError(format!("--memory-mb {} is too large", args.memory_mb)))?;
    if args.timeout_ms == 0 {
        user_bail!("--timeout-ms must be at least 1");
    }
    let mut config = SandboxConfig {
        fuel: args.fuel,
        timeout: Duration::from_millis(args.timeout_ms),
        memory_bytes,
        error_reward: args.error_reward,
        cache_dir: args.cache_dir,
        ..SandboxConfig::default()
    };
    config.grants.stdio = args.stdio;
    let sandbox = Sandbox::new(config)?;
    let module = sandbox.load_file(&args.module)?;
    if let Some(problem) = module.abi_problem() {
        eprintln!(
            "warning: {} does not match the reward ABI ({problem}); every call will fail with abi_mismatch",
            args.module.display()
        );
    }
    let (reader, source) = crate::reward_cmd::open_lines(args.input.as_deref())?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for (index, line) in reader.lines().enumerate() {
        let number = index + 1;
        let line = line.map_err(|e| {
            let msg = format!("cannot read {source} line {number}: {e}");
            // Text that is not UTF-8 is the input's problem; anything else is the system's.
            if e.kind() == std::io::ErrorKind::InvalidData {
                UserError(msg).into()
            } else {
                anyhow::Error::new(e).context(format!("cannot read {source} line {number}"))
            }
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let input: ScoreInput = serde_json::from_str(&line).map_err(|e| {
            UserError(format!(
                "{source} line {number}: expected {{\"prompt\":..,\"completion\":..,\"metadata\":{{..}}}} ({e})"
            ))
        })?;
        let outcome = sandbox.score(&module, &input);
        writeln!(out, "{}", outcome_json(number, &outcome)).context("cannot write to stdout")?;
        out.flush().context("cannot write to stdout")?;
    }
    let metrics = serde_json::to_string(&sandbox.metrics_snapshot())
        .context("cannot serialize the metrics")?;
    eprintln!("metrics: {metrics}");
    Ok(())
}

/// One output line: the input's line number, then the outcome's fields.
fn outcome_json(line: usize, outcome: &ScoreOutcome) -> Value {
    let mut v = json!({ "line": line });
    if let (Some(out), Value::Object(fields)) = (v.as_object_mut(), outcome.to_json()) {
        out.extend(fields);
    }
    v
}

/// The JSON lines a test command reads: the file `input`, or standard input; and its name for
/// messages.
pub(crate) fn open_lines(input: Option<&Path>) -> Result<(Box<dyn BufRead>, String), UserError> {
    match input {
        Some(path) => {
            let file = std::fs::File::open(path)
                .map_err(|e| UserError(format!("cannot open {}: {e}", path.display())))?;
            Ok((
                Box::new(std::io::BufReader::new(file)),
                path.display().to_string(),
            ))
        }
        None => Ok((Box::new(std::io::stdin().lock()), "<stdin>".to_string())),
    }
}
