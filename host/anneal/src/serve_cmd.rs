//! `anneal serve`: the web UI, the run registry and the OpenAI-compatible endpoint; and
//! `anneal supervise`, the small process that stands between the server and each training
//! process.

use crate::errors::UserError;
use crate::user_bail;
use anneal_server::{serve, RewardTestBudget, ServerOptions};
use anyhow::{Context, Result};
use clap::Args;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Arguments of `anneal serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Where to listen. Anything but a loopback address needs a token.
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// The registry (registry.sqlite), run directories and reward modules live here.
    #[arg(long, value_name = "DIR", default_value = "runs", env = "ANNEAL_HOME")]
    home: PathBuf,
    /// A token every API call must send as `Authorization: Bearer <token>` (may start with `-`).
    #[arg(
        long,
        env = "ANNEAL_TOKEN",
        hide_env_values = true,
        allow_hyphen_values = true
    )]
    token: Option<String>,
    /// The config files offered to new runs (runs may only name files in it).
    #[arg(long, value_name = "DIR", default_value = "configs")]
    configs: PathBuf,
    /// The browser UI's files (default: web/ here, or in the source tree of this binary).
    #[arg(long, value_name = "DIR")]
    web: Option<PathBuf>,
    /// How many runs may train at once; more wait as `queued`.
    #[arg(long, value_name = "N", default_value_t = 1)]
    max_running: usize,
    /// The largest reward module upload, in MiB (what `anneal reward test` and `anneal rl`
    /// load by default).
    #[arg(long, value_name = "MIB", default_value_t = anneal_reward::MAX_MODULE_BYTES >> 20)]
    max_upload_mb: usize,
    /// The wall time one reward test request may use across all its inputs, in seconds.
    #[arg(long, value_name = "S", default_value_t = 30.0)]
    reward_test_seconds: f64,
    /// The fuel one reward test request may use across all its inputs.
    #[arg(long, value_name = "FUEL", default_value_t = 10_000_000_000)]
    reward_test_fuel: u64,
    /// Serve a model on the OpenAI-compatible endpoint (/v1): a checkpoint step directory
    /// (served as <run>-step-<N>), a Hugging Face directory (served as its folder name), or a
    /// model id (`org/name[@revision]`) of the local Hugging Face cache (served as the id).
    /// Repeatable.
    #[arg(long = "model", value_name = "PATH")]
    models: Vec<PathBuf>,
    /// Most requests one model decodes together (continuous batching); more wait for a row.
    #[arg(long, value_name = "N", default_value_t = 64)]
    max_batch: usize,
}

/// Runs the server until SIGINT or SIGTERM.
pub fn serve_cmd(args: ServeArgs) -> Result<()> {
    let addr: SocketAddr = args.addr.parse().map_err(|_| {
        UserError(format!(
            "--addr {}: expected IP:PORT, e.g. 127.0.0.1:8080",
            args.addr
        ))
    })?;
    if args.token.is_none() && !addr.ip().is_loopback() {
        user_bail!("{addr} is not a loopback address: give a token (--token or ANNEAL_TOKEN) to listen on it");
    }
    if args.max_running == 0 {
        user_bail!("--max-running must be at least 1");
    }
    if args.max_batch == 0 {
        user_bail!("--max-batch must be at least 1");
    }
    if args.token.as_deref().is_some_and(|t| t.trim().is_empty()) {
        user_bail!("the token is empty");
    }
    let reward_test_time = Duration::try_from_secs_f64(args.reward_test_seconds)
        .ok()
        .filter(|t| !t.is_zero())
        .ok_or_else(|| {
            UserError(format!(
                "--reward-test-seconds {}: expected a positive number",
                args.reward_test_seconds
            ))
        })?;
    let exe = std::env::current_exe().context("cannot find the anneal binary")?;
    let work_dir = std::env::current_dir().context("cannot read the current directory")?;
    let home = absolute(&work_dir, &args.home);
    let web_dir = match args.web {
        Some(dir) if dir.join("index.html").is_file() => Some(absolute(&work_dir, &dir)),
        Some(dir) => user_bail!("--web {}: no index.html there", dir.display()),
        None => default_web_dir(&work_dir, &exe),
    };
    // A model id (`org/name[@revision]`) that is not a path is its local Hugging Face cache
    // snapshot.
    let mut models = Vec::with_capacity(args.models.len());
    for m in &args.models {
        match anneal_runtime::hf::hub::resolve(&m.to_string_lossy()) {
            Ok(dir) => models.push(absolute(&work_dir, &dir)),
            Err(e) => user_bail!("--model: {e}"),
        }
    }
    let options = ServerOptions {
        addr,
        home,
        token: args.token,
        configs_dir: absolute(&work_dir, &args.configs),
        web_dir,
        work_dir,
        exe,
        max_running: args.max_running,
        max_upload_bytes: args.max_upload_mb.saturating_mul(1 << 20),
        reward_test: RewardTestBudget {
            time: reward_test_time,
            fuel: args.reward_test_fuel,
        },
        models,
        max_batch: args.max_batch,
    };
    if options.web_dir.is_none() {
        eprintln!("warning: web/ not found; serving the API only (pass --web DIR)");
    }
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let served = runtime.block_on(serve(options, |bound| {
        // Tests read this line to learn the port when started with port 0.
        println!("anneal serve: listening on http://{bound}");
    }));
    // Dropping a runtime waits for its blocking threads without end; a reward call still in
    // flight must not keep the process alive after SIGTERM (it ends within its deadline anyway).
    runtime.shutdown_timeout(Duration::from_millis(500));
    served?;
    Ok(())
}

fn absolute(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// `web/` in the working directory, else in the source tree the binary was built in
/// (`target/<profile>/anneal` → `web/`).
fn default_web_dir(work_dir: &Path, exe: &Path) -> Option<PathBuf> {
    let here = work_dir.join("web");
    let built = exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .map(|root| root.join("web"));
    std::iter::once(here)
        .chain(built)
        .find(|d| d.join("index.html").is_file())
}

/// Arguments of `anneal supervise` (started by the server, not by hand).
#[derive(Args)]
pub struct SuperviseArgs {
    /// The run directory: the log and the exit record go there.
    #[arg(long, value_name = "DIR")]
    run_dir: PathBuf,
    /// The anneal command to run, e.g. `train CONFIG --run-dir DIR`.
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

/// Runs the trainer, waits for it, writes the exit record; exits with the trainer's code.
pub fn supervise_cmd(args: SuperviseArgs) -> Result<u8> {
    let exe = std::env::current_exe().context("cannot find the anneal binary")?;
    let code = anneal_server::process::supervise(&args.run_dir, &exe, &args.command)
        .with_context(|| format!("supervising a run in {}", args.run_dir.display()))?;
    Ok(u8::try_from(code).unwrap_or(1))
}
